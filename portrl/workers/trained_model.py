"""One trained model of a worker: the policy (actor), the value model (critic) and PRIME's implicit PRM alike.

:class:`TrainedModel` holds what training one model needs, built once in one order for all three:

* the module and its float32 masters (:class:`~portrl.workers.master_weights.MasterWeights`: bf16 / fp16 compute
  casts the float32 module before DDP buckets its gradients; FSDP2 keeps float32 shards, which its mixed precision
  policy casts for compute, so the masters are taken after the wrap there);
* the device mesh when the model's section asks for sequence or tensor parallelism or a smaller shard group
  (``mesh_sizes``: portrl.workers.mesh; ``dp_size`` is then the data-parallel part of the world);
* the data-parallel wrap (``train_module``): DDP / FSDP2 over ``ForwardModule(module, forward)`` when the worker's
  computation is a function of the module (the log-probs of the actor and the PRM), else over the module itself
  (the critic's ValueModel, whose forward is the whole value computation); the plain module on one worker;
* AdamW and the learning-rate schedule from the worker's ``optim`` section;
* the parts of that state its section's ``offload`` keeps in host memory between the calls that read them
  (:class:`~portrl.workers.offload.StateOffload`; the worker marks each method with what it reads);
* the shared update loop's settings (:meth:`TrainedModel.loop_settings`) and one update (:meth:`TrainedModel.update`);
* its checkpoint state: ``model``, ``optimizer``, ``scheduler`` (full tensors keyed by name, or, under FSDP2 over
  several ranks, each rank's own shard files ``<dir>/<name>/rank_<r>.*``, portrl.state_files).

:class:`TrainedModelWorker` is the part of a worker built on it: the attributes the rest of portrl reads
(``module``, ``train_module``, ``master``, ``optimizer``, ``scheduler``) and the checkpoint methods every trained
worker answers (``weights_finite``, ``state_dict``, ``load_state_dict``, ``sharded_checkpoint``, ``save_shard``,
``load_shard``); a worker adds its own entries of the state (the actor's RNG and update count, a reference) with
:meth:`TrainedModelWorker.extra_state` and :meth:`TrainedModelWorker.load_extra_state`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from portrl.device.backend import Backend
from portrl.state_files import ShardedState, merge_state, save_shard
from portrl.workers.batch import Batch
from portrl.workers.master_weights import MasterWeights, load_train_state, train_state
from portrl.device.mesh_shape import MeshShape
from portrl.workers.mesh import build_mesh, needs_mesh
from portrl.workers.offload import StateOffload, holding, move_module, move_optimizer_state, move_tensors
from portrl.workers.parallel import ForwardModule, resolve_strategy, shard_wrap, wrap_model
from portrl.workers.profiled import ProfiledWorker
from portrl.workers.training import (build_lr_scheduler, build_optimizer, rescale_lr, set_data_parallel_group,
                                     shares_prompts)
from portrl.workers.update_loop import LoopSettings, LossFn, Trainable, mini_batch_rows, run_update

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def model_strategy(cfg: PortRLConfig, backend: Backend, world_size: int) -> str:
    """The data-parallel strategy of a trained model: ``actor.strategy`` resolved for ``backend``
    (portrl.workers.parallel.resolve_strategy) with several workers, ``none`` with one."""
    return resolve_strategy(str(cfg.actor.strategy), backend) if world_size > 1 else "none"


class TrainedModel:
    """A module under training on one data-parallel rank (see the module docstring).

    ``module``: the model as loaded (float32 when ``dtype`` is bfloat16 / float16, portrl.workers.master_weights
    .load_dtype), on ``device``; ``strategy``: :func:`model_strategy`; ``optim``: the worker's OptimConfig section
    (lr, betas, eps, weight_decay, scheduler, warm-up, grad_clip); ``forward``: wrap ``ForwardModule(module,
    forward)`` instead of the module itself (with several workers); ``offload``: the section's OffloadConfig (None:
    nothing offloaded). ``cfg`` supplies ``trainer.total_steps`` (the
    schedule's length) and the loop settings' sections (actor, rollout, data, model)."""

    def __init__(self, cfg: PortRLConfig, module: torch.nn.Module, *, backend: Backend, device: torch.device, dtype: str,
                 strategy: str, optim: Mapping[str, Any], rank: int = 0, world_size: int = 1,
                 forward: Optional[Callable[..., Any]] = None, mesh_sizes: Tuple[int, int, int] = (1, 1, -1),
                 offload: Optional[Any] = None):
        self.cfg, self.module, self.device, self.dtype = cfg, module, device, dtype
        self.strategy, self.optim, self.rank, self.world_size = strategy, optim, rank, world_size
        self.mesh = build_mesh(device.type, MeshShape.of(world_size, *mesh_sizes), rank) \
            if needs_mesh(world_size, mesh_sizes) else None
        #: ranks that see different rows (the world, unless a mesh has sequence or tensor parallel ranks)
        self.dp_size = world_size if self.mesh is None else self.mesh.shape.dp
        #: this rank's piece of the rows (ranks of one sequence / tensor parallel group share it)
        self.dp_rank = rank if self.mesh is None else self.mesh.dp_rank
        if self.mesh is not None:
            set_data_parallel_group(self.mesh.dp_group)
        if strategy != "fsdp":  # the float32 module is cast to the compute dtype before DDP buckets its gradients
            self.master = MasterWeights(module, dtype)
        self.train_module = module
        if world_size > 1:
            target = module if forward is None else ForwardModule(module, forward)
            self.train_module = wrap_model(target, strategy, backend, device=device, compute_dtype=dtype,
                                           mesh=self.mesh)
        if strategy == "fsdp":  # FSDP2's float32 shards are the masters
            self.master = MasterWeights(module)
        self.optimizer = build_optimizer(self.master.masters, optim)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, int(cfg.trainer.total_steps))
        self.offload_activations = bool(offload is not None and offload.activations)
        self.offload = self._state_offload(offload)

    def _state_offload(self, offload: Optional[Any]) -> StateOffload:
        """The parts of the state ``offload`` (an OffloadConfig) keeps on the host (portrl.workers.offload):
        ``params`` are FSDP2's shards (moved with the wrapped module) or a 16-bit run's separate masters."""
        fsdp = self.strategy == "fsdp" and self.wrapped
        movers: Dict[str, Callable[[torch.device], None]] = {}
        if offload is not None and offload.params:
            separate = [m for m, p in zip(self.master.masters, self.master.params) if m is not p]
            if fsdp:
                movers["params"] = functools.partial(move_module, self.train_module)
            elif separate:
                movers["params"] = lambda device: move_tensors(separate, device)
        if offload is not None and offload.optimizer:
            movers["optimizer"] = lambda device: move_optimizer_state(self.optimizer, device)
        return StateOffload(self.device, movers, module_is_params=fsdp)

    @property
    def wrapped(self) -> bool:
        """Whether forwards run through a data-parallel wrapper (``train_module`` is not ``module``)."""
        return self.train_module is not self.module

    @property
    def sharded(self) -> bool:
        """Whether every rank writes its own shard of the checkpoint state (FSDP2 over several ranks, each parameter
        cut in rows over all of them: no tensor parallelism, no replicated shard groups; under those meshes rank 0
        writes the gathered state)."""
        flat = self.mesh is None or self.mesh.shape.rows_per_rank
        return self.strategy == "fsdp" and self.world_size > 1 and flat

    # ---------------------------------------------------------------------------------- update
    def loop_settings(self, epochs: int, mini_batch_size: int, shuffle_seed: Optional[int] = None) -> LoopSettings:
        """The shared loop's settings: ``epochs``; mini-batches of ``mini_batch_size`` prompts times ``rollout.n``
        shared over the ranks; the actor's micro-batch limits (``ppo_micro_batch_size_per_device``,
        ``max_tokens_per_micro_batch``); ``optim.grad_clip``; rows permuted per epoch with ``shuffle_seed``
        (None: kept in order)."""
        a, cfg = self.cfg.actor, self.cfg
        return LoopSettings(epochs=int(epochs), mini_rows=mini_batch_rows(mini_batch_size, cfg.rollout.n, self.dp_size),
                            micro_rows=int(a.ppo_micro_batch_size_per_device),
                            max_tokens=None if a.max_tokens_per_micro_batch is None else int(a.max_tokens_per_micro_batch),
                            grad_clip=float(self.optim["grad_clip"]), loss_scale_factor=int(cfg.data.max_response_length),
                            world_size=self.dp_size, shuffle_seed=shuffle_seed,
                            shared_prompts=shares_prompts(cfg.model), offload_activations=self.offload_activations)

    def update(self, batch: Batch, settings: LoopSettings, loss_fn: LossFn, **kwargs: Any) -> Dict[str, float]:
        """One update through the shared loop (:func:`portrl.workers.update_loop.run_update`; ``kwargs``: its
        ``prefix``, ``additive``, ``extra_counts``, ``advance_schedule``)."""
        state = Trainable(self.train_module, self.master, self.optimizer, self.scheduler, self.device)
        return run_update(state, batch, settings, loss_fn, **kwargs)

    # ----------------------------------------------------------------------------------- state
    def state(self, sharded: bool = False) -> Dict[str, Any]:
        """``{"model", "optimizer", "scheduler"}``: full tensors keyed by parameter name (a collective under FSDP2:
        every rank calls it), or with ``sharded`` this rank's FSDP2 shards, nothing gathered
        (portrl.workers.master_weights.train_state)."""
        model_sd, optim_sd = train_state(self.module, self.optimizer, self.master, sharded=sharded)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load(self, state: Mapping[str, Any], sharded: bool = False) -> Optional[str]:
        """The inverse of :meth:`state` (the other keys of ``state`` are left alone). A schedule saved with another
        base learning rate than ``optim.lr`` continues from its step with ``optim.lr``: the state's schedule and
        optimizer groups are rescaled first, in place (:func:`~portrl.workers.training.rescale_lr`); returns that
        note (``"changed since the checkpoint (...)"``), None when the rate is the saved one."""
        note = rescale_lr(state, float(self.optim["lr"]))
        load_train_state(self.module, self.optimizer, self.master, state["model"], state["optimizer"], sharded)
        self.scheduler.load_state_dict(state["scheduler"])
        return note

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> Tuple[List[str], List[str]]:
        """Full tensors keyed by the module's names into the module (under FSDP2 each rank keeps its rows), then the
        masters re-taken from the module; names absent from ``weights`` keep their values. Returns ``(missing,
        unexpected)`` names. Under FSDP2 every rank calls it."""
        if self.sharded:
            # not at the top: this module takes ~0.8 s to import and only FSDP2 needs it (portrl.workers.parallel)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: PLC0415  (FSDP: only in a sharded run)

            keys = set_model_state_dict(self.module, dict(weights),
                                        options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            keys = self.module.load_state_dict(dict(weights), strict=False)
        self.master.load_state_dict(self.module.state_dict())
        return list(keys.missing_keys), list(keys.unexpected_keys)

    def read_shard(self, directory: str, name: str, extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """This rank's rows of a state written by :meth:`TrainedModelWorker.save_shard` (by any number of ranks),
        as DTensors of this rank's mesh; ``extra``: entries that replace the saved ones."""
        state = ShardedState(directory, name).load(self.rank, self.world_size, wrap=shard_wrap(self.module))
        return merge_state(state, extra or {})


class TrainedModelWorker(ProfiledWorker):
    """The checkpoint methods and attributes of a worker that trains one :class:`TrainedModel` (``self.trained``).

    State: :meth:`state_dict` is the model's ``model`` / ``optimizer`` / ``scheduler`` plus
    :meth:`extra_state` ``(sharded=False)``; a shard (:meth:`save_shard`) is the same with this rank's shards and
    :meth:`extra_state` ``(sharded=True)``. Loading either gives the whole state to :meth:`load_state_dict`."""

    trained: TrainedModel
    rank: int
    world_size: int

    @property
    def module(self) -> torch.nn.Module:
        return self.trained.module

    @property
    def train_module(self) -> torch.nn.Module:
        return self.trained.train_module

    @property
    def master(self) -> MasterWeights:
        return self.trained.master

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trained.optimizer

    @property
    def scheduler(self) -> Any:
        return self.trained.scheduler

    @property
    def offload(self) -> StateOffload:
        return self.trained.offload

    def extra_state(self, sharded: bool) -> Dict[str, Any]:
        """The worker's own entries of its checkpoint state (none here); ``sharded``: for a rank's shard."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Load the worker's own entries of ``state`` (after the model's); nothing here."""

    @holding("params")
    def weights_finite(self) -> bool:
        """Whether this worker's trained weights (its FSDP2 shards) are all finite: asked of every worker before a
        checkpoint is written (portrl.trainer.divergence)."""
        return self.trained.master.finite()

    def sharded_checkpoint(self) -> bool:
        """Whether every rank writes its own shard of the checkpoint state (FSDP2 over several ranks:
        :meth:`save_shard`) instead of rank 0 writing the gathered :meth:`state_dict`."""
        return self.trained.sharded

    @holding("params", "optimizer")
    def state_dict(self) -> Dict[str, Any]:
        """The model's state and the worker's own entries; full tensors keyed by name, whatever the number of
        workers (a collective under FSDP2: every rank calls it; each gets it all)."""
        return {**self.trained.state(), **self.extra_state(sharded=False)}

    @holding("params", "optimizer")
    def load_state_dict(self, state: Mapping[str, Any], sharded: bool = False) -> Optional[str]:
        """The inverse of :meth:`state_dict` (every rank gets the same full state); ``sharded``: of
        :meth:`load_shard` (this rank's DTensor shards). The model restores itself: a learning rate changed since
        the state was saved rescales its schedule (:meth:`TrainedModel.load`), and the note saying so is
        returned (None when unchanged)."""
        note = self.trained.load(state, sharded)
        self.load_extra_state(state)
        return note

    @holding("params", "optimizer")
    def save_shard(self, directory: str, name: str) -> None:
        """This rank's part of the state, written by this rank with nothing gathered:
        ``<directory>/<name>/rank_<rank>.*`` (portrl.state_files.save_shard). Every rank calls it."""
        state = {**self.trained.state(sharded=True), **self.extra_state(sharded=True)}
        save_shard(directory, name, state, self.rank, self.world_size)

    @holding("params", "optimizer")
    def load_shard(self, directory: str, name: str, extra: Optional[Mapping[str, Any]] = None) -> Optional[str]:
        """Load this rank's rows of a state :meth:`save_shard` wrote (by any number of ranks); ``extra``: entries
        that replace the saved ones (a reference). Every rank calls it. Returns :meth:`load_state_dict`'s note."""
        return self.load_state_dict(self.trained.read_shard(directory, name, extra), sharded=True)
