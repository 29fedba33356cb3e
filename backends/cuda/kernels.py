"""NVIDIA kernels for portrl.ops: flash-attention varlen (FA2, FA3 when installed), SDPA, Triton kernels.

flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
softmax_scale=None, causal=False, ...): q (total, Hq, D), k/v (total, Hkv, D) with GQA, cu_seqlens int32
(B+1). With equal q/k lengths causal top-left and bottom-right alignment coincide. FA3
(``flash_attn_interface``, Hopper) has no dropout_p and may return ``(out, lse)``.
Flash-attention computes fp16/bf16 only; other dtypes take the per-sequence SDPA path.
Tested on CPU for argument translation only; numerics and speed need the GPU.
"""

from __future__ import annotations

import torch

from portrl.backends import triton as triton_kernels
from portrl.backends.cpu.kernels import attention_varlen_sdpa
from portrl.device.backend import KernelRegistry, import_optional, module_available
from portrl.ops.attention import check_varlen_inputs

FA2_INSTALL = 'pip install "flash-attn==2.8.3" --no-build-isolation (the row torch 2.8.0 + vLLM 0.11.0 + flash-attn 2.8.3)'
FA3_INSTALL = "build flash-attention's hopper/ package (cd hopper && python setup.py install)"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_args(q, cu_seqlens, max_seqlen):
    """(cu_seqlens as int32 on q's device, max_seqlen as int) — what flash-attention style kernels take."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return cu, int(max_seqlen) if max_seqlen is not None else int((cu[1:] - cu[:-1]).max())


def flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """FA2 ``flash_attn.flash_attn_varlen_func`` (also the ROCm flash-attn build, CK or Triton backend)."""
    scale, _ = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    if q.dtype not in FLASH_DTYPES:
        return attention_varlen_sdpa(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    fa = import_optional("flash_attn", FA2_INSTALL)
    cu, m = varlen_args(q, cu_seqlens, max_seqlen)
    return fa.flash_attn_varlen_func(q, k, v, cu, cu, m, m, dropout_p=0.0, softmax_scale=scale, causal=causal)


def flash_attn3_varlen(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """FA3 ``flash_attn_interface.flash_attn_varlen_func`` (Hopper)."""
    scale, _ = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    if q.dtype not in FLASH_DTYPES:
        return attention_varlen_sdpa(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    fa3 = import_optional("flash_attn_interface", FA3_INSTALL)
    cu, m = varlen_args(q, cu_seqlens, max_seqlen)
    out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, m, m, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def needs(module: str, install: str):
    """An availability check: True when ``module`` is importable, else the reason with the install command."""
    return lambda: True if module_available(module) else f"{module} is not installed ({install})"


def register(registry: KernelRegistry) -> None:
    """Register the NVIDIA implementations (and the shared Triton kernels) into ``portrl.ops.registry``."""
    registry.register("attention_varlen", "flash_attn3", flash_attn3_varlen, needs("flash_attn_interface", FA3_INSTALL))
    registry.register("attention_varlen", "flash_attn", flash_attn_varlen, needs("flash_attn", FA2_INSTALL))
    registry.register("attention_varlen", "sdpa", attention_varlen_sdpa)
    triton_kernels.register(registry)
