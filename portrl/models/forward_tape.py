"""Reuse the rollout's forward pass for the training forward of an on-policy step.

On-policy (the update's first forward runs on the weights the rollout sampled with), the training
forward over a batch recomputes what the rollout already computed token by token. The hf engine's
fast decoder (:mod:`portrl.rollout.fast_decode`) can record, per layer, the outputs of its four
matmuls (fused q/k/v with bias, o, fused gate/up, down) for every token it runs: each prompt once in
the prefill, then every response token it feeds back. :func:`replay_hidden_states` is then the
training forward of the shared-prompt layout (:mod:`portrl.models.prefix_sharing`) in which every
linear layer *returns the recorded output* and only its backward runs::

    y = recorded,   dX = dY W,   dW = dY^T X,   db = sum(dY)

while embeddings, RMSNorm, rotary, attention, SwiGLU and the residuals are recomputed from the model's
own modules (cheap elementwise work; they build autograd's graph). That drops the forward's matmuls,
a third of the update's arithmetic. The values equal a fresh forward up to float rounding (the
recorded matmuls ran on decode-sized batches); tests hold log-probs and gradients to 1e-4.

Safety: the tape belongs to the recorded module (:meth:`ForwardTape.usable` refuses any other) and
stores every parameter's version counter (``Tensor._version``, bumped by in-place ops such as
``copy_`` in a weight load or a foreach optimizer step) and refuses once one moved. Fused optimizers
(``torch.optim.AdamW(fused=True)``) update in place *without* bumping it, so the owner must drop the
tape at its first optimizer step (the actor does). Rows it did not record (another generate call,
edited tokens) make :meth:`ForwardTape.positions` return None. Either way the caller runs the
ordinary forward.

Layout of the recorded tokens: ``prompts x Pmax`` prefill slots (prompts left-padded to ``Pmax``),
then ``steps x rows`` decode slots, slot ``t * rows + r`` holding response token ``t`` of output row
``r`` (rows prompt-major: row ``r`` samples prompt ``r // n``), so that a decode step writes one
contiguous block until finished rows are dropped from the batch. The buffers can be lent by the
previous tape (``reuse``), which is then invalidated: recording allocates nothing in steady state.

Memory: the owner sets :attr:`ForwardTape.free_after_replay` before the tape's last replay (the update's last
micro-batch that reads it); that replay frees each layer's buffers right after the layer's last read (its
recompute in backward under gradient checkpointing, else its forward), so the gradients the backward adds take
the place of the tape instead of adding to it (Qwen2.5-0.5B, 4 x 4 x 128 tokens: a 3.2 GB tape against 1.8 GB of
gradients). A tape with freed layers is no longer usable nor lent to the next recording.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from portrl.models.hf_types import HFModule
from portrl.models.prefix_sharing import PLAN_KWARG
from portrl.ops.layers import apply_rotary

#: the recorded matmuls of a layer, in order
QKV, O, GATE_UP, DOWN = range(4)


class ForwardTape:
    """Recorded matmul outputs of one generate call (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int, prompt_slots: int,
                 steps: int, widths: Sequence[int], num_layers: int, dtype: torch.dtype, device: Any,
                 reuse: Optional["ForwardTape"] = None, swiglu: Any = None, rms_norm: Any = None,
                 rotary: Any = None):
        #: the recording decoder's swiglu kernel (portrl.ops "swiglu"), which the replay's SiLU MLPs run too; None:
        #: the model's own ``act_fn(gate) * up``
        self.swiglu = swiglu
        #: the recording decoder's backend's rms_norm kernel (portrl.ops "rms_norm"), which the replay's norms run
        #: (the decoder computed them as that op's formula); None: the model's own norm modules
        self.rms_norm = rms_norm
        #: the recording decoder's backend's rotary kernel (portrl.ops "rotary": ``x * cos + rotate_half(x) * sin``),
        #: which the replay runs on q and k; None: that formula in torch ops
        self.rotary = rotary
        self.prompts = [tuple(p) for p in prompts]
        self.n, self.prompt_slots, self.steps = int(n), int(prompt_slots), int(steps)
        self.rows = len(self.prompts) * self.n
        self.decode_base = len(self.prompts) * self.prompt_slots
        slots = self.decode_base + self.rows * self.steps
        old = reuse._storage if reuse is not None else None
        first = old[0] if old else None
        fits = (old is not None and first is not None and len(old) == num_layers
                and all(layer is not None for layer in old) and [b.shape[1] for b in first] == list(widths)
                and first[0].shape[0] >= slots and first[0].dtype == dtype and first[0].device == torch.device(device))
        if fits and reuse is not None:
            reuse.invalidate()
        #: per layer, the recorded outputs' full buffers; None once freed (:meth:`layer_read`)
        self._storage: list[Optional[list[torch.Tensor]]] = (
            old if fits and old is not None else [[torch.empty(slots, w, dtype=dtype, device=device) for w in widths]
                                                  for _ in range(num_layers)])
        #: per layer, the slots of this recording; None once freed
        self.buffers: list[Optional[list[torch.Tensor]]] = [[b[:slots] for b in layer] if layer is not None else None
                                                            for layer in self._storage]
        #: the input embedding is the LM head's weight: the replay's lookup can give a sparse gradient (below)
        self.tied_embedding = _ties_embedding(model)
        self._params = list(model.parameters())
        self._versions = [p._version for p in self._params]
        self._param_ids = {id(p) for p in self._params}
        self._rows: dict = {}
        self.free_after_replay = False  # see the module docstring (Memory)
        self._reads_to_free = 0  # set by a final replay: the read of a layer after which it is freed
        self._reads = [0] * num_layers

    # ---------------------------------------------------------------------------- recording
    def prefill_slots(self) -> slice:
        return slice(0, self.decode_base)

    def step_slots(self, out_rows: torch.Tensor, step: int):
        """Slots of decode step ``step`` for the batch rows whose output rows are ``out_rows`` (a slice while
        every row is still in the batch)."""
        start = self.decode_base + step * self.rows
        return slice(start, start + self.rows) if len(out_rows) == self.rows else start + out_rows

    def save(self, layer: int, which: int, out: torch.Tensor, slots) -> None:
        buf = self._layer_buffers(layer)[which]
        if isinstance(slots, slice):
            buf[slots].copy_(out.reshape(-1, buf.shape[1]))
        else:
            buf.index_copy_(0, slots, out.reshape(-1, buf.shape[1]))

    def destinations(self, layer: int, slots) -> Optional[list[torch.Tensor]]:
        """Where :meth:`save` of ``layer``'s outputs at ``slots`` would copy them, for a producer to write into
        directly (contiguous rows: ``slots`` a slice); None for scattered slots."""
        return [b[slots] for b in self._layer_buffers(layer)] if isinstance(slots, slice) else None

    def finish(self, response_ids: Sequence[Sequence[int]]) -> None:
        """Name the rows: (prompt, response) -> output row."""
        for r, resp in enumerate(response_ids):
            self._rows.setdefault((self.prompts[r // self.n], tuple(resp)), r)

    def invalidate(self) -> None:
        """Forget the rows (another recording now owns the buffers)."""
        self._rows = {}

    # ------------------------------------------------------------------------------- replay
    def usable(self, module: torch.nn.Module) -> bool:
        """True when ``module``'s parameters are the recorded model's and none changed since the recording."""
        return (bool(self._rows) and all(layer is not None for layer in self._storage)
                and all(id(p) in self._param_ids for p in module.parameters())
                and all(p._version == v for p, v in zip(self._params, self._versions)))

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> Optional[torch.Tensor]:
        """``(B, L)`` slot of each real token of a verl-layout batch (0 elsewhere), or None when some row
        was not recorded. A response's last token maps to its row's last slot (it is never run).

        Prompt column ``c`` of row ``b`` (recorded as output row ``r``, prompt ``g = r // n``, ``P`` prompt tokens) is
        prefill slot ``g * prompt_slots + prompt_slots - split + c`` (prompts are left-padded there as here); response
        column ``split + t`` is decode slot ``decode_base + min(t, steps - 1) * rows + r``. The row lookup is Python
        over plain lists, the slots one vectorised pass (per-row tensor indexing cost ~25 small ops a row)."""
        ids, mask = input_ids.cpu(), attention_mask.bool().cpu()
        batch, length = ids.shape
        split = length - int(response_length)
        prompt_len, resp_len = mask[:, :split].sum(1), mask[:, split:].sum(1)
        rows_list = ids.tolist()
        recorded = []
        for b, (P, R) in enumerate(zip(prompt_len.tolist(), resp_len.tolist())):
            r = self._rows.get((tuple(rows_list[b][split - P:split]), tuple(rows_list[b][split:split + R])))
            if r is None or P > self.prompt_slots or R > self.steps + 1:
                return None
            recorded.append(r)
        r = torch.tensor(recorded, dtype=torch.long)[:, None]
        col = torch.arange(length)[None]
        prompt_slot = (r // self.n) * self.prompt_slots + self.prompt_slots - split + col
        resp_slot = self.decode_base + (col - split).clamp(0, max(self.steps - 1, 0)) * self.rows + r
        in_prompt = (col >= split - prompt_len[:, None]) & (col < split)
        in_resp = (col >= split) & (col < split + resp_len[:, None])
        out = torch.where(in_prompt, prompt_slot, torch.where(in_resp, resp_slot, 0))
        return out.to(input_ids.device)

    def outputs(self, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
        return self._layer_buffers(layer)[which].index_select(0, slots)

    def _layer_buffers(self, layer: int) -> list[torch.Tensor]:
        buffers = self.buffers[layer]
        if buffers is None:
            raise RuntimeError(f"ForwardTape: layer {layer}'s buffers were freed by a final replay (free_after_replay)")
        return buffers

    def start_replay(self, checkpointing: bool) -> None:
        """Begin a replay; a final one (:attr:`free_after_replay`) frees each layer at its last read: the second
        under gradient checkpointing (the recompute in backward), else the first."""
        self._reads = [0] * len(self._storage)
        self._reads_to_free = (2 if checkpointing else 1) if self.free_after_replay else 0

    def layer_read(self, layer: int) -> None:
        """Count one read of all of ``layer``'s outputs by the replay; free its buffers at the last one."""
        self._reads[layer] += 1
        if self._reads[layer] == self._reads_to_free:
            self.buffers[layer] = self._storage[layer] = None


class _RecordedLinear(torch.autograd.Function):
    """``(y_1, ..., y_k) = split(recorded)`` for the linears ``y_i = x W_i^T + b_i`` sharing the input ``x``; backward
    of the real thing. Inputs: ``x, y, k, W_1..W_k, b_1..b_k`` (a bias may be None). Separate outputs, so the
    backward gets each ``dY_i`` as it is (no concatenation of the gradients)."""

    @staticmethod
    def forward(ctx, x, y, k, *params):
        ctx.k = k
        ctx.has_bias = [b is not None for b in params[k:]]
        ctx.save_for_backward(x, *params[:k])
        return tuple(y.split([w.shape[0] for w in params[:k]], dim=-1))

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        k, need = ctx.k, ctx.needs_input_grad
        dx = None
        if need[0]:
            for dy, w in zip(dys, weights):
                dx = dy @ w if dx is None else dx.addmm_(dy, w)
        dws = [dy.t() @ x if need[3 + i] else None for i, dy in enumerate(dys)]
        dbs = [dy.sum(0) if has and need[3 + k + i] else None for i, (dy, has) in enumerate(zip(dys, ctx.has_bias))]
        return (dx, None, None, *dws, *dbs)


def _recorded_linear(x: torch.Tensor, y: torch.Tensor, linears: List[torch.nn.Linear]) -> tuple:
    return _RecordedLinear.apply(x, y, len(linears), *[m.weight for m in linears], *[m.bias for m in linears])


def replay_hidden_states(base: HFModule, tape: ForwardTape, layout: Any, slots: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states ``(N, H)`` of ``layout`` (a SharedPromptLayout) for a Llama-family decoder
    ``base`` (Qwen2 / Llama / Mistral ``*Model``), its linears taken from ``tape`` at ``slots (N,)``.

    Mirrors the decoder layer of those models: ``h = x + o(attn(rope(q), rope(k), v))``,
    ``x' = h + down(act(gate) * up)``, pre-norm, through the model's own norm, rotary and attention
    modules (the attention must be a portrl one, which reads the layout's plan). Under the model's gradient
    checkpointing (``base.gradient_checkpointing``, as transformers' ``gradient_checkpointing_enable`` sets it)
    each layer keeps only its input: its forward is the tape's ``x + o + down`` (:func:`_checkpointed_layer`) and
    the whole layer replays in backward, so neither pass runs the layer's matmuls."""
    # lazy: transformers.modeling_utils takes seconds to import, and the checks before a run load no model
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415  (transformers: only where a model is built)

    attention = ALL_ATTENTION_FUNCTIONS[base.config._attn_implementation]
    ids, positions = layout.flat_ids, layout.position_ids
    x = _embed(base.embed_tokens, ids, sparse_grad=tape.tied_embedding)
    cos, sin = base.rotary_emb(x[None], positions[None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # (N, 1, D)
    checkpointing = bool(getattr(base, "gradient_checkpointing", False)) and torch.is_grad_enabled()
    tape.start_replay(checkpointing)
    # silu(gate) * up through the recording decoder's swiglu op (one fused pass where it has one), for SiLU MLPs;
    # taken from the tape, not selected here: select() without a backend re-detects it (~25 ms of package
    # metadata reads a step)
    swiglu = tape.swiglu if getattr(base.config, "hidden_act", None) == "silu" else None
    for li, layer in enumerate(base.layers):
        args = (x, layer, li, tape, slots, cos, sin, attention, layout.plan, swiglu)
        if not checkpointing:
            x = _replay_layer(*args)
        elif x.requires_grad:  # reentrant checkpointing builds the layer's graph only from an input that needs grad
            x = checkpoint(_checkpointed_layer, *args, use_reentrant=True)
        else:  # e.g. a frozen embedding: the layer's weights still need their gradients
            x = checkpoint(_replay_layer, *args, use_reentrant=False)
    return _norm(base.norm, x, tape.rms_norm)


def _norm(module: HFModule, x: torch.Tensor, rms_norm: Any) -> torch.Tensor:
    """``module(x)`` for an RMSNorm module of a Llama-family model, through the op ``rms_norm`` when given (the same
    formula: ``weight * x / sqrt(mean(x^2) + variance_epsilon)``); a module without ``variance_epsilon`` runs itself."""
    eps = getattr(module, "variance_epsilon", None)
    return module(x) if rms_norm is None or eps is None else rms_norm(x, module.weight, eps)


def _embed(embedding: torch.nn.Embedding, ids: torch.Tensor, sparse_grad: bool) -> torch.Tensor:
    """``embedding(ids)``; with ``sparse_grad`` its weight's gradient is sparse (the looked-up rows only). Only for a
    weight the LM head shares: the head's dense gradient reaches the same weight in the same backward and autograd
    adds the sparse rows into it, where the dense form first fills a (V, H) zero tensor (545 MB at Qwen2.5-0.5B;
    its cost: docs/performance.md) and then adds all of it. The weight's ``.grad`` stays dense."""
    if not sparse_grad:
        return embedding(ids)
    return torch.nn.functional.embedding(ids, embedding.weight, embedding.padding_idx, embedding.max_norm,
                                         embedding.norm_type, embedding.scale_grad_by_freq, sparse=True)


def _ties_embedding(model: torch.nn.Module) -> bool:
    """Whether ``model``'s input embedding weight is its output embedding's (``tie_word_embeddings``)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    head, embedding = get_out(), get_in()
    return head is not None and embedding is not None and head.weight is embedding.weight


def _checkpointed_layer(x: torch.Tensor, layer: HFModule, li: int, tape: ForwardTape, slots: torch.Tensor,
                        *rest: Any) -> torch.Tensor:
    """A layer of :func:`replay_hidden_states` under (reentrant) gradient checkpointing. Its forward runs without
    autograd and needs only the layer's output, which the tape gives without the layer: ``x + o + down``, the same
    two sums in the same order as :func:`_replay_layer` (bit for bit), so no norm, rotary, attention or SwiGLU runs
    and only two of the four recorded outputs are read. The recompute in backward (autograd on) runs the whole
    layer to build its graph."""
    if torch.is_grad_enabled():
        return _replay_layer(x, layer, li, tape, slots, *rest)
    h = x + tape.outputs(li, O, slots)
    down = tape.outputs(li, DOWN, slots)
    tape.layer_read(li)
    return h + down


def _replay_layer(x: torch.Tensor, layer: HFModule, li: int, tape: ForwardTape, slots: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, attention: Any, plan: Any, swiglu: Any) -> torch.Tensor:
    """One decoder layer of :func:`replay_hidden_states` on the hidden states ``x (N, H)``."""
    a, m = layer.self_attn, layer.mlp
    N, H, D, KV = x.shape[0], a.config.num_attention_heads, a.head_dim, a.config.num_key_value_heads
    q, k, v = _recorded_linear(_norm(layer.input_layernorm, x, tape.rms_norm), tape.outputs(li, QKV, slots),
                               [a.q_proj, a.k_proj, a.v_proj])
    q, k, v = q.reshape(N, H, D), k.reshape(N, KV, D), v.reshape(N, KV, D)
    rotary = tape.rotary or apply_rotary
    q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    out, _ = attention(a, *(t.transpose(0, 1)[None] for t in (q, k, v)), None, dropout=0.0, scaling=a.scaling,
                       **{PLAN_KWARG: plan})
    x = x + _recorded_linear(out.reshape(N, H * D), tape.outputs(li, O, slots), [a.o_proj])[0]
    gate, up = _recorded_linear(_norm(layer.post_attention_layernorm, x, tape.rms_norm),
                                tape.outputs(li, GATE_UP, slots), [m.gate_proj, m.up_proj])
    act = swiglu(gate, up) if swiglu is not None else m.act_fn(gate) * up
    down = tape.outputs(li, DOWN, slots)
    # before the last op: a checkpoint's recompute stops once the last tensor backward needs is saved
    tape.layer_read(li)
    return x + _recorded_linear(act, down, [m.down_proj])[0]


def tape_nbytes(model: torch.nn.Module, num_prompts: int, prompt_slots: int, n: int, steps: int) -> int:
    """Bytes the ForwardTape of one generate call holds: ``(num_prompts x prompt_slots + num_prompts x n x steps)``
    slots (the layout in the module docstring) x the four matmul widths x layers x the weights' element size."""
    slots = num_prompts * prompt_slots + num_prompts * n * steps
    inner: HFModule = model.model
    return slots * sum(tape_widths(model)) * len(inner.layers) * inner.embed_tokens.weight.element_size()


def tape_widths(model: torch.nn.Module) -> List[int]:
    """Output widths of the four recorded matmuls of a layer of ``model`` (a Llama-family CausalLM)."""
    inner: HFModule = model.model
    layer = inner.layers[0]
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features, a.o_proj.out_features,
            m.gate_proj.out_features + m.up_proj.out_features, m.down_proj.out_features]

