"""The decode kernel: what a backend tells the hf engine's fast decoder (portrl/rollout/fast_decode.py) about its
KV cache and the parts of a step it runs its own way (:meth:`portrl.device.backend.Backend.decode_kernel`).

This class is the contract and its plain-torch default, which a backend that provides none gets: a cache of
``(layers, rows, kv_heads, slots, head_dim)`` keys and values, each step written by a copy into those views,
attention through ``scaled_dot_product_attention``, the norms through ``F.rms_norm`` (or the op's own formula
outside float32) and every layer op by op. A backend's subclass may store the keys in another layout
(:class:`KVCache`'s ``key_store``), declare what its ops serve better (``step_attention``, ``own_norm``) and run a
step's layers and head through its ``decode_layer`` op (:meth:`DecodeKernel.bind`, :meth:`DecodeKernel.head`);
the CPU's is backends/cpu/decode_kernel.py.

The decoder calls, per generate call: :meth:`allocate` once; :meth:`write` for each layer of each forward (prefill
and steps); :meth:`select_rows` when rows are repeated (``n`` samples) or dropped (finished); :meth:`bind` and
:meth:`head` once, with the call's ``decode_layer`` op. Every step's new keys and values are the decoder's own
arithmetic: a kernel changes where they are stored and which op computes a step, each op within its own contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch


@dataclass
class KVCache:
    """One generate call's cache. ``keys`` and ``values``: ``(layers, rows, kv_heads, slots, head_dim)`` views that
    the decoder reads (``keys[layer, :, :, :end]``); ``key_store``: the keys as the ``decode_layer`` op takes them,
    ``(layers, rows, kv_heads, head_dim, slots or more)`` (portrl/ops/decode_layer.py), the same memory."""

    keys: torch.Tensor
    values: torch.Tensor
    key_store: torch.Tensor


class DecodeKernel:
    """The plain-torch decode kernel, and the contract of a backend's own (module docstring)."""

    #: one-token steps attend through the backend's ``decode_attention`` op (a boolean mask of the keys each row
    #: may not see) instead of ``scaled_dot_product_attention``
    step_attention: ClassVar[bool] = False
    #: the decoder's RMSNorms run the backend's ``rms_norm`` op where it has one of its own, instead of ``F.rms_norm``
    own_norm: ClassVar[bool] = False

    def allocate(self, layers: int, rows: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        """A zeroed cache for ``rows`` sequences of up to ``slots`` tokens; the default stores the keys as read."""
        keys = torch.zeros(layers, rows, kv_heads, slots, head_dim, dtype=dtype, device=device)
        values = torch.zeros(layers, rows, kv_heads, slots, head_dim, dtype=dtype, device=device)
        return KVCache(keys, values, keys.transpose(-1, -2))

    def select_rows(self, cache: KVCache, index: torch.Tensor) -> KVCache:
        """The cache of rows ``index`` only (repeated for ``n`` samples, or finished rows dropped), its layout kept."""
        keys = cache.keys.index_select(1, index)
        return KVCache(keys, cache.values.index_select(1, index), keys.transpose(-1, -2))

    def write(self, cache: KVCache, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``layer``'s new ``keys`` and ``values`` (rows, kv_heads, tokens, head_dim) at slots ``start`` on."""
        end = start + keys.shape[2]
        cache.keys[layer, :, :, start:end] = keys
        cache.values[layer, :, :, start:end] = values

    def bind(self, op: Optional[Callable], layers: Sequence[Sequence], scale: float, heads: int, kv_heads: int,
             rows: int, cache: KVCache) -> list[Callable]:
        """Each layer's one-token step through ``op`` (the chosen ``decode_layer`` implementation; None where it is
        the native one), bound to its weights (``layers``: per layer, the op's weight arguments and the two eps,
        portrl.ops.decode_layer.bind_layer's), for steps of up to ``rows`` rows on ``cache``; ``[]``: the decoder
        runs each layer op by op (the default)."""
        return []

    def head(self, op: Optional[Callable], norm_w: torch.Tensor, eps: float, head_w: torch.Tensor,
             head_b: Optional[torch.Tensor], rows: int, cache: KVCache) -> Optional[Callable]:
        """A step's last norm and head through ``op``'s (portrl.ops.decode_layer.bind_head's contract), where
        :meth:`bind` binds the layers; None: the decoder runs its own norm and head (the default)."""
        return None
