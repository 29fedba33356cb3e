"""RewardManager: scores a batch of responses, shapes them, and places them on the last token.

``score`` calls the built-in ``compute_score`` (or a custom function) on each row, in a pool of
spawned processes when the batch has at least ``parallel_threshold`` rows and ``num_workers > 1``.
A result is a float (acc = score > 0) or a dict with "score" (and optionally "acc"; other keys are
returned in ``RewardResult.extra`` as lists with None where a row lacks them). With
``overlong_buffer.enable`` the DAPO overlong reward (portrl.algo.overlong_penalty) is added to the score.
Multi-turn rollouts: :func:`turn_extra_infos` gives the reward function each row's ``num_turns`` and
``turn_rewards``, :func:`place_turn_rewards` puts the turns' rewards on their end tokens.

``timeout_s`` limits the wall-clock time of scoring one batch (``reward.timeout_s``; how, and what can be
interrupted: portrl.rewards.time_limit). Past it, ``on_timeout="error"`` raises :class:`RewardTimeoutError`
naming the function and the row it was at; ``"zero"`` keeps the rows already scored, scores the rest 0 (acc 0)
and logs a warning.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from concurrent.futures import wait as wait_futures
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, Mapping, Sequence

import torch

from portrl.algo import overlong_penalty
from portrl.errors import UserError
from portrl.rewards.custom import RewardFileError, RewardFunctionError, load_custom_reward
from portrl.rewards.registry import compute_score
from portrl.rewards.shaping import overlong_buffer_settings
from portrl.rewards.time_limit import TimeLimitReached, call_with_time_limit, check_deadline

log = logging.getLogger(__name__)
ON_TIMEOUT = ("error", "zero")


class RewardTimeoutError(RewardFunctionError):
    """Scoring a batch took longer than ``reward.timeout_s`` (the message names the function and the row)."""


def describe_reward(custom: tuple[str, str] | None) -> str:
    """How messages name the reward function: the custom one's name and file, or the built-in one."""
    return f"custom reward {custom[1]!r} from {custom[0]!r}" if custom is not None else "built-in reward"


@dataclass
class RewardResult:
    scores: torch.Tensor  # (B,) float32, after shaping
    acc: torch.Tensor  # (B,) float32 in {0, 1}
    extra: dict[str, list] = field(default_factory=dict)


def _score_rows(custom: tuple[str, str] | None, kwargs: dict, rows: list[tuple], out: list | None = None,
                deadline: float | None = None) -> list[tuple[float, float, dict]]:
    """Score (index, data_source, response, ground_truth, extra_info) rows; runs in a worker or inline.
    Results are appended to ``out`` (a new list by default; the rows scored so far when the time runs out);
    past ``deadline`` (time.monotonic) it raises TimeLimitReached before the next row."""
    if custom is not None:
        fn, what = load_custom_reward(*custom), f"custom reward {custom[1]!r} from {custom[0]!r}"
    else:
        fn, what = compute_score, "built-in reward"
    out = [] if out is None else out
    for index, source, response, truth, extra in rows:
        check_deadline(deadline)
        try:
            result = fn(source, response, truth, extra, **kwargs)
        except Exception as exc:
            raise RewardFunctionError(f"{what} raised on row {index} (data_source {source!r}): "
                                      f"{type(exc).__name__}: {exc}") from None
        if isinstance(result, Mapping):
            if "score" not in result:
                raise RewardFunctionError(f"{what} returned a dict without 'score' on row {index}: keys {sorted(result)}")
            score = float(result["score"])
            acc = float(result["acc"]) if result.get("acc") is not None else float(score > 0)
            rest = {k: v for k, v in result.items() if k not in ("score", "acc")}
        elif isinstance(result, (int, float)):
            score, acc, rest = float(result), float(result > 0), {}
        else:
            raise RewardFunctionError(f"{what} returned {type(result).__name__} on row {index}; expected float or dict")
        if not math.isfinite(score):
            raise RewardFunctionError(f"{what} returned a non-finite score {score} on row {index}")
        out.append((score, acc, rest))
    return out


class RewardManager:
    """Batch reward computation (see the module docstring)."""

    def __init__(self, custom_path: str | None = None, custom_name: str | None = None,
                 overlong_buffer: Mapping | None = None, max_response_length: int | None = None,
                 num_workers: int | None = None, parallel_threshold: int = 256,
                 reward_kwargs: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                 on_timeout: str = "error"):
        if custom_name and not custom_path:
            raise RewardFileError("reward.custom.name is set but reward.custom.path is not; set reward.custom.path "
                                  "to the Python file that defines the function")
        self.custom = None
        if custom_path:
            load_custom_reward(custom_path, custom_name or "compute_score")  # fail early, in the driver
            self.custom = (str(custom_path), custom_name or "compute_score")
        self.overlong = overlong_buffer_settings(overlong_buffer, max_response_length)
        self.max_response_length = max_response_length
        self.num_workers = max(1, int(num_workers if num_workers is not None else min(8, os.cpu_count() or 1)))
        self.parallel_threshold = int(parallel_threshold)
        self.reward_kwargs = dict(reward_kwargs or {})
        self._pool: ProcessPoolExecutor | None = None
        if timeout_s is not None and float(timeout_s) < 0:
            raise UserError(f"reward.timeout_s={timeout_s} is negative; give seconds > 0 (0 or null: no limit)")
        self.timeout_s = float(timeout_s) if timeout_s else None
        if on_timeout not in ON_TIMEOUT:
            raise UserError(f"reward.on_timeout={on_timeout!r} is not valid; valid: {', '.join(ON_TIMEOUT)}")
        self.on_timeout = on_timeout

    def _pool_get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.num_workers, mp_context=get_context("spawn"),
                                             initializer=_ignore_sigint)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def score(self, responses: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[str],
              extra_infos: Sequence[dict | None] | None = None,
              response_lengths: Sequence[int] | None = None) -> RewardResult:
        """Score B decoded responses; ``response_lengths`` (tokens) is needed for overlong shaping."""
        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        for name, seq in (("data_sources", data_sources), ("ground_truths", ground_truths), ("extra_infos", extra_infos)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} rows but responses has {n}")
        rows = [(i, data_sources[i], responses[i], ground_truths[i], extra_infos[i]) for i in range(n)]
        if n >= self.parallel_threshold and self.num_workers > 1:
            results = self._score_in_pool(rows)
        else:
            results = self._score_inline(rows)
        scores = [r[0] for r in results]
        extra: dict[str, list] = {}
        for i, (_, _, rest) in enumerate(results):
            for k, v in rest.items():
                extra.setdefault(k, [None] * n)[i] = v
        if self.overlong is not None and self.max_response_length is not None:  # settings need both
            if response_lengths is None or len(response_lengths) != n:
                raise ValueError("overlong shaping needs response_lengths (one per response)")
            penalties = overlong_penalty(list(response_lengths), self.max_response_length, *self.overlong).tolist()
            extra["raw_score"] = scores
            extra["overlong_reward"] = penalties
            extra["overlong"] = [int(L) >= self.max_response_length for L in response_lengths]
            scores = [s + p for s, p in zip(scores, penalties)]
        return RewardResult(torch.tensor(scores, dtype=torch.float32),
                            torch.tensor([r[1] for r in results], dtype=torch.float32), extra)


    # ------------------------------------------------------------------------------- time limit
    def _score_inline(self, rows: list[tuple]) -> list[tuple[float, float, dict]]:
        if self.timeout_s is None:
            return _score_rows(self.custom, self.reward_kwargs, rows)
        done: list = []
        deadline = time.monotonic() + self.timeout_s
        try:
            call_with_time_limit(lambda: _score_rows(self.custom, self.reward_kwargs, rows, done, deadline),
                                 self.timeout_s)
        except TimeLimitReached:
            pass
        return self._complete(rows, done + [None] * (len(rows) - len(done)))

    def _score_in_pool(self, rows: list[tuple]) -> list[tuple[float, float, dict]]:
        size = max(1, math.ceil(len(rows) / (self.num_workers * 4)))
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        futures = [self._pool_get().submit(_score_rows, self.custom, self.reward_kwargs, c) for c in chunks]
        _, late = wait_futures(futures, timeout=self.timeout_s)
        if late:  # a process stuck in a reward function: only ending the processes stops it
            self._terminate_pool()
        results: list = []
        for f, chunk in zip(futures, chunks):
            results += f.result() if f not in late else [None] * len(chunk)
        return self._complete(rows, results)

    def _complete(self, rows: list[tuple], results: list) -> list[tuple[float, float, dict]]:
        """``results`` with None for the rows not scored in time: RewardTimeoutError, or 0 with a warning."""
        missing = [i for i, r in enumerate(results) if r is None]
        if not missing:
            return results
        index, source = rows[missing[0]][0], rows[missing[0]][1]
        what = (f"{describe_reward(self.custom)} did not score a batch of {len(rows)} rows within "
                f"reward.timeout_s={self.timeout_s:g}s ({len(missing)} rows left, the first row {index}, "
                f"data_source {source!r})")
        if self.on_timeout == "error":
            raise RewardTimeoutError(f"{what}; make it faster, raise reward.timeout_s, or set reward.on_timeout=zero "
                                     "to score the rows left 0")
        log.warning("%s: those rows score 0 (reward.on_timeout=zero)", what)
        return [r if r is not None else (0.0, 0.0, {}) for r in results]

    def _terminate_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)


def _ignore_sigint() -> None:
    """Reward pool processes leave Ctrl-C to the trainer (the terminal sends it to the whole process group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """token_level_scores (B, T): each score at its row's last response token (mask == 1), 0 elsewhere.

    A row without any response token gets no reward.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be (B,) and response_mask (B, T); got {tuple(scores.shape)} and "
                         f"{tuple(response_mask.shape)}")
    mask = response_mask.to(torch.bool)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                      device=scores.device)
    has = last >= 0
    rows = torch.nonzero(has).squeeze(1)
    out[rows, last[rows]] = scores[rows].to(out.dtype)
    return out


def place_turn_rewards(token_level_scores: torch.Tensor, response_mask: torch.Tensor,
                       turn_ends: Sequence[Sequence[int]], turn_rewards: Sequence[Sequence[float]]) -> torch.Tensor:
    """``token_level_scores`` with each model turn's reward added at that turn's end token (a new tensor).

    For row ``i`` and turn ``k`` with end position ``e_ik`` (``turn_ends``) and reward ``R_ik`` (``turn_rewards``)::

        out[i, τ(e_ik)] += R_ik,    τ(e) = max{t ≤ e : m_it = 1}

    ``τ(e) = e`` when ``e`` is a model token (``response_mask`` 1), as the agent loop records it; an empty turn,
    whose end falls on a tool token, gives its reward to the model token before it, or, when there is none, to
    the row's last model token. A row without any model token gets nothing. The outcome score already in
    ``token_level_scores`` (on the last model token, :func:`place_on_last_token`) stays. An end outside the row's
    ``T`` positions, or a row whose ends and rewards differ in number, is a ValueError (broken bookkeeping).
    """
    B, T = token_level_scores.shape
    if response_mask.shape != (B, T) or len(turn_ends) != B or len(turn_rewards) != B:
        raise ValueError(f"place_turn_rewards: scores {(B, T)}, mask {tuple(response_mask.shape)}, "
                         f"{len(turn_ends)} rows of turn ends and {len(turn_rewards)} of turn rewards")
    out = token_level_scores.clone()
    mask = response_mask.to(torch.bool).cpu()
    for i, (ends, rewards) in enumerate(zip(turn_ends, turn_rewards)):
        ends, rewards = list(ends or []), list(rewards or [])
        if len(ends) != len(rewards):
            raise ValueError(f"place_turn_rewards: row {i} has {len(ends)} turn ends but {len(rewards)} turn rewards")
        model = torch.nonzero(mask[i]).squeeze(1).tolist()
        for e, r in zip(ends, rewards):
            if not 0 <= int(e) < T:
                raise ValueError(f"place_turn_rewards: row {i} has a turn ending at {e}, outside its {T} positions")
            if not model or float(r) == 0.0:
                continue
            before = [t for t in model if t <= int(e)]
            out[i, before[-1] if before else model[-1]] += float(r)
    return out


def turn_extra_infos(extra_infos: Sequence[Any], num_turns: Sequence[int] | None,
                     turn_rewards: Sequence[Sequence[float]] | None) -> list:
    """The rows' ``extra_info`` for the reward function, with ``num_turns`` and ``turn_rewards`` (a list) added
    where the rollout has them (a multi-turn batch). Each dict is a copy: the batch's own are not changed. A row
    whose ``extra_info`` is None gets a new dict; one that is not a mapping is passed on as it is."""
    if num_turns is None and turn_rewards is None:
        return list(extra_infos)
    out = []
    for i, extra in enumerate(extra_infos):
        if extra is not None and not isinstance(extra, Mapping):
            out.append(extra)
            continue
        row = dict(extra or {})
        if num_turns is not None:
            row["num_turns"] = int(num_turns[i])
        if turn_rewards is not None:
            row["turn_rewards"] = [float(r) for r in turn_rewards[i]]
        out.append(row)
    return out


def per_source_metrics(data_sources: Sequence[str], scores: torch.Tensor | Sequence[float],
                       acc: torch.Tensor | Sequence[float], prefix: str = "") -> dict[str, float]:
    """Mean score and accuracy per data source: ``{prefix}score/{source}``, ``{prefix}acc/{source}``, and
    ``{prefix}count/{source}``."""
    scores = [float(s) for s in scores]
    acc = [float(a) for a in acc]
    groups: dict[str, list[int]] = {}
    for i, src in enumerate(data_sources):
        groups.setdefault(src, []).append(i)
    out: dict[str, float] = {}
    for src, idx in sorted(groups.items()):
        out[f"{prefix}score/{src}"] = sum(scores[i] for i in idx) / len(idx)
        out[f"{prefix}acc/{src}"] = sum(acc[i] for i in idx) / len(idx)
        out[f"{prefix}count/{src}"] = float(len(idx))
    return out
