"""Ops: pure-torch reference ("native") implementations and the registry backends add kernels to.

``from portrl.ops import select`` then ``impl, fn = select("attention_varlen", backend=backend)``.
"""

from portrl.ops.attention import (
    attention_varlen,
    check_varlen_inputs,
    cu_seqlens_from_lengths,
    cu_seqlens_from_position_ids,
    decode_attention,
)
from portrl.ops.layers import apply_rotary, linear_prepacked, rms_norm, rotate_half, swiglu
from portrl.ops.logprobs import RowOps, chunked_logprobs_entropy, logprobs_entropy, logprobs_entropy_full
from portrl.ops.registry import OPS, OpError, implementations, register, runnable, select, unregister
from portrl.ops.rotary_multimodal import apply_multimodal_rotary, multimodal_cos_sin, multimodal_rope_index

__all__ = [
    "OPS", "OpError", "RowOps", "apply_multimodal_rotary", "apply_rotary", "attention_varlen", "check_varlen_inputs",
    "chunked_logprobs_entropy", "cu_seqlens_from_lengths", "cu_seqlens_from_position_ids", "decode_attention",
    "implementations",
    "linear_prepacked", "logprobs_entropy", "logprobs_entropy_full", "multimodal_cos_sin", "multimodal_rope_index",
    "register", "rms_norm", "rotate_half", "runnable", "select", "swiglu", "unregister",
]
