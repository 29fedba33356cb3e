"""The CPU's decode kernel (portrl/device/decode_kernel.py's contract): the KV cache in the layout of the CPU's
attention and decode-layer kernels, and the parts of a decode step the CPU runs its own way.

* Keys stored transposed, ``(layers, rows, kv_heads, head_dim, slots)``, the slots padded to a multiple of
  :data:`KEY_ALIGN`: a step's scores then take a vector of keys per load with no horizontal sums
  (decode_attention.cpp; docs/performance.md: the fused attention ~2x torch's on the Qwen2.5-0.5B shapes, unaligned
  rows cost it ~1.5x). ``KVCache.keys`` stays the ``(layers, rows, kv_heads, slots, head_dim)`` view.
* One-token steps attend through the backend's ``decode_attention`` op (``step_attention``): SDPA's per-call set-up
  costs more than a step's math here (its native implementation, four plain ops, saved 4 % of a medium model's
  generate call).
* The norms run the backend's ``rms_norm`` op (``own_norm``): ``F.rms_norm`` on a step's (rows, hidden) opens a
  parallel region, waking a sleeping OpenMP thread (~50 us on a VM) for microseconds of work.
* A step's layers and its last norm and head go through the ``decode_layer`` op (decode_layer.py: one native call
  a layer, on threads that stay awake between them) for float32 caches and up to the op's ``max_rows`` rows.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

import torch

from portrl.device.decode_kernel import DecodeKernel, KVCache
from portrl.ops.decode_layer import bind_head, bind_layer

#: the keys' slots are padded to a multiple of this: 64-byte rows of float32 (see the module docstring)
KEY_ALIGN = 16


class CPUDecodeKernel(DecodeKernel):
    """See the module docstring."""

    step_attention: ClassVar[bool] = True
    own_norm: ClassVar[bool] = True

    def allocate(self, layers: int, rows: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        store = torch.zeros(layers, rows, kv_heads, head_dim, -(-slots // KEY_ALIGN) * KEY_ALIGN, dtype=dtype,
                            device=device)
        values = torch.zeros(layers, rows, kv_heads, slots, head_dim, dtype=dtype, device=device)
        return KVCache(store.transpose(-1, -2)[:, :, :, :slots], values, store)

    def select_rows(self, cache: KVCache, index: torch.Tensor) -> KVCache:
        """Selected on the keys' storage, so they stay stored transposed."""
        store = cache.key_store.index_select(1, index)
        return KVCache(store.transpose(-1, -2)[:, :, :, : cache.keys.shape[3]], cache.values.index_select(1, index),
                       store)

    def bind(self, op: Optional[Callable], layers: Sequence[Sequence], scale: float, heads: int, kv_heads: int,
             rows: int, cache: KVCache) -> list[Callable]:
        if op is None or not _served(op, rows, cache):
            return []
        return [bind_layer(op, weights, scale, heads, kv_heads) for weights in layers]

    def head(self, op: Optional[Callable], norm_w: torch.Tensor, eps: float, head_w: torch.Tensor,
             head_b: Optional[torch.Tensor], rows: int, cache: KVCache) -> Optional[Callable]:
        if op is None or not _served(op, rows, cache):
            return None
        return bind_head(op, norm_w, eps, head_w, head_b)


def _served(op: Callable, rows: int, cache: KVCache) -> bool:
    """Whether the one-call layer serves the steps: it takes this kernel's keys (stored transposed) in float32 on the
    CPU, and up to its ``max_rows`` rows (more: op by op)."""
    values = cache.values
    return (values.device.type == "cpu" and values.dtype == torch.float32
            and rows <= getattr(op, "max_rows", rows))
