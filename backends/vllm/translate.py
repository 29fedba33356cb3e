"""Translation between portrl's rollout types and vLLM's (``vllm.SamplingParams``, ``TokensPrompt``,
``RequestOutput``). Pure functions of the ``vllm`` module passed in, so that they are tested on a
machine without vLLM against its documented signatures.

vLLM facts relied on (vLLM 0.11 - 0.32):

* ``SamplingParams(n, temperature, top_p, top_k, max_tokens, stop_token_ids, seed, logprobs,
  detokenize)``; ``top_k=-1`` disables top-k in every version (newer ones also take 0);
  ``logprobs=0`` returns the sampled token's log-prob only.
* With the engine argument ``logprobs_mode="processed_logprobs"`` the log-prob is taken after
  temperature *and* top-k / top-p truncation (``raw_logprobs``, the default, is before temperature).
  With top-k / top-p disabled that is exactly portrl's convention ``log_softmax(logits / T)``; with
  truncation on, vLLM's value is the truncated, renormalised one (higher by ``-log(kept mass)``).
* A multimodal prompt is ``TokensPrompt(prompt_token_ids=..., multi_modal_data={"image": [PIL images]})``
  whose ids hold ONE image placeholder per image (vLLM's processor expands each to the image's token
  count itself, as verl's ``raw_prompt_ids``).
* ``RequestOutput.outputs`` holds ``n`` ``CompletionOutput`` (``index``, ``token_ids``,
  ``logprobs``: one ``{token_id: Logprob(logprob=...)}`` per position, ``finish_reason``:
  "stop" | "length" | "abort"; None while the request runs). ``token_ids`` include the EOS / stop token that
  ended the row. With ``output_kind=CUMULATIVE`` (the default outside ``LLM.generate``) every engine step reports
  each running sample's tokens and log-probs so far (:func:`from_partial_outputs`).
* On NaN logits (diverged weights) vLLM still samples a token and reports its log-prob as NaN:
  :func:`from_request_outputs` then raises portrl's NonFiniteLogitsError (one ``sum`` per sample, no extra pass).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Iterable, Sequence

from portrl.rollout.buckets import bucket_named_tensors  # noqa: F401  (the engine's bucketing, shared)
from portrl.rollout.sampling import NonFiniteLogitsError
from portrl.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

LOGPROBS_MODE = "processed_logprobs"


def to_vllm_sampling_params(vllm: ModuleType, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> Any:
    """``vllm.SamplingParams`` for ``params``. EOS ids of portrl's tokenizer are added to the stop ids
    so that both engines stop on the same tokens whatever vLLM reads from the checkpoint."""
    stop_ids = sorted(set(params.stop_token_ids) | {int(t) for t in eos_token_ids})
    return vllm.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        stop_token_ids=stop_ids,
        seed=params.seed,
        logprobs=0,
        detokenize=False,
    )


def to_vllm_prompts(vllm: ModuleType, prompts: Sequence[Sequence[int]],
                    multi_modal: Sequence[dict | None] | None = None) -> list[Any]:
    """Token-id prompts as ``vllm.inputs.TokensPrompt`` (a TypedDict: ``{"prompt_token_ids": [...]}``).

    ``multi_modal`` (one entry per prompt, see ``RolloutEngine.generate``): a prompt with images becomes
    ``{"prompt_token_ids": entry["raw_prompt_ids"], "multi_modal_data": {"image": entry["images"]}}`` (its
    expanded ids in ``prompts`` would be expanded again by vLLM); None entries stay plain token prompts.
    """
    if multi_modal is not None and len(multi_modal) != len(prompts):
        raise ValueError(f"multi_modal has {len(multi_modal)} entries for {len(prompts)} prompts; give one per "
                         "prompt (None for a text prompt)")
    tokens_prompt = getattr(getattr(vllm, "inputs", None), "TokensPrompt", None) or dict
    out = []
    for i, p in enumerate(prompts):
        entry = multi_modal[i] if multi_modal is not None else None
        if entry is None:
            out.append(tokens_prompt(prompt_token_ids=list(p)))
            continue
        missing = [k for k in ("raw_prompt_ids", "images") if not entry.get(k)]
        if missing:
            raise ValueError(f"prompt {i}: its multi_modal entry lacks {', '.join(missing)} (a vision prompt needs "
                             "raw_prompt_ids, one image placeholder per image, and the images)")
        out.append(tokens_prompt(prompt_token_ids=[int(t) for t in entry["raw_prompt_ids"]],
                                 multi_modal_data={"image": list(entry["images"])}))
    return out


def _sampled_logprob(position: Any, token: int) -> float:
    """The sampled token's log-prob from one position of ``CompletionOutput.logprobs``."""
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


def _completion_row(prompt: int, comp: Any) -> tuple[list[int], list[float]]:
    """Token ids and sampled-token log-probs of one ``CompletionOutput`` (checked: one log-prob per token, no NaN)."""
    ids = [int(t) for t in comp.token_ids]
    if comp.logprobs is None or len(comp.logprobs) != len(ids):
        raise RuntimeError(
            f"vLLM returned no per-token logprobs for prompt {prompt} (got {comp.logprobs!r:.60}); "
            "SamplingParams(logprobs=0) must be set"
        )
    lps = [_sampled_logprob(pos, tok) for pos, tok in zip(comp.logprobs, ids)]
    if math.isnan(sum(lps)):  # NaN logits: vLLM samples some token and reports a NaN log-prob
        raise NonFiniteLogitsError(next(k for k, x in enumerate(lps) if not -math.inf < x < math.inf), 1)
    return ids, lps


def from_request_outputs(outputs: Sequence[Any], n: int, num_prompts: int) -> RolloutOutput:
    """Flatten vLLM ``RequestOutput``s (prompt order) into a prompt-major :class:`RolloutOutput`."""
    if len(outputs) != num_prompts:
        raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {num_prompts} prompts")
    result = RolloutOutput()
    for i, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={n}")
        for comp in completions:
            ids, lps = _completion_row(i, comp)
            reason = comp.finish_reason
            if reason not in (FINISH_STOP, FINISH_LENGTH):
                raise RuntimeError(f"vLLM finished prompt {i} sample {comp.index} with reason {reason!r}")
            result.response_ids.append(ids)
            result.logprobs.append(lps)
            result.finish_reasons.append(reason)
    return result


def from_partial_outputs(completions: Sequence[Sequence[Any | None]]) -> RolloutOutput:
    """A prompt-major :class:`RolloutOutput` from a generation an interrupt may have ended early.

    ``completions[i][j]``: the latest cumulative ``CompletionOutput`` of sample ``j`` of prompt ``i``, or None for
    a sample that had not sampled a token yet. A finished sample keeps its reason (stop / length); an unfinished
    one (no finish reason, or vLLM's "abort") becomes :data:`FINISH_ABORT` with its tokens and log-probs so far.
    """
    result = RolloutOutput()
    for i, samples in enumerate(completions):
        for comp in samples:
            ids: list[int] = []
            lps: list[float] = []
            reason = FINISH_ABORT
            if comp is not None:
                ids, lps = _completion_row(i, comp)
                reason = comp.finish_reason or FINISH_ABORT
                if reason not in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT):
                    raise RuntimeError(f"vLLM finished prompt {i} sample {comp.index} with reason {reason!r}")
            result.response_ids.append(ids)
            result.logprobs.append(lps)
            result.finish_reasons.append(reason)
    return result
