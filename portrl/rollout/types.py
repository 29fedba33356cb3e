"""Value types of the rollout contract: :class:`SamplingParams` in, :class:`RolloutOutput` out.

Log-prob convention (every engine follows it, the trainer relies on it): ``logprobs[r][t]`` is
``log_softmax(logits_t / temperature)[token_t]``, the log-probability of the sampled token under
the temperature-scaled distribution, *before* top-k / top-p truncation, which is exactly what the
trainer's own forward computes with ``compute_logprobs(..., temperature=T)``. With
``temperature == 0`` (greedy) it is ``log_softmax(logits_t)[token_t]`` (temperature 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"  # ended on EOS or one of ``stop_token_ids`` (that token is the last response token)
FINISH_LENGTH = "length"  # reached ``max_new_tokens``
FINISH_ABORT = "abort"  # stopped by an interrupt (RolloutEngine.set_interrupt) before either: the prefix so far


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k=-1`` and ``top_p=1.0`` disable truncation; ``temperature=0`` is greedy.

    ``stop_token_ids`` are added to the engine's EOS ids; a row stops right after emitting one.
    ``seed`` makes a call reproducible on one engine and device (None: drawn from torch's global RNG).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            problems.append(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an int or None, got {self.seed!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RolloutOutput:
    """Result of one ``generate`` call: ``len(prompts) * n`` rows, prompt-major
    (row ``i * n + j`` is sample ``j`` of prompt ``i``). Each response includes its stop token."""

    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.response_ids) == len(self.logprobs) == len(self.finish_reasons):
            raise ValueError(
                f"RolloutOutput fields disagree: {len(self.response_ids)} responses, "
                f"{len(self.logprobs)} logprob rows, {len(self.finish_reasons)} finish reasons"
            )
        for r, (ids, lps) in enumerate(zip(self.response_ids, self.logprobs)):
            if len(ids) != len(lps):
                raise ValueError(f"row {r}: {len(ids)} response tokens but {len(lps)} logprobs")

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        """Generated tokens in all rows (stop tokens included)."""
        return sum(len(ids) for ids in self.response_ids)
