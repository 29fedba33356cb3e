"""The sglang engine's translations, pure Python (no SGLang import), so they are tested on any machine.

Written against SGLang's offline Engine API (``sglang/srt/entrypoints/engine.py``, ``managers/io_struct.py``'s
``GenerateReqInput``, and the documented sampling parameters):

* ``Engine(**server_args)``: ``model_path``, ``tokenizer_path``, ``dtype``, ``random_seed``,
  ``mem_fraction_static``, ``tp_size``, ``context_length``, ``skip_tokenizer_init`` (token ids in and out, no
  detokenizer work), ``enable_memory_saver`` (what ``release_memory_occupation`` needs), ``log_level``;
* ``Engine.generate(input_ids=[[...], ...], sampling_params={...}, return_logprob=True)`` returns one dict per
  input, ``{"output_ids": [...], "meta_info": {"output_token_logprobs": [(logprob, token_id, text), ...],
  "finish_reason": {"type": "stop" | "length" | "abort", ...}, ...}}``; sampling parameters ``temperature``,
  ``top_p``, ``top_k`` (-1: off), ``max_new_tokens``, ``stop_token_ids``, ``sampling_seed``;
* the log-prob SGLang reports is the one its sampler used (since SGLang PR 2664): with top-k / top-p off it is
  ``log_softmax(logits / temperature)``, portrl's convention (portrl/rollout/types.py).

Only a CUDA or ROCm machine with SGLang confirms these (the package needs the CUDA 13 stack; ci/device_check.sh
runs it where it is installed).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from portrl.rollout.sampling import NonFiniteLogitsError
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams


def sglang_options(settings: RolloutSettings) -> dict[str, Any]:
    """``sglang.Engine`` keywords for ``settings``: the run's dtype and seed, ``mem_fraction_static`` (the memory
    fraction), ``tp_size``, ``context_length`` (when set), ``enable_memory_saver`` (sleep between rollouts), token
    ids in and out (``skip_tokenizer_init``) and quiet logs."""
    opts: dict[str, Any] = {
        "dtype": settings.dtype,
        "random_seed": int(settings.seed),
        "mem_fraction_static": float(settings.memory_fraction),
        "tp_size": int(settings.tensor_parallel),
        "enable_memory_saver": bool(settings.sleep_between_rollouts),
        "skip_tokenizer_init": True,
        "log_level": "error",
    }
    if settings.max_sequence_length is not None:
        opts["context_length"] = int(settings.max_sequence_length)
    return opts


def to_sampling_params(params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """SGLang's sampling-parameter dict for one sample of ``params`` (the engine repeats each prompt ``n`` times).
    portrl's EOS ids join the stop ids, so both engines stop on the same tokens."""
    out: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": sorted(set(params.stop_token_ids) | {int(t) for t in eos_token_ids}),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # the stop token stays in output_ids, as every portrl engine returns it
    }
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed)
    return out


def repeat_prompts(prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Prompt-major inputs: prompt ``i`` at rows ``i*n .. i*n+n-1`` (the order of RolloutOutput)."""
    return [list(p) for p in prompts for _ in range(n)]


def _finish(meta: Mapping[str, Any], row: int) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind not in (FINISH_STOP, FINISH_LENGTH):
        raise RuntimeError(f"SGLang finished row {row} with reason {reason!r}")
    return str(kind)


def from_outputs(outputs: Sequence[Mapping[str, Any]], rows: int) -> RolloutOutput:
    """A :class:`RolloutOutput` from ``Engine.generate``'s list of dicts (one per input row, in input order)."""
    if isinstance(outputs, Mapping):  # a single input comes back as one dict
        outputs = [outputs]
    if len(outputs) != rows:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {rows} inputs")
    result = RolloutOutput()
    for r, out in enumerate(outputs):
        meta = out["meta_info"]
        ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(ids):
            raise RuntimeError(f"SGLang returned no per-token logprobs for row {r} (return_logprob=True must be set)")
        lps = [float(e[0]) for e in entries]
        if [int(e[1]) for e in entries] != ids:
            raise RuntimeError(f"SGLang's logprobs of row {r} are not for its output tokens")
        if math.isnan(sum(lps)):
            raise NonFiniteLogitsError(next(k for k, x in enumerate(lps) if not -math.inf < x < math.inf), 1)
        result.response_ids.append(ids)
        result.logprobs.append(lps)
        result.finish_reasons.append(_finish(meta, r))
    return result


def update_outcome(result: Any) -> tuple[bool, str]:
    """``(success, message)`` of ``Engine.update_weights_from_tensor``: a ``(success, message)`` pair, or a dict with
    those keys (the form SGLang's HTTP layer returns); anything else counts as success."""
    if isinstance(result, Mapping):
        return bool(result.get("success")), str(result.get("message", ""))
    if isinstance(result, (tuple, list)) and len(result) >= 2:
        return bool(result[0]), str(result[1])
    return True, ""
