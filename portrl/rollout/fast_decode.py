"""A lean forward for decoding Llama-family causal LMs (Qwen2 / Qwen2.5, Llama, Mistral) with a static KV cache.

Why: for the small models RL runs on a CPU, a Hugging Face forward spends most of each decoded
token in Python (mask building, cache objects, output containers, hooks), not in matmuls. This
path runs the same arithmetic from the module's own parameters (no copy: training updates are
seen at once) with one preallocated KV cache per generate call:

* q/k/v projections fused into one matmul and gate/up into another (given to the backend's
  ``linear_prepacked`` as parts: an implementation may read them where they are, the native one concatenates
  them once per :meth:`FastDecoder.start`, i.e. once per generate call, so they follow training);
* rotary cos/sin computed once for every position of the call by the model's own rotary module
  (so every rope variant the model supports is honoured);
* attention over ``cache[:, :, :length]`` with a boolean key mask (left padding + not-yet-written
  slots): ``scaled_dot_product_attention``, or for a one-token step the backend's ``decode_attention`` op where
  its decode kernel says so (``step_attention``);
* logits for the last position only;
* with 16 or more steps to decode, the linears use the backend's ``linear_prepacked`` op (an implementation may
  pack the weights once per call, which pays over enough steps).

The KV cache's layout, and which parts of a step the backend runs its own way (the norms, a layer or the head in
one call of its ``decode_layer`` op), are the backend's decode kernel's (:meth:`Backend.decode_kernel`,
portrl/device/decode_kernel.py); this module holds the arithmetic every backend shares.

Layer math (pre-norm decoder): ``h = x + o(attn(rope(q), rope(k), v))`` with ``q, k, v =
W_qkv·rms(x) (+ b)``; ``y = h + down(silu(gate) * up)`` with ``gate, up = W_gu·rms(h)``;
``rms(x) = x / sqrt(mean(x^2) + eps) * w`` computed in float32 as transformers does (``F.rms_norm`` for
float32 weights and activations: the same formula in one op).

:func:`fast_decoder_for` returns None for any model this path does not reproduce exactly
(another architecture, q/k norms, sliding windows, attention soft-capping, a PEFT wrapper, a
scaled, biased or non-SiLU MLP), and the caller uses the generic forward instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from portrl.device import get_backend, resolve_backend
from portrl.device.backend import Backend
from portrl.device.decode_kernel import DecodeKernel, KVCache
from portrl.models.forward_tape import ForwardTape, tape_widths
from portrl.models.hf_types import HFModule
from portrl.ops import select
from portrl.ops.layers import linear_prepacked, rms_norm
from portrl.ops.registry import NATIVE
from portrl.progress import note
from portrl.rollout.decode_rows import DecodeRows, left_pad
from portrl.rollout.sampling import sample_next

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")


def fast_decoder_for(model: torch.nn.Module, backend: Backend | str | None = None) -> Optional["FastDecoder"]:
    """A :class:`FastDecoder` over ``model`` when its architecture is reproduced exactly, else None.

    ``backend`` (a Backend, a name, or None for the current one) chooses the ops and gives the decode kernel."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or head is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return None
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "sliding_window", None) and getattr(
            cfg, "use_sliding_window", True) and getattr(cfg, "model_type", "") == "mistral":
        return None
    if (getattr(cfg, "pretraining_tp", 1) not in (None, 1) or getattr(cfg, "attn_logit_softcapping", None)
            or getattr(cfg, "mlp_bias", False)):
        return None
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        return None
    layer = inner.layers[0]
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attn is None or mlp is None or hasattr(attn, "q_norm") or not hasattr(mlp, "gate_proj"):
        return None
    return FastDecoder(model, backend)


#: fewest one-token steps for which the decode linears go through the backend's ``linear_prepacked`` op: an
#: implementation that packs the weights once per call pays that back only over enough steps (the CPU's:
#: docs/performance.md, the decode loop on the CPU)
PREPACK_MIN_STEPS = 16


class FastDecoder:
    """Prefill + one-token decode steps with a static KV cache. Use inside ``torch.inference_mode``."""

    def __init__(self, model: torch.nn.Module, backend: Backend | str | None = None):
        cfg: HFModule = model.config
        self.model: HFModule = model
        self.inner: HFModule = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.layers: list = []
        self.head: Any = None
        self.tape: Any = None  # a portrl.models.forward_tape.ForwardTape while recording
        if backend is None or isinstance(backend, str):
            backend = get_backend(backend) if backend else resolve_backend()
        # the cache's layout, and what the backend runs its own way (an object that is no Backend may have none)
        own_kernel = getattr(backend, "decode_kernel", None)
        self.kernel = own_kernel() if own_kernel is not None else DecodeKernel()
        self.cache: Optional[KVCache] = None  # one generate call's (start allocates it, release drops it)
        self._last_tape: Any = None  # the previous recording, whose buffers the next one reuses
        self.linear_impl, self._prepack = select("linear_prepacked", backend=backend)
        self._swiglu = select("swiglu", backend=backend)[1]
        rms_name, self._rms_norm = select("rms_norm", backend=backend)  # the tape's replay runs it too
        self._rotary = select("rotary", backend=backend)[1]  # only the tape's replay runs it
        self._rms_kernel = self._rms_norm if rms_name != NATIVE and self.kernel.own_norm else None
        self._attend = select("decode_attention", backend=backend)[1]
        name, layer_op = select("decode_layer", backend=backend)
        self._layer_op: Optional[Callable] = layer_op if name != NATIVE else None  # the backend's one-call layer
        self._fused: list = []  # per layer: decode_layer bound to its weights, when this call's steps use it
        self._fused_head: Optional[Callable] = None  # the last norm and head on the layers' threads, where bound

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    @property
    def k_cache(self) -> torch.Tensor:
        """The keys, (layers, rows, KV, slots, head_dim), whatever the kernel's storage (this call's)."""
        assert self.cache is not None, "start() allocates the cache"
        return self.cache.keys

    @property
    def v_cache(self) -> torch.Tensor:
        """The values, (layers, rows, KV, slots, head_dim) (this call's)."""
        assert self.cache is not None, "start() allocates the cache"
        return self.cache.values

    # ------------------------------------------------------------------------------ per call
    def start(self, rows: int, max_len: int, decode_rows: Optional[int] = None, steps: int = 0) -> None:
        """Fuse the current weights and allocate a cache for ``rows`` sequences of up to ``max_len`` tokens.

        With ``steps >= PREPACK_MIN_STEPS`` one-token steps of ``decode_rows`` rows to come, the linears
        go through the backend's ``linear_prepacked`` op (specialised for the call's row count; an implementation
        may pack the weights once per call); for fewer steps a packing would cost more than it saves. The
        backend's decode kernel allocates the cache and binds the ``decode_layer`` op where it runs a step's layers.
        """
        make = self._prepack if steps >= PREPACK_MIN_STEPS and decode_rows else linear_prepacked  # native: F.linear

        def linear(w: Any, b: Optional[torch.Tensor] = None):  # w: a weight or the parts of a fused one
            return make(w, b, decode_rows)

        w = self.inner.embed_tokens.weight
        weights = [_layer_arguments(layer, self.eps) for layer in self.inner.layers]
        cache = self.cache = self.kernel.allocate(len(weights), rows, self.n_kv, max_len, self.head_dim, w.dtype,
                                                  w.device)
        step_rows = decode_rows or rows
        self._fused = self.kernel.bind(self._layer_op, weights, self.scale, self.n_heads, self.n_kv, step_rows, cache)
        self.final_norm_w = self.inner.norm.weight
        self.final_eps = getattr(self.inner.norm, "variance_epsilon", self.eps)
        head = self.model.lm_head
        self._fused_head = self.kernel.head(self._layer_op, self.final_norm_w, self.final_eps, head.weight, head.bias,
                                            step_rows, cache)
        self.layers = [(ln1, linear(w_qkv, b_qkv), linear(w_o, b_o), ln2, linear(w_gu), linear(w_down), eps1, eps2)
                       for ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down, eps1, eps2 in weights]
        self.head = linear(head.weight, head.bias)
        pos = torch.arange(max_len, device=w.device)[None]
        cos, sin = self.inner.rotary_emb(w[:1, None], pos)  # (1, max_len, head_dim)
        half = self.head_dim // 2
        # rope(x) = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): the sign goes into sin
        self.cos = cos[0].to(w.dtype)
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).to(w.dtype)

    def drop_recording_buffers(self) -> None:
        """Free the buffers the last recording kept for the next one to reuse (a call that will not record)."""
        self._last_tape = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only cache rows ``index`` (drop finished sequences, or repeat prompts for n samples)."""
        assert self.cache is not None, "start() allocates the cache"
        self.cache = self.kernel.select_rows(self.cache, index)

    def release(self) -> None:
        self.layers, self.head, self.cache = [], None, None
        self._fused, self._fused_head = [], None

    # ------------------------------------------------------------------------------- forward
    def _rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self._rms_kernel is not None:  # the backend's own norm, where its decode kernel takes it (own_norm)
            return self._rms_kernel(x, w, eps)
        if x.dtype == torch.float32 and w.dtype == torch.float32:  # one fused op, the same formula in float32
            return F.rms_norm(x, w.shape, w, eps)
        return rms_norm(x, w, eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin_signed)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, key_mask: torch.Tensor,
                record_at: Any = None) -> torch.Tensor:
        """Run tokens ``ids`` (B, S) at cache slots ``start .. start+S-1`` with rotary positions ``positions`` (B, S).

        ``key_mask`` (B, start+S) bool: which cache slots each row may attend to (its real tokens);
        causality inside the S new tokens is added here. Returns the last position's logits (B, V).
        ``record_at`` (slice or (B*S,) indices): the tape slots the four matmul outputs of each layer are saved to.
        """
        tape = self.tape if record_at is not None else None
        cache = self.cache
        assert cache is not None, "start() allocates the cache"
        B, S = ids.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        end = start + S
        x = F.embedding(ids, self.inner.embed_tokens.weight)
        cos = self.cos[positions][:, :, None]  # (B, S, 1, D)
        sin = self.sin[positions][:, :, None]
        mask = key_mask[:, None, None, :]  # (B, 1, 1, end)
        if S > 1:
            causal = torch.ones(S, end, dtype=torch.bool, device=ids.device).tril_(start)
            mask = mask & causal
            # a query on left padding sees no real key; let it see itself so softmax stays finite
            mask = mask | _diag(S, end, start, ids.device)
        one_token_op = S == 1 and self.kernel.step_attention  # attention through the decode_attention op
        hidden_keys = ~mask.view(B, -1) if one_token_op else None
        if hidden_keys is not None and self._fused:
            return self._forward_fused(x.view(B, -1), positions[:, 0], start, hidden_keys, tape, record_at)
        for li, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj, eps1, eps2) in enumerate(self.layers):
            h = self._rms(x, ln1, eps1)
            qkv = qkv_proj(h)
            if tape is not None:
                tape.save(li, 0, qkv, record_at)
            qk = self._rope(qkv[..., : (H + KV) * D].view(B, S, H + KV, D), cos, sin)  # q and k heads together
            q = qk[:, :, :H].transpose(1, 2)
            self.kernel.write(cache, li, start, qk[:, :, H:].transpose(1, 2),
                              qkv[..., (H + KV) * D:].view(B, S, KV, D).transpose(1, 2))
            if hidden_keys is not None:  # one token a row, through the decode_attention op
                o = self._attend(q, cache.keys[li, :, :, :end], cache.values[li, :, :, :end], hidden_keys, self.scale)
            else:
                o = F.scaled_dot_product_attention(q, cache.keys[li, :, :, :end], cache.values[li, :, :, :end],
                                               attn_mask=mask, scale=self.scale, enable_gqa=H != KV)
            o = o_proj(o.transpose(1, 2).reshape(B, S, H * D))
            x = x + o
            gu = gate_up_proj(self._rms(x, ln2, eps2))
            gate, up = gu.chunk(2, dim=-1)
            down = down_proj(self._swiglu(gate, up))
            x = x + down
            if tape is not None:
                for which, out in ((1, o), (2, gu), (3, down)):
                    tape.save(li, which, out, record_at)
        return self.head(self._rms(x[:, -1], self.final_norm_w, self.final_eps))

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, start: int, hidden_keys: torch.Tensor,
                       tape: Any, record_at: Any) -> torch.Tensor:
        """:meth:`forward` of one token a row through the backend's ``decode_layer`` op (x (B, hidden), its own)."""
        cos, sin = self.cos[positions], self.sin[positions]
        cache = self.cache
        assert cache is not None, "start() allocates the cache"
        for li, step in enumerate(self._fused):
            into = tape.destinations(li, record_at) if tape is not None else None  # the recording's own slots
            outs = step(x, cache.key_store[li], cache.values[li], cos, sin, hidden_keys, start, out=into)
            if tape is not None and into is None:
                for which, out in enumerate(outs):
                    tape.save(li, which, out, record_at)
        if self._fused_head is not None:
            return self._fused_head(x)
        return self.head(self._rms(x, self.final_norm_w, self.final_eps))


def _layer_arguments(layer: Any, eps: float) -> tuple:
    """The ``decode_layer`` op's weight arguments of one decoder layer: ln1, q/k/v parts, their bias, o, its bias,
    ln2, gate/up parts, down; then the two norms' eps (``eps``: the config's where a norm has none)."""
    a, m = layer.self_attn, layer.mlp
    parts = (a.q_proj, a.k_proj, a.v_proj)
    b_qkv = None
    if any(p.bias is not None for p in parts):
        b_qkv = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in parts])
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    return (n1.weight, [p.weight for p in parts], b_qkv, a.o_proj.weight, a.o_proj.bias, n2.weight,
            [m.gate_proj.weight, m.up_proj.weight], m.down_proj.weight,
            getattr(n1, "variance_epsilon", eps), getattr(n2, "variance_epsilon", eps))


def _diag(S: int, end: int, start: int, device: Any) -> torch.Tensor:
    """(1, 1, S, end) bool, True at (i, start + i): each new token may always attend to itself."""
    d = torch.zeros(S, end, dtype=torch.bool, device=device)
    d[torch.arange(S, device=device), torch.arange(start, end, device=device)] = True
    return d[None, None]


def decode_chunk(decoder: FastDecoder, prompts: list, params: Any, stop: torch.Tensor, generator: torch.Generator,
                 pad_token_id: int, compact_fraction: float, record: bool = False,
                 interrupt: Any = None) -> tuple:
    """The hf engine's sampling loop (same prefill-once-then-repeat-n, same :func:`sample_next` calls, same
    stop rule) on :class:`FastDecoder`. Returns ``(response_ids, logprobs, finish_reasons)`` lists, rows
    prompt-major. Finished rows are dropped from the batch and cache once they are ``compact_fraction``
    of it; the loop ends when every row has finished or ``max_new_tokens`` is reached.

    ``record``: leave a :class:`portrl.models.forward_tape.ForwardTape` of this call in ``decoder.tape``
    (None otherwise), for the training forward of the same weights to reuse. ``interrupt``: a threading.Event that
    ends the loop early when set (:class:`portrl.rollout.decode_rows.DecodeRows`)."""
    dev, n, max_new = decoder.device, params.n, params.max_new_tokens
    ids, mask, lengths = left_pad(prompts, pad_token_id, dev)
    plen = ids.shape[1]
    decoder.start(len(prompts), plen + max_new, decode_rows=len(prompts) * n, steps=max_new - 1)
    tape = decoder.tape = _new_tape(decoder, prompts, n, plen, max_new - 1) if record and max_new > 1 else None
    try:
        logits = decoder.forward(ids, (mask.long().cumsum(-1) - 1).clamp_(min=0), 0, mask,
                                 tape.prefill_slots() if tape is not None else None)
        if n > 1:
            rep = torch.arange(len(prompts), device=dev).repeat_interleave(n)
            decoder.select_rows(rep)
            logits, mask, lengths = logits[rep], mask[rep], lengths[rep]
        rows = DecodeRows(logits.shape[0], max_new, pad_token_id, stop, compact_fraction, dev, interrupt)
        key_mask = torch.zeros(logits.shape[0], plen + max_new, dtype=torch.bool, device=dev)
        key_mask[:, :plen] = mask
        position = lengths.clone()  # rotary position of the next token of each row
        for t in range(max_new):
            if t % 16 == 0:
                note(f"token {t}/{max_new}")  # the console's phase detail (portrl/progress.py)
            tok, lp = sample_next(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                  generator=generator)
            if rows.record(t, tok, lp):
                break
            keep = rows.compact()
            if keep is not None:
                decoder.select_rows(keep)
                tok, position, key_mask = tok[keep], position[keep], key_mask[keep]
            key_mask[:, plen + t] = True
            logits = decoder.forward(tok[:, None], position[:, None], plen + t, key_mask[:, : plen + t + 1],
                                     tape.step_slots(rows.active, t) if tape is not None else None)
            position += 1
    finally:
        decoder.release()
    out = rows.outputs()
    if tape is not None:
        tape.finish(out[0])
    return out


def _new_tape(decoder: FastDecoder, prompts: list, n: int, prompt_slots: int, steps: int):
    w = decoder.inner.embed_tokens.weight
    decoder._last_tape = ForwardTape(decoder.model, prompts, n, prompt_slots, steps, tape_widths(decoder.model),
                                     len(decoder.inner.layers), w.dtype, w.device, reuse=decoder._last_tape,
                                     swiglu=decoder._swiglu, rms_norm=decoder._rms_norm, rotary=decoder._rotary)
    return decoder._last_tape
