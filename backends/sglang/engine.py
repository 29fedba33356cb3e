"""The ``sglang`` rollout engine: SGLang's offline ``sglang.Engine`` inside the worker process (cuda, rocm).

* generate: token-id prompts, each repeated ``n`` times (prompt-major rows), with the sampled token's log-prob
  (``return_logprob=True``; :mod:`translate` says how it relates to portrl's convention);
* update_weights: ``Engine.update_weights_from_tensor(named_tensors=[(name, tensor), ...], flush_cache=...)`` in
  buckets of ``sync_bucket_mb`` (the cache is flushed after the last bucket only);
* sleep / wake: ``Engine.release_memory_occupation()`` / ``resume_memory_occupation()``, when the engine was built
  with ``enable_memory_saver`` (sleep between rollouts);
* shutdown: ``Engine.shutdown()``.

Not interruptible: partial rollout (the asynchronous modes) needs an engine that can abort, and a run asking for it
with this engine is refused before it starts. Written against the documented API (tested on the CPU with a
stand-in that follows it, tests/test_rollout_sglang_fake.py); only a GPU with SGLang installed confirms it.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import torch

from portrl.backends.sglang import translate
from portrl.device.backend import Backend, import_optional
from portrl.rollout.buckets import bucket_named_tensors
from portrl.rollout.engine import EngineCapabilities, RolloutEngine, check_prompts, eos_token_ids
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import RolloutOutput, SamplingParams

log = logging.getLogger(__name__)

INSTALL = ('pip install -e ".[sglang]" on a CUDA or ROCm machine (SGLang builds its kernels for the CUDA 13 '
           "stack; it does not run on the CPU)")


class SGLangEngine(RolloutEngine):
    """Rollouts with ``sglang.Engine``.

    Args:
        model_path: local HF checkpoint directory SGLang builds its model from (required).
        model: optional trainer module; its weights are synced in right after start.
        tokenizer: portrl's tokenizer (its EOS ids are added to the stop ids).
        backend: the portrl Backend.
        sync_bucket_mb: size of one ``update_weights_from_tensor`` call.
        engine_kwargs: ``sglang.Engine`` keywords: :meth:`translate_settings` fills them from the run's
            ``RolloutSettings`` (:func:`translate.sglang_options`); any others pass through.
    """

    name = "sglang"
    capabilities = EngineCapabilities(sleep_wake=True)

    @classmethod
    def translate_settings(cls, settings: RolloutSettings) -> dict[str, Any]:
        return translate.sglang_options(settings)

    def __init__(self, *, model: torch.nn.Module | None = None, model_path: str | None = None, tokenizer: Any = None,
                 backend: Backend | None = None, tokenizer_path: str | None = None, sync_bucket_mb: int = 512,
                 **engine_kwargs: Any) -> None:
        if model_path is None:
            raise ValueError("the sglang engine builds its model from a local HF checkpoint: pass model_path=")
        self._sglang = import_optional("sglang", INSTALL)
        self.eos_token_ids = eos_token_ids(tokenizer)
        self.sync_bucket_bytes = int(sync_bucket_mb) * 2**20
        self.sleep_enabled = bool(engine_kwargs.get("enable_memory_saver", False))
        kwargs = {"model_path": str(model_path), "tokenizer_path": str(tokenizer_path or model_path), **engine_kwargs}
        log.info("starting sglang.Engine (%s) with %s", getattr(self._sglang, "__version__", "?"), kwargs)
        self.engine = self._sglang.Engine(**kwargs)
        self._asleep = False
        if model is not None:
            self.update_weights(model.state_dict().items())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 multi_modal: Sequence[dict | None] | None = None) -> RolloutOutput:
        prompts = check_prompts(prompts)
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise ValueError("the sglang engine takes text prompts only here; image prompts need the vllm or hf engine")
        if self._asleep:
            raise RuntimeError("the sglang engine is asleep; call wake() before generate()")
        rows = translate.repeat_prompts(prompts, params.n)
        outputs = self.engine.generate(input_ids=rows, return_logprob=True,
                                       sampling_params=translate.to_sampling_params(params, self.eos_token_ids))
        return translate.from_outputs(outputs, len(rows))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        buckets = list(bucket_named_tensors(((n, t.detach()) for n, t in named_tensors), self.sync_bucket_bytes))
        for k, bucket in enumerate(buckets):
            result = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=k == len(buckets) - 1)
            ok, message = translate.update_outcome(result)
            if not ok:
                raise RuntimeError(f"sglang update_weights_from_tensor failed: {message}")
        log.debug("sglang engine update_weights: %d buckets", len(buckets))

    def sleep(self) -> None:
        if self.sleep_enabled and not self._asleep:
            self.engine.release_memory_occupation()
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.engine.resume_memory_occupation()
            self._asleep = False

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
