"""Ascend kernels for portrl.ops through torch_npu: fused attention (TND varlen), RMSNorm, rotary, SwiGLU.

* ``npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
  atten_mask=None, scale=1., keep_prob=1., pre_tockens=..., next_tockens=..., inner_precise=0,
  prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, ...)[0]``: layout "TND"
  is varlen; ``actual_seq_qlen`` is a host list of cumulative lengths without the leading 0
  (``cu_seqlens[1:].tolist()``); the mask polarity is the inverse of SDPA's (True = masked out);
  causal uses sparse_mode 3 with the compressed ``triu(ones(2048, 2048), 1).bool()`` mask; the
  scale defaults to 1.0 in the vendor API, so 1/sqrt(D) is always passed. GQA: Nq/Nkv integer.
* ``npu_rms_norm(x, gamma, epsilon) -> (out, rstd)``; ``npu_rotary_mul(x, cos, sin, rotary_mode="half")``
  on 4-D tensors; ``npu_swiglu(x, dim=-1)`` = silu(first half) * second half.
Argument translation is tested on CPU with checkers; numerics need Ascend hardware.
"""

from __future__ import annotations

import torch

from portrl.device.backend import KernelRegistry, import_optional, module_available
from portrl.ops.attention import check_varlen_inputs

NPU_INSTALL = 'pip install "torch-npu==2.10.0.post4" (the row torch 2.10.0 + CANN 9.1.0; see `portrl doctor`)'
SPARSE_CAUSAL = 3  # causal, bottom-right aligned (identical to top-left when q and k lengths match)
MASK_SIZE = 2048

_masks: dict[str, torch.Tensor] = {}


def _torch_npu():
    return import_optional("torch_npu", NPU_INSTALL)


def compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 bool mask sparse modes 2-4 need: True above the diagonal (= masked out). Cached per device."""
    key = str(device)
    if key not in _masks:
        _masks[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, device=device), diagonal=1).bool()
    return _masks[key]


def npu_fusion_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """Varlen attention through ``npu_fusion_attention`` in TND layout."""
    scale, _ = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    seq_ends = [int(x) for x in cu_seqlens[1:].tolist()]
    kwargs: dict[str, object] = dict(pse=None, padding_mask=None, scale=scale, keep_prob=1.0,
                  actual_seq_qlen=seq_ends, actual_seq_kvlen=seq_ends)
    if causal:
        kwargs.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_CAUSAL)
    else:
        kwargs.update(atten_mask=None, sparse_mode=0)
    return _torch_npu().npu_fusion_attention(q, k, v, q.shape[1], "TND", **kwargs)[0]


def npu_rms_norm(x, weight, eps: float = 1e-6):
    """``npu_rms_norm(x, gamma, epsilon)[0]``."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must have shape ({x.shape[-1]},) (x's last dim); got {tuple(weight.shape)}")
    return _torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def npu_rotary(x, cos, sin):
    """``npu_rotary_mul(x, cos, sin, rotary_mode="half")``; inputs of fewer than 4 dims are viewed as 4-D."""
    if x.dim() > 4:
        raise ValueError(f"npu_rotary_mul takes at most 4-D inputs; got {x.dim()}-D")
    lift = 4 - x.dim()
    shape = x.shape
    x4, cos4, sin4 = (t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) for t in (x, cos, sin))
    out = _torch_npu().npu_rotary_mul(x4, cos4, sin4, rotary_mode="half")
    return out.reshape(shape) if lift else out


def npu_swiglu(gate, up):
    """``npu_swiglu(cat([gate, up], -1), dim=-1)``: silu of the first half times the second half."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _torch_npu().npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)


def _available():
    return True if module_available("torch_npu") else f"torch_npu is not installed ({NPU_INSTALL})"


def register(registry: KernelRegistry) -> None:
    """Register the Ascend implementations into ``portrl.ops.registry``."""
    registry.register("attention_varlen", "npu_fusion", npu_fusion_attention_varlen, _available)
    registry.register("rms_norm", "npu_rms_norm", npu_rms_norm, _available)
    registry.register("rotary", "npu_rotary_mul", npu_rotary, _available)
    registry.register("swiglu", "npu_swiglu", npu_swiglu, _available)
