"""The ``hf`` rollout engine: batched sampling over any Hugging Face causal LM, on every backend.

Its own decode loop rather than ``model.generate`` (less Python per token, and the log-probs come
out of the same pass):

1. prefill: the ``B`` distinct prompts, left-padded, with ``attention_mask`` and ``position_ids``
   (``cumsum(mask) - 1``), computing logits for the last position only; the KV cache and the last
   logits are then repeated ``n`` times (``n`` samples share one prefill);
2. decode: one token per row per step through the cache (``DynamicCache``), sampling with
   :func:`portrl.rollout.sampling.sample_next` from a ``torch.Generator`` seeded by
   ``SamplingParams.seed``;
3. a row stops after EOS or a stop id; finished rows are dropped from the batch and its cache once
   they make up ``compact_fraction`` of it, and the loop ends when every row has finished.

Image prompts (a vision-language model, ``generate(..., multi_modal=...)``) decode on the generic loop: the
prefill takes the prompts' ``pixel_values`` / ``image_grid_thw`` and their 3-D rotary positions
(:func:`portrl.ops.multimodal_rope_index`), and every decoded token sits at its index plus the row's rope delta
on all three axes, as in transformers' own generation (portrl/models/multimodal.py).

The engine either wraps the trainer's module (colocated, weights shared: ``update_weights`` only
checks that the tensors are the module's own) or owns a model loaded from ``model_path``
(``update_weights`` copies tensors in). Deterministic for a given seed, model, device and batch.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Iterable, Sequence

import torch
from transformers import DynamicCache

from portrl.device.backend import Backend
from portrl.errors import UserError
from portrl.models import load_causal_lm
from portrl.models.multimodal import batch_image_inputs, is_vision_language
from portrl.models.forward_tape import tape_nbytes
from portrl.models.hf_types import HFModule
from portrl.ops.rotary_multimodal import multimodal_rope_index
from portrl.progress import note
from portrl.rollout.decode_rows import COMPACT_FRACTION, DecodeRows, left_pad
from portrl.rollout.engine import EngineCapabilities, RolloutEngine, check_prompts
from portrl.rollout.fast_decode import decode_chunk, fast_decoder_for
from portrl.rollout.sampling import sample_next
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import RolloutOutput, SamplingParams
from portrl.rollout.weights import load_named_tensors

log = logging.getLogger(__name__)

HOST = torch.device("cpu")  # host memory: where a sleeping engine keeps the model it owns


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the model's generation config (either may list several)."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.extend([source] if isinstance(source, int) else list(source))
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_model(model_path: str, backend: Backend | None, dtype: str) -> torch.nn.Module:
    """Load a local HF checkpoint (portrl.models.load_causal_lm: portrl's attention, nothing downloaded)."""
    return load_causal_lm(model_path, dtype=dtype, backend=backend)


class HFEngine(RolloutEngine):
    """Rollouts with a Hugging Face causal LM and a KV cache.

    Args:
        model: the trainer's module to wrap (colocated, no copy); or None to load ``model_path``.
        model_path: local HF checkpoint directory, used when ``model`` is None.
        tokenizer: supplies ``eos_token_id`` and ``pad_token_id`` (may be None if the model's
            generation config has an EOS id).
        backend: the portrl Backend (device placement, ``empty_cache`` on sleep).
        dtype: dtype for a model loaded from ``model_path``.
        max_batch_rows: at most this many rows (prompts x n) decode together; None = all.
        compact_fraction: drop finished rows from the batch once they are this share of it.
        fast_decode: decode Llama-family models (Qwen2, Llama, Mistral) with the lean static-cache
            forward of :mod:`portrl.rollout.fast_decode` (same math, far less Python per token);
            other models always take the generic loop below.

    Capabilities: ``in_process_weights`` (built with ``model=`` it decodes that module);
    ``forward_recording`` (between :meth:`start_recording` and :meth:`stop_recording`, a generate call on the
    fast path in one chunk leaves a :class:`portrl.models.forward_tape.ForwardTape`, which the trainer's
    forward on the same weights can replay instead of recomputing the matmuls); ``sleep_wake`` (an engine
    that owns its model on an accelerator moves it to host memory); ``interruptible`` (:meth:`set_interrupt`).

    Memory: a generate call gives nothing the device's allocator kept back to the device (no ``empty_cache``, which
    verl's rollouts call on entry for an engine with a memory pool of its own): this engine allocates from the same
    allocator as the update, so the blocks the update freed serve its KV cache and recording, and what they do not
    use the next update takes again. On the CPU, giving them back before each rollout made the next update fault
    them in again (docs/performance.md).
    """

    name = "hf"
    capabilities = EngineCapabilities(in_process_weights=True, forward_recording=True, sleep_wake=True,
                                      interruptible=True)

    @classmethod
    def translate_settings(cls, settings: RolloutSettings) -> dict[str, Any]:
        """``dtype`` (used for a model loaded from ``model_path``); the other settings do not apply here."""
        return {"dtype": settings.dtype}

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        model_path: str | None = None,
        tokenizer: Any = None,
        backend: Backend | None = None,
        dtype: str = "float32",
        max_batch_rows: int | None = None,
        compact_fraction: float = COMPACT_FRACTION,
        fast_decode: bool = True,
    ) -> None:
        if model is None and model_path is None:
            raise ValueError("the hf engine needs model= (the trainer's module) or model_path= (a local HF checkpoint)")
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1 or None, got {max_batch_rows!r}")
        if not 0.0 <= compact_fraction <= 1.0:
            raise ValueError(f"compact_fraction must be in [0, 1], got {compact_fraction!r}")
        self.colocated = model is not None
        self.model: HFModule = model if model is not None else _load_model(str(model_path), backend, dtype)
        self.backend = backend
        self.max_batch_rows = max_batch_rows
        self.compact_fraction = compact_fraction
        self.eos_token_ids = _eos_ids(self.model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0))
        wrapped: HFModule = self.model
        base: HFModule = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped  # peft wraps
        params = inspect.signature(base.forward).parameters
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); use what this model takes
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._offloaded_from: torch.device | None = None
        self._fast = fast_decoder_for(self.model, backend) if fast_decode else None
        # while recording, each generate call leaves its ForwardTape in _last_tape (fast path, one chunk)
        self._recording = False
        self._record_max_bytes: int | None = None
        self._last_tape = None
        self._interrupt: threading.Event | None = None  # set_interrupt: ends generate's loops early when set

    # --- contract -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 multi_modal: Sequence[Any] | None = None) -> RolloutOutput:
        """``multi_modal``: per prompt None (text) or its images' entry (portrl/data/rl_dataset.py: the processor's
        ``pixel_values`` / ``image_grid_thw`` under ``"inputs"``, the prompt ids already expanded); image prompts
        need a vision-language model and decode on the generic loop."""
        prompts = check_prompts(prompts)
        entries = self._check_images(multi_modal, len(prompts))
        if self._offloaded_from is not None:
            raise RuntimeError("the hf engine is asleep; call wake() before generate()")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        per_chunk = len(prompts) if self.max_batch_rows is None else max(1, self.max_batch_rows // params.n)
        out = RolloutOutput()
        self._last_tape = None
        record = (self._recording and self._fast is not None and per_chunk >= len(prompts)
                  and self._tape_fits(prompts, params))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(prompts), per_chunk):
                    images = batch_image_inputs(entries[start:start + per_chunk], self.device) if entries else None
                    ids, lps, reasons = self._generate_chunk(prompts[start:start + per_chunk], params, stop, generator,
                                                             record, images)
                    out.response_ids += ids
                    out.logprobs += lps
                    out.finish_reasons += reasons
        finally:
            self.model.train(was_training)
        return out

    def _check_images(self, multi_modal: Sequence[Any] | None, n_prompts: int) -> list | None:
        """``multi_modal`` as a list when some prompt has images (None otherwise), checked against the model."""
        if multi_modal is None or all(entry is None for entry in multi_modal):
            return None
        if len(multi_modal) != n_prompts:
            raise ValueError(f"multi_modal has {len(multi_modal)} entries for {n_prompts} prompts; give one per "
                             "prompt (None for a text prompt)")
        if not is_vision_language(self.model):
            raise UserError(f"the prompts have images but the model ({type(self.model).__name__}) is a text model; "
                            "use a vision-language model (e.g. Qwen2.5-VL) or text-only data")
        return list(multi_modal)  # (the fast decoder takes text model types only: these decode on the generic loop)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        counts = load_named_tensors(self.model, named_tensors)
        log.debug("hf engine update_weights: %(copied)d copied, %(shared)d already shared", counts)

    def shares_module(self, module: torch.nn.Module) -> bool:
        return self.colocated and self.model is module

    def can_record_forward(self) -> bool:
        """Only the fast decode path records (Llama-family models, ``fast_decode=True``)."""
        return self._fast is not None

    def start_recording(self, max_bytes: int | None = None) -> None:
        if self._fast is None:
            raise RuntimeError("the hf engine records only on its fast decode path (fast_decode=True, a "
                               "Llama-family model); check can_record_forward() first")
        self._recording, self._record_max_bytes = True, max_bytes

    def stop_recording(self):
        tape, self._last_tape, self._recording = self._last_tape, None, False
        return tape

    def _tape_fits(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> bool:
        """Whether this call's ForwardTape stays within start_recording's ``max_bytes``."""
        if self._record_max_bytes is None:
            return True
        need = tape_nbytes(self.model, len(prompts), max(len(p) for p in prompts), params.n, params.max_new_tokens - 1)
        if need > self._record_max_bytes:
            log.info("not recording this rollout's forward: it would hold %.2f GB, more than the %.2f GB allowed",
                     need / 1e9, self._record_max_bytes / 1e9)
            if self._fast is not None:
                self._fast.drop_recording_buffers()  # an earlier recording's buffers are not kept for nothing
            return False
        return True

    def set_interrupt(self, event: threading.Event | None) -> None:
        """Once ``event`` is set, a running ``generate`` ends after the token being sampled: rows still generating
        return their tokens so far with finish reason ``abort`` (checked once per decode step; None: never)."""
        self._interrupt = event

    def sleep(self) -> None:
        """An engine that owns its model moves it to host memory; a colocated one, or one whose model is there
        already, has nothing of its own to free."""
        if self.colocated or self._offloaded_from is not None or self.device == HOST:
            return
        self._offloaded_from = self.device
        self.model.to(HOST)
        if self.backend is not None:
            self.backend.empty_cache()

    def wake(self) -> None:
        if self._offloaded_from is not None:
            self.model.to(self._offloaded_from)
            self._offloaded_from = None

    # --- decode loop -------------------------------------------------------------------------
    def _forward(self, cache: Any, **kw: Any):
        if self._logits_kw is not None:
            kw[self._logits_kw] = 1
        kw[self._cache_kw] = cache
        return self.model(use_cache=True, return_dict=True, **kw)

    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, stop: torch.Tensor, generator: torch.Generator,
        record: bool = False, images: dict | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        if self._fast is not None and images is None:
            out = decode_chunk(self._fast, prompts, params, stop, generator, self.pad_token_id, self.compact_fraction,
                               record=record, interrupt=self._interrupt)
            self._last_tape, self._fast.tape = self._fast.tape, None
            return out
        dev, n, max_new = self.device, params.n, params.max_new_tokens
        ids, mask, lengths = left_pad(prompts, self.pad_token_id, dev)
        plen = ids.shape[1]
        mask = mask.long()
        padded = bool((lengths != plen).any())
        cache = DynamicCache(config=self.model.config)
        # image prompts: the vision inputs and 3-D rotary positions at prefill; each row's decoded tokens then
        # sit at (index + rope delta) on all three axes (portrl/models/multimodal.py)
        delta = None
        if images is not None:
            positions, delta = multimodal_rope_index(ids, images["image_grid_thw"], self.model.config.image_token_id,
                                                     self.model.config.vision_config.spatial_merge_size, mask)
            extra = {"pixel_values": images["pixel_values"], "image_grid_thw": images["image_grid_thw"],
                     "mm_token_type_ids": (ids == self.model.config.image_token_id).long() * mask}
        else:
            positions, extra = (mask.cumsum(-1) - 1).clamp_(min=0), {}
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, **extra)
        logits = out.logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask, lengths = mask.repeat_interleave(n, dim=0), lengths.repeat_interleave(n)
            delta = None if delta is None else delta.repeat_interleave(n, dim=0)
        rows = DecodeRows(logits.shape[0], max_new, self.pad_token_id, stop, self.compact_fraction, dev, self._interrupt)
        full_mask = torch.ones(logits.shape[0], plen + max_new, dtype=torch.long, device=dev)
        full_mask[:, :plen] = mask
        position = lengths.clone()  # position id of the next token of each row
        if delta is not None:
            position += delta.reshape(-1).to(position.device)
        for t in range(max_new):
            if t % 16 == 0:
                note(f"token {t}/{max_new}")  # the console's phase detail (portrl/progress.py)
            tok, lp = sample_next(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, generator=generator)
            if rows.record(t, tok, lp):
                break
            keep = rows.compact()
            if keep is not None:
                cache.batch_select_indices(keep)
                tok, position, full_mask = tok[keep], position[keep], full_mask[keep]
            step_mask = full_mask[:, : plen + t + 1] if padded else None
            step_pos = position[:, None] if delta is None else position[None, :, None].expand(3, -1, -1)
            out = self._forward(input_ids=tok[:, None], attention_mask=step_mask, position_ids=step_pos, cache=cache)
            logits = out.logits[:, -1]
            position += 1
        return rows.outputs()
