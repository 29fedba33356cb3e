"""AMD Instinct kernels for portrl.ops: aiter varlen attention, flash-attn (ROCm build), SDPA, Triton kernels.

* ``aiter.flash_attn_varlen_func`` is flash-attn compatible (same positional arguments; may return
  ``(out, lse)`` with return_lse).
* The ROCm flash-attn build keeps ``flash_attn.flash_attn_varlen_func``: the CK backend by default, its
  Triton backend when ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` is set before import.
Both compute fp16/bf16 only; other dtypes take the per-sequence SDPA path. Argument translation is
tested on CPU; numerics and speed need MI300 hardware.
"""

from __future__ import annotations

from portrl.backends import triton as triton_kernels
from portrl.backends.cpu.kernels import attention_varlen_sdpa
from portrl.backends.cuda.kernels import FA2_INSTALL, FLASH_DTYPES, flash_attn_varlen, needs, varlen_args
from portrl.device.backend import KernelRegistry, import_optional
from portrl.ops.attention import check_varlen_inputs

AITER_INSTALL = "pip install git+https://github.com/ROCm/aiter (or use a rocm/vllm image, which ships it)"


def aiter_varlen(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, causal=True):
    """``aiter.flash_attn_varlen_func``."""
    scale, _ = check_varlen_inputs(q, k, v, cu_seqlens, softmax_scale)
    if q.dtype not in FLASH_DTYPES:
        return attention_varlen_sdpa(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    aiter = import_optional("aiter", AITER_INSTALL)
    cu, m = varlen_args(q, cu_seqlens, max_seqlen)
    out = aiter.flash_attn_varlen_func(q, k, v, cu, cu, m, m, dropout_p=0.0, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def register(registry: KernelRegistry) -> None:
    """Register the ROCm implementations (and the shared Triton kernels) into ``portrl.ops.registry``."""
    registry.register("attention_varlen", "aiter", aiter_varlen, needs("aiter", AITER_INSTALL))
    registry.register("attention_varlen", "flash_attn", flash_attn_varlen, needs("flash_attn", FA2_INSTALL))
    registry.register("attention_varlen", "sdpa", attention_varlen_sdpa)
    triton_kernels.register(registry)
