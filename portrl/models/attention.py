"""Plug a varlen attention implementation (portrl.ops) into Hugging Face transformers.

:func:`register_attention` registers, under the name ``portrl_<backend>_<impl>`` (:func:`attention_name`),
an attention function in transformers' ``AttentionInterface`` and a mask function in its
``AttentionMaskInterface``; a model loaded with ``attn_implementation=<that name>`` then runs
every layer through the op. Any architecture whose attention layers dispatch through
``ALL_ATTENTION_FUNCTIONS`` (Qwen2 / Qwen2.5, Llama, Mistral, Qwen3, ...) works.

How each call is routed (query ``(B, Hq, S, D)``, key/value ``(B, Hkv, S_kv, D)``):

* no mask, ``S == S_kv``: the ``B*S`` tokens are one packed batch; sequence boundaries come from
  ``cu_seq_lens_q`` in the forward kwargs, else from ``position_ids`` (a sequence starts wherever
  the position does not increase by 1), else each row is one sequence;
* a 2-D padding mask (``S == S_kv``): padding is removed, the rows become a packed batch, and the
  output is scattered back (padded positions get zeros);
* ``S != S_kv`` (decoding with a KV cache): transformers' SDPA path with its 4-D mask;
* with a sequence-parallel group in the kwargs (``portrl.models.sequence_parallel.SEQUENCE_GROUP_KWARG``, a causal
  call without a mask): Ulysses
  attention, the query/key/value of this rank's slice of the packed row exchanged for whole-row heads, attended
  with the row's ``cu_seq_lens_q`` / ``max_length_q``, and exchanged back;
* a shared-prompt plan in the kwargs (:mod:`portrl.models.prefix_sharing`, one packed row):
  q/k/v are gathered into the plan's virtual sequences, attended, and each token keeps its own output (an
  implementation with a true ``GATHERS`` attribute takes the plan's ``gather`` and ``keep`` as keywords and
  selects the rows itself, e.g. folded into its own padding: backends/cpu/kernels.py);
* a bidirectional call (``is_causal=False``, or a module with ``is_causal = False``: the vision tower of
  Qwen2-VL / Qwen2.5-VL, whose blocks attend within each image or window) without a mask: the varlen op
  with ``causal=False``, each row one sequence. transformers calls the vision attention once per image or
  window when the implementation is not a "flash" one (ours never is, see :func:`attention_name`). The
  decoder's packing keywords (``cu_seq_lens_q``, ``position_ids``, the shared-prompt plan), which reach the
  vision blocks through the model's ``**kwargs``, are not the vision tokens' and are ignored there.

transformers' attention and mask plumbing is imported where it is used, when a model is built or run: it
loads transformers' modeling stack (~2 s), and this package is imported by ``portrl.trainer.preflight``,
which checks a run's inputs before any model loads.
"""

from __future__ import annotations

from typing import Callable

import torch

from portrl.models.prefix_sharing import PLAN_KWARG
from portrl.models.sequence_parallel import (SEQUENCE_GROUP_KWARG, expand_kv_heads, heads_to_sequence,
                                             sequence_to_heads)
from portrl.ops.attention import cu_seqlens_from_position_ids

PREFIX = "portrl"


def _mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """The mask our attention function expects: None or a 2-D padding mask when there is no cache offset,
    the SDPA 4-D mask otherwise (decoding)."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask, sdpa_mask  # noqa: PLC0415  (transformers: only where a model is built)

    mask_function = mask_function or causal_mask_function
    if q_length == kv_length:
        return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                    attention_mask, **kwargs)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


def _packed_bounds(batch: int, seq: int, kwargs: dict, device) -> tuple[torch.Tensor, int]:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        max_len = kwargs.get("max_length_q")
        return cu, int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return cu_seqlens_from_position_ids(position_ids.expand(batch, seq))
    return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device), seq


def _sequence_parallel_attention(varlen_fn: Callable, query, key, value, scaling, kwargs: dict, group):
    """Ulysses attention (portrl.models.sequence_parallel): this rank's tokens of every head in, this rank's heads
    of every token attended with the whole packed row's bounds (``cu_seq_lens_q``, ``max_length_q``), and back.
    Returns ``(B, S/sp, H, D)`` as the other routes do."""
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("max_length_q") is None:
        raise ValueError("sequence parallel attention needs the packed row's cu_seq_lens_q and max_length_q "
                         "(portrl.models.logprobs packs the rows and passes them)")
    sp = torch.distributed.get_world_size(group)
    q = sequence_to_heads(query, group)
    k, v = (sequence_to_heads(expand_kv_heads(t, sp), group) for t in (key, value))
    batch, heads, seq, dim = q.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (q, k, v))
    out = varlen_fn(q, k, v, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scaling, True)
    out = heads_to_sequence(out.reshape(batch, seq, heads, dim).transpose(1, 2), group)
    return out.transpose(1, 2)


def make_attention_forward(varlen_fn: Callable) -> Callable:
    """A transformers attention function (module, query, key, value, attention_mask, ...) -> (out, None)
    backed by ``varlen_fn(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)``."""

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          sliding_window=None, softcap=None, is_causal=None, **kwargs):
        if dropout:
            raise ValueError(f"portrl varlen attention has no dropout; got attention dropout {dropout} "
                             "(set the model config's attention_dropout to 0.0)")
        if softcap:
            raise ValueError(f"portrl varlen attention has no logit softcap; got {softcap}")
        batch, _, seq, _ = query.shape
        if key.shape[2] != seq or (attention_mask is not None and attention_mask.dim() == 4):
            from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415  (transformers: only where a model is built)

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, sliding_window=sliding_window, is_causal=is_causal,
                                          **kwargs)
        if sliding_window is not None and sliding_window < seq:
            raise ValueError(f"portrl varlen attention has no sliding window; layer window {sliding_window} < "
                             f"sequence length {seq} (disable use_sliding_window in the model config)")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        group = kwargs.get(SEQUENCE_GROUP_KWARG)
        if group is not None and causal and attention_mask is None:
            return _sequence_parallel_attention(varlen_fn, query, key, value, scaling, kwargs, group), None
        q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]) for t in (query, key, value))
        if not causal and attention_mask is None:
            cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
            out = varlen_fn(q, k, v, cu, seq, scaling, False)
            return out.reshape(batch, seq, *out.shape[1:]), None
        plan = kwargs.get(PLAN_KWARG)
        if plan is not None and attention_mask is None:
            plan.reads += 1
            if getattr(varlen_fn, "GATHERS", False):  # it selects the plan's rows itself (folded into its own)
                out = varlen_fn(q, k, v, plan.cu_seqlens, plan.max_seqlen, scaling, causal, gather=plan.gather,
                                keep=plan.keep)
                return out.reshape(batch, seq, *out.shape[1:]), None
            # index_select, not indexing: its backward is index_add (indexing's is a slower index_put)
            qg, kg, vg = (t.index_select(0, plan.gather) for t in (q, k, v))
            out = varlen_fn(qg, kg, vg, plan.cu_seqlens, plan.max_seqlen, scaling, causal).index_select(0, plan.keep)
            return out.reshape(batch, seq, *out.shape[1:]), None
        if attention_mask is None:
            cu, max_len = _packed_bounds(batch, seq, kwargs, query.device)
            out = varlen_fn(q, k, v, cu, max_len, scaling, causal)
            return out.reshape(batch, seq, *out.shape[1:]), None
        keep = attention_mask.reshape(-1).bool()
        index = torch.nonzero(keep).reshape(-1)
        lengths = attention_mask.bool().sum(1)
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=query.device)
        cu[1:] = torch.cumsum(lengths, 0)
        out = varlen_fn(q[index], k[index], v[index], cu, int(lengths.max()), scaling, causal)
        full = out.new_zeros(batch * seq, *out.shape[1:]).index_copy(0, index, out)
        return full.reshape(batch, seq, *out.shape[1:]), None

    return attention_forward


def attention_name(backend_name: str, impl_name: str) -> str:
    """``portrl_<backend>_<impl>`` with every "flash" in it spelled "fa": transformers
    (5.x) takes any implementation name containing "flash" for a flash-attention kernel, imports it when a model
    is built (which fails for a name of ours) and sends vision towers down its flash-only code path."""
    return f"{PREFIX}_{backend_name}_{impl_name}".replace("flash", "fa")


def register_attention(backend_name: str, impl_name: str, varlen_fn: Callable) -> str:
    """Register ``varlen_fn`` with transformers; return the ``attn_implementation`` name to load models with."""
    from transformers import AttentionInterface  # noqa: PLC0415  (transformers: only where a model is built)
    from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415  (transformers: only where a model is built)

    name = attention_name(backend_name, impl_name)
    AttentionInterface.register(name, make_attention_forward(varlen_fn))
    AttentionMaskInterface.register(name, _mask_function)
    return name
