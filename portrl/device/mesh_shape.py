"""The shape of a trained model's device mesh, as plain numbers (no torch): which sizes are valid, checked
before any process group exists.

A mesh has four dimensions, outermost first: ``("dp_replicate", "dp_shard", "sp", "tp")`` (:data:`MESH_DIMS`).
Rank ``r`` of ``world`` sits at the row-major position of ``r`` in that shape, so ``tp`` is innermost: a tensor
parallel group is neighbouring ranks (on one node, over its fastest link), then the sequence-parallel group, then
the data-parallel groups.

* ``tp``: tensor parallelism; every weight matrix is split over these ranks (``actor.tensor_parallel_size``);
* ``sp``: Ulysses sequence parallelism; the ranks hold different pieces of the same rows and exchange attention
  heads with an all-to-all (``actor.sequence_parallel_size``);
* ``dp_shard``: data-parallel ranks that also shard the model state (FSDP2);
* ``dp_replicate``: groups that hold whole copies of one shard layout (HSDP); 1 unless ``actor.fsdp_size`` limits
  the shard group.

The model state (parameters, gradients, optimizer) is sharded over ``dp_shard x sp`` together (:attr:`fsdp`), as
verl's Ulysses path and torchtitan do, so sequence parallelism never copies it; the rows of a batch are split over
``dp_replicate x dp_shard`` (:attr:`dp`).

:func:`mesh_problems` says whether a model's dimensions split over a shape: tensor parallelism divides the
attention heads, the key/value heads, the MLP width and the vocabulary; Ulysses divides each tensor-parallel
rank's heads, and its key/value heads or repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from portrl.errors import UserError

MESH_DIMS = ("dp_replicate", "dp_shard", "sp", "tp")


class MeshError(UserError, ValueError):
    """Sizes that cannot form a mesh of the world; the message names the key, the value and the valid sizes."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the mesh's dimensions, in :data:`MESH_DIMS` order; build one with :meth:`of`."""

    dp_replicate: int
    dp_shard: int
    sp: int
    tp: int

    @property
    def world(self) -> int:
        """All ranks: ``dp_replicate * dp_shard * sp * tp``."""
        return self.dp_replicate * self.dp_shard * self.sp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel size, ``dp_replicate * dp_shard``: ranks that see different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """``dp_shard * sp``: the ranks one parameter is sharded over."""
        return self.dp_shard * self.sp

    @property
    def rows_per_rank(self) -> bool:
        """Whether every parameter is cut in rows over all ranks on one dimension (FSDP2 over several ranks, no
        tensor parallelism, no replicated shard groups): then each rank can write and read its own shard files
        (portrl.state_files.save_shard's 1-D ``Shard(dim)`` layout); under other meshes the state is gathered."""
        return self.world > 1 and self.tp == 1 and self.dp_replicate == 1

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The sizes in :data:`MESH_DIMS` order (the shape to build a device mesh with)."""
        return self.dp_replicate, self.dp_shard, self.sp, self.tp

    @classmethod
    def of(cls, world: int, tp: int = 1, sp: int = 1, fsdp_size: int = -1, *, role: str = "actor") -> MeshShape:
        """The shape of ``world`` ranks split into tensor-parallel groups of ``tp`` and sequence-parallel groups of
        ``sp``, the model state sharded over groups of ``fsdp_size`` ranks (-1: all ``world // tp`` data x sequence
        ranks, no replication; else a multiple of ``sp`` dividing ``world // tp``, the shard groups replicated
        ``world // tp // fsdp_size`` times, as verl's ``fsdp_config.fsdp_size``). ``role`` prefixes the keys the
        messages name (``critic``, ``reward_model.model``). Raises :class:`MeshError` (a ValueError) in one line."""
        keys = {"tp": f"{role}.tensor_parallel_size", "sp": f"{role}.sequence_parallel_size",
                "fsdp": f"{role}.fsdp_size"}
        if world < 1:
            raise MeshError(f"trainer.num_workers={world} must be >= 1 (the ranks of a mesh)")
        for name, value in (("tp", tp), ("sp", sp)):
            if value < 1:
                raise MeshError(f"{keys[name]}={value} must be >= 1; valid with trainer.num_workers={world}: "
                                f"{_listed(divisors(world))}")
        if world % (tp * sp):  # the one size set above 1 alone, else both and their product
            sizes = _listed(divisors(world))
            if tp > 1 and sp > 1:
                raise MeshError(f"{keys['tp']}={tp} times {keys['sp']}={sp} is {tp * sp} ranks, which does not divide "
                                f"trainer.num_workers={world}; valid products: {sizes}")
            key, value = (keys["tp"], tp) if sp == 1 else (keys["sp"], sp)
            raise MeshError(f"{key}={value} does not divide trainer.num_workers={world}; valid: {sizes}")
        ranks = world // tp  # the data x sequence ranks of one tensor-parallel position
        if fsdp_size == -1:
            fsdp_size = ranks
        elif fsdp_size < 1 or ranks % fsdp_size or fsdp_size % sp:
            valid = [d for d in divisors(ranks) if d % sp == 0]
            raise MeshError(f"{keys['fsdp']}={fsdp_size} must divide the {ranks} data x sequence ranks "
                            f"(trainer.num_workers={world} / {keys['tp']}={tp}) and hold whole sequence-parallel "
                            f"groups ({keys['sp']}={sp}); valid: -1 (all {ranks}), {_listed(valid)}")
        return cls(dp_replicate=ranks // fsdp_size, dp_shard=fsdp_size // sp, sp=sp, tp=tp)


def mesh_problems(shape: MeshShape, *, num_heads: int, num_kv_heads: int, vocab_size: int, intermediate_size: int,
                  role: str = "actor") -> list[str]:
    """What keeps a model of these dimensions from splitting over ``shape``, one line each (empty: it splits).

    ``tp`` divides the attention heads, the key/value heads, the MLP width and the vocabulary; ``sp`` divides the
    heads of one tensor-parallel rank (Ulysses gives each sequence-parallel rank whole heads), and its key/value
    heads ``kv = num_kv_heads // tp`` either split too (``sp <= kv``: ``kv % sp == 0``) or are repeated
    (``sp > kv``: ``sp % kv == 0``). Each line names the key, the dimension and the valid sizes."""
    out: list[str] = []
    tp_key, sp_key = f"{role}.tensor_parallel_size", f"{role}.sequence_parallel_size"
    dims = (("{} attention heads", num_heads), ("{} key/value heads", num_kv_heads),
            ("MLP width of {} (intermediate_size)", intermediate_size), ("vocabulary of {} tokens", vocab_size))
    common = divisors(gcd(*(n for _, n in dims)))
    for what, n in dims:
        if n % shape.tp:
            shown = [d for d in divisors(n) if d <= num_heads]  # no larger size splits the heads
            upto = f" (sizes up to the {num_heads} attention heads)" if shown != divisors(n) else ""
            every = "" if common == shown else f"; valid for every split dimension: {_listed(common)}"
            out.append(f"{tp_key}={shape.tp} does not divide the model's {what.format(n)}; valid{upto}: "
                       f"{_listed(shown)}{every}")
    if out or shape.sp == 1:
        return out
    heads, kv = num_heads // shape.tp, num_kv_heads // shape.tp
    valid = [s for s in divisors(heads) if (kv % s == 0 if s <= kv else s % kv == 0)]
    per_rank = f" per tensor-parallel rank ({tp_key}={shape.tp})" if shape.tp > 1 else ""
    if heads % shape.sp:
        out.append(f"{sp_key}={shape.sp} does not divide the model's {heads} attention heads{per_rank}: Ulysses "
                   f"gives each rank whole heads; valid: {_listed(valid)}")
    elif shape.sp not in valid:
        out.append(f"{sp_key}={shape.sp} does not fit the model's {kv} key/value heads{per_rank}: Ulysses splits them "
                   f"(a divisor of {kv}) or repeats them (a multiple of {kv}); valid: {_listed(valid)}")
    return out
