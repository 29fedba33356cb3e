"""Checkpoints reshard: a training state saved under one device mesh loads under any other, bitwise.

The state a trained model checkpoints (portrl.workers.parallel.full_train_state, ``full=True``) is the model's
tensors and AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step``, every DTensor gathered to its full tensor, keyed by
parameter name (``torch.distributed.checkpoint.state_dict``), written with portrl.state_files.save_state. Nothing in
it records the mesh, so a resume may change any of it: the number of ranks, ``tensor_parallel_size``,
``sequence_parallel_size``, ``fsdp_size`` (HSDP), the strategy, or one rank with no process group. Loading
(load_full_train_state) keeps each rank's piece of every full tensor, and gathering, splitting and the file's
float32 bytes are copies, not arithmetic: the state that comes back is the saved one bit for bit
(tests/test_mesh_reshard.py: TP2 x FSDP2 -> FSDP4 -> one rank). Run identity (portrl.trainer.run_identity)
therefore leaves every mesh key out.

Per-rank shard files (portrl.state_files.save_shard, ``TrainedModel.sharded``) are the other layout: each rank
writes its DTensors' local rows, described as torch.chunk rows of one ``Shard(dim)`` over a 1-D mesh of all the
ranks. That holds when the model state is sharded over every rank on one mesh dimension: ``tp == 1`` and
``dp_replicate == 1`` (:func:`rank_shards`; Ulysses alone qualifies: FSDP2 shards over ``dp_shard x sp``
flattened). Under tensor parallelism (2-D ``(dp_shard_sp, tp)`` placements) or HSDP (``(Replicate, Shard)``)
save_shard refuses with a TypeError, so such a mesh must write the gathered full state instead; shards written
under a 1-D mesh load into any mesh, by rank where that mesh shards by rank, else joined whole first (what
portrl.trainer.run_checkpoints does for a group that does not shard).

Each :class:`Phase` builds the tiny model under one mesh in the ranks of :func:`launch` (or in this process,
:func:`run_phase` with no mesh), loads a state, takes GRPO-like steps on portrl.parity.mesh_step's fixed batch,
and writes the full state, its shards, or a Hugging Face export (portrl.models.export, as the actor exports).
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from portrl.device.mesh_shape import MeshShape
from portrl.device.registry import get_backend
from portrl.models import compute_logprobs
from portrl.models.export import export_pretrained
from portrl.models.loader import load_causal_lm
from portrl.parity.mesh_step import LR, RESPONSE, ROWS, step_batch
from portrl.rollout.weights import load_named_tensors
from portrl.state_files import ShardedState, load_state, save_shard, save_state
from portrl.workers.lora import merged_weights
from portrl.workers.mesh import build_mesh
from portrl.workers.parallel import (ForwardModule, clip_grad_norm, find_free_port, full_train_state, init_distributed,
                                     load_full_train_state, shard_wrap, wrap_model)

#: the file stem of a full state in a phase's folder
STATE = "state"
#: what the fork server imports once for every rank: this module and the tiny model's class (imported lazily by
#: from_pretrained, it cost each of 4 ranks ~7 s on 2 busy cores, 29 s of load_causal_lm's wall time, 1.6 s with it)
PRELOAD = [__name__, "transformers.models.qwen2.modeling_qwen2"]


@dataclass(frozen=True)
class Phase:
    """One model's life in the ranks: built under ``shape`` (None: one rank, no process group), then, in order:
    load the full state in folder ``load`` or the shards in folder ``load_shards`` (by rank where
    :func:`rank_shards`, else joined whole), take ``steps`` steps, write the full state to folder ``save``, this
    rank's shards to folder ``shards`` (a refusal's message to ``<shards>.refused`` instead), a Hugging Face export
    to folder ``export``. Folders are paths; rank 0 writes what is whole."""

    shape: Optional[MeshShape]
    load: Optional[str] = None
    load_shards: Optional[str] = None
    steps: int = 0
    save: Optional[str] = None
    shards: Optional[str] = None
    export: Optional[str] = None


def rank_shards(shape: Optional[MeshShape]) -> bool:
    """Whether each rank of ``shape`` can write and read its own shard files (``MeshShape.rows_per_rank``)."""
    return shape is not None and shape.rows_per_rank


def _step(module: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          shape: Optional[MeshShape], dp_rank: int) -> None:
    """One policy-gradient step on the fixed batch: loss ``-sum(logp * (r - mean r)) / tokens`` over this rank's
    rows, scaled by the data-parallel size (FSDP2 averages), clipped at 1.0, AdamW."""
    batch = step_batch()
    dp = 1 if shape is None else shape.dp
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    mask = batch["response_mask"]
    adv = (batch["rewards"] - batch["rewards"].mean())[rows, None]
    logp, _ = module(batch["input_ids"][rows], batch["attention_mask"][rows], RESPONSE)
    loss = -(logp * adv * mask[rows]).sum() * dp / mask.sum()
    loss.backward()
    clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _export(model: torch.nn.Module, model_dir: str, out: str, rank: int) -> None:
    """The actor's export (ActorRolloutWorker.export_hf): full weights gathered by every rank, copied into a plain
    model of the source by rank 0, written with the source's config and tokenizer."""
    weights = list(merged_weights(model))
    if rank == 0:
        plain = load_causal_lm(model_dir, "float32", backend=get_backend("cpu"))
        load_named_tensors(plain, weights)
        export_pretrained(plain, out, source_dir=model_dir)


def _load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str,
                 shape: Optional[MeshShape], rank: int) -> None:
    path = Path(folder)
    shards = ShardedState(path.parent, path.name)
    if rank_shards(shape):
        assert shape is not None  # rank_shards says so
        state = shards.load(rank, shape.world, wrap=shard_wrap(model))
        load_full_train_state(model, optimizer, state["model"], state["optimizer"], full=False)
    else:
        state = shards.load()
        load_full_train_state(model, optimizer, state["model"], state["optimizer"])


def _save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str,
                 shape: Optional[MeshShape], rank: int) -> None:
    model_state, optim_state = full_train_state(model, optimizer, full=False)
    path = Path(folder)
    try:
        save_shard(path.parent, path.name, {"model": model_state, "optimizer": optim_state}, rank,
                   1 if shape is None else shape.world)
    except TypeError as exc:  # a placement the shard files cannot describe
        if rank == 0:
            Path(f"{folder}.refused").write_text(str(exc))


def run_phase(phase: Phase, model_dir: str, rank: int = 0) -> torch.nn.Module:
    """Run ``phase`` on this rank (every rank of ``phase.shape`` calls it; the default process group holds them);
    returns the trained model (its parameters DTensors under a mesh)."""
    torch.manual_seed(0)
    backend = get_backend("cpu")
    model = load_causal_lm(model_dir, "float32", backend=backend)
    module: torch.nn.Module = ForwardModule(model, compute_logprobs)
    dp_rank = 0
    if phase.shape is not None:
        pm = build_mesh("cpu", phase.shape, rank)
        dp_rank = pm.dp_rank
        module = wrap_model(module, "fsdp", backend, device=torch.device("cpu"), mesh=pm)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    if phase.load is not None:
        state = load_state(phase.load, STATE)
        load_full_train_state(model, optimizer, state["model"], state["optimizer"])
    if phase.load_shards is not None:
        _load_shards(model, optimizer, phase.load_shards, phase.shape, rank)
    for _ in range(phase.steps):
        _step(module, model, optimizer, phase.shape, dp_rank)
    if phase.save is not None:
        model_state, optim_state = full_train_state(model, optimizer)
        if rank == 0:
            Path(phase.save).mkdir(parents=True, exist_ok=True)
            save_state(phase.save, STATE, {"model": model_state, "optimizer": optim_state})
    if phase.shards is not None:
        _save_shards(model, optimizer, phase.shards, phase.shape, rank)
    if phase.export is not None:
        _export(model, model_dir, phase.export, rank)
    if phase.shape is not None:
        dist.barrier()  # what rank 0 wrote is complete before any rank's next phase reads it
    return model


def rank_main(rank: int, world: int, phases: Sequence[Phase], model_dir: str, port: int, out_dir: str) -> None:
    """One rank of :func:`launch` (a spawned process): join the gloo group, run ``phases`` in order; an error is
    written to ``<out_dir>/rank<r>.error`` for the parent to raise."""
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # see mesh_step.rank_main
    try:
        init_distributed(get_backend("cpu"), rank, world, "127.0.0.1", port, timeout_s=300)
        for phase in phases:
            run_phase(phase, model_dir, rank)
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reads it: a child's traceback would otherwise be lost
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        raise


def launch(world: int, phases: Sequence[Phase], model_dir: str, out_dir: str) -> None:
    """Run ``phases`` in ``world`` rank processes over gloo (each phase's shape has ``world`` ranks), started as
    ``portrl parity mesh`` starts its ranks (a fork server that imported :data:`PRELOAD` once). A rank's error is
    a RuntimeError with its message."""
    if any(p.shape is None or p.shape.world != world for p in phases):
        raise ValueError(f"every phase of a launch needs a mesh of its {world} ranks")
    ctx = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if ctx == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    try:
        torch_mp.start_processes(rank_main, args=(world, tuple(phases), model_dir, find_free_port(), out_dir),
                                 nprocs=world, start_method=ctx)
    except torch_mp.ProcessRaisedException:
        pass  # the rank's own message is in its .error file
    errors = sorted(Path(out_dir).glob("rank*.error"))
    if errors:
        raise RuntimeError(f"{errors[0].stem}: {errors[0].read_text()}")


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, Mapping):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(state, (list, tuple)):
        return _flat(dict(enumerate(state)), prefix)
    return {prefix: state}


def bitwise_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The dotted paths where nested states ``a`` and ``b`` differ: a path only one has, another dtype or shape,
    one bit of a tensor's bytes, or another plain value (empty: the same state, bit for bit)."""
    fa, fb = _flat(a), _flat(b)
    out = sorted(set(fa) ^ set(fb))
    for key in sorted(set(fa) & set(fb)):
        x, y = fa[key], fb[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = (x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        else:
            same = type(x) is type(y) and x == y
        if not same:
            out.append(key)
    return out
