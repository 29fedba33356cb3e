"""One device mesh for a trained model: data, sequence and tensor parallelism together (torch's DeviceMesh).

The mesh's dimensions are ``("dp_replicate", "dp_shard", "sp", "tp")`` (portrl.device.mesh_shape.MeshShape),
built with ``init_device_mesh`` over the default process group, which the worker joined with the backend's
collective (``Backend.dist_backend``: gloo, or the accelerator's own). A model is parallelized in torchtitan's
order:

1. tensor parallel over ``mesh["tp"]`` (portrl.models.tensor_parallel.apply_tensor_parallel);
2. the decoder told its sequence-parallel group, ``mesh["sp"]`` (portrl.models.sequence_parallel: Ulysses inside
   attention; the log-prob path slices the packed row);
3. FSDP2 (``fully_shard``: every transformer block, then the root) over ``dp_shard x sp`` flattened into one
   dimension, so sequence parallelism never copies the model state; with ``dp_replicate > 1`` (``fsdp_size``
   smaller than the data x sequence ranks) over the 2-D ``(dp_replicate, dp_shard_sp)`` mesh (HSDP: sharded
   within a group, replicated across groups).

Gradients: FSDP2 averages over the ``dp_replicate x dp_shard x sp`` ranks. The ``sp`` ranks of a group hold the
same rows and compute the same loss; the backward of the sequence gather sums their gradients (``sp`` times each
rank's share), which that average divides out. The ``tp`` ranks are not averaged: DTensor reduces each
parameter's gradient over them as the plan needs. So a loss normalised over the data-parallel ranks
(``MeshShape.dp``, portrl.workers.training.global_counts) gives one rank's update.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from portrl.device.mesh_shape import MESH_DIMS, MeshShape
from portrl.models.sequence_parallel import SEQUENCE_GROUP_ATTR
from portrl.models.tensor_parallel import apply_tensor_parallel


@dataclass(frozen=True)
class ParallelMesh:
    """A built mesh: the root ``mesh`` and the sub-meshes a model is parallelized over."""

    shape: MeshShape
    mesh: DeviceMesh
    fsdp: DeviceMesh  # 1-D (dp_shard x sp), or 2-D (dp_replicate, dp_shard x sp) for HSDP
    tp: Optional[DeviceMesh]  # None when tp == 1
    sp_group: Optional[Any]  # the sequence-parallel process group; None when sp == 1
    dp_group: Any  # the data-parallel process group: one rank per piece of rows (its sp and tp coordinates)
    rank: int

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (which rows it gets), ``0 <= dp_rank < shape.dp``."""
        return self.rank // (self.shape.sp * self.shape.tp)


def needs_mesh(world: int, sizes: tuple[int, int, int]) -> bool:
    """Whether ``(tensor_parallel_size, sequence_parallel_size, fsdp_size)`` over ``world`` ranks need a mesh
    beyond plain FSDP2 / DDP over all of them."""
    tp, sp, fsdp_size = sizes
    return world > 1 and (tp > 1 or sp > 1 or fsdp_size not in (-1, world))


def build_mesh(device_type: str, shape: MeshShape, rank: int) -> ParallelMesh:
    """The mesh of ``shape`` over the default process group (``shape.world`` ranks; every rank calls it, in the
    same order as its other group creations)."""
    # DTensor warns at every gradient norm of a 2-D (data x tensor) parameter that two all-reduces run where a
    # flattened mesh would take one: right, and every rank runs them in the same order, so its norm is the same
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh(device_type, shape.sizes, mesh_dim_names=MESH_DIMS)
    shard = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    if shape.dp_replicate > 1:
        with warnings.catch_warnings():  # torch's note that slicing a flattened dim will need bookkeeping
            warnings.simplefilter("ignore", UserWarning)
            shard = mesh["dp_replicate", "dp_shard_sp"]
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return ParallelMesh(shape, mesh, shard, mesh["tp"] if shape.tp > 1 else None,
                        mesh["sp"].get_group() if shape.sp > 1 else None, dp.get_group(), rank)


def _decoders(model: nn.Module) -> list[nn.Module]:
    """The text decoders in ``model`` (modules with ``embed_tokens`` and ``layers``: what the log-prob and value
    paths run as ``base``)."""
    return [m for m in model.modules() if hasattr(m, "embed_tokens") and hasattr(m, "layers")]


def parallelize(model: nn.Module, pm: ParallelMesh, blocks: set, mp_policy: Any = None) -> nn.Module:
    """``model`` (a causal LM, its peft wrapper, ``ForwardModule`` over one, or the critic's value model)
    parallelized in place over ``pm`` (see the module docstring); ``blocks``: the transformer block classes FSDP2
    shards one by one; ``mp_policy``: FSDP2's MixedPrecisionPolicy or None."""
    if pm.tp is not None:
        apply_tensor_parallel(model, pm.tp)
    if pm.sp_group is not None:
        for decoder in _decoders(model):
            setattr(decoder, SEQUENCE_GROUP_ATTR, pm.sp_group)
    return shard_blocks(model, blocks, pm.fsdp, mp_policy)


def shard_blocks(model: nn.Module, blocks: set, fsdp_mesh: DeviceMesh, mp_policy: Any = None) -> nn.Module:
    """FSDP2 (``fully_shard``) over ``fsdp_mesh``: every module of a class in ``blocks``, then the root; in place."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415  (FSDP: only in a sharded run)

    kwargs: dict[str, Any] = {"mesh": fsdp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for m in model.modules():
        if type(m) in blocks:
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def grad_norm_groups(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` grouped by where they live (device mesh and placements; plain tensors together), in first-seen
    order: each group's norm is one reduction (a tensor-parallel model mixes 2-D and 1-D sharded gradients)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        mesh = getattr(g, "device_mesh", None)
        key = None if mesh is None else (id(mesh), tuple(getattr(g, "placements", ())))
        groups.setdefault(key, []).append(g)
    return list(groups.values())
