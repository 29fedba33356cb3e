"""What an RL run writes into a checkpoint and reads back: :func:`save_run_checkpoint`, :func:`load_run_checkpoint`.

One checkpoint (``<output_dir>/checkpoints/global_step_<step>/``, written atomically and verified by
:class:`portrl.trainer.checkpoint.CheckpointManager`, files in the format of ``portrl/trainer/checkpoint_io.py``):

* ``actor``: rank 0's full state (model, optimizer, LR schedule, RNG, update count), never a metrics reduction
  over ranks; under FSDP2 over several ranks, every rank's own shard instead (``actor/rank_<r>.*``, written by
  that rank with nothing gathered, so a model larger than one worker's memory can be saved; the output
  directory must then be on a filesystem every worker sees), which loads back into any number of ranks;
* ``critic``: the same for the critic, when the run has one;
* ``prm``: PRIME's implicit process reward model (model, optimizer, LR schedule; its reference when it holds the
  warm-started policy), when the run has one (``portrl/trainer/prime_phase.py``); sharded like the actor's under
  FSDP2 over several ranks (``prm/rank_<r>.*``, each with the reference whole when there is one);
* ``trainer``: the step, the data position, the driver's RNG and the adaptive KL coefficient.

The frozen reference policy is not copied into every checkpoint: it is written once per run to
``checkpoints/reference`` (after an SFT warm start it is the post-SFT policy, which nothing else holds) and each
checkpoint's manifest pins it by sha256 (:class:`ReferenceCopy`). Loading a checkpoint for training checks that
copy; a damaged or missing one is rebuilt from the policy the run starts from (the model at ``model.path``, frozen
as a fresh start freezes it) and used only when its files match the pin
(:func:`portrl.trainer.reference_repair.restore_reference`); a reference after an SFT warm start cannot be
rebuilt so, and the error says which file to restore. A reference that moves (SPIN,
``trainer.ref_update_freq > 0``) is written into each checkpoint instead (``ref``, meta ``reference_in_checkpoint``),
verified with the checkpoint's other files, so a resume restores the reference of that very step. A run's manifest
also records the format, portrl's version and the run identity (``portrl/trainer/run_identity.py``), checked before
anything loads.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Protocol, Tuple

import torch

from portrl.trainer.checkpoint import MANIFEST, REFERENCE, CheckpointManager, UnusableCheckpoint, open_checkpoint, \
    reference_pin, sha256_file, unusable
from portrl.trainer.checkpoint_io import ShardedState, StateFormatError, is_sharded, load_state, save_state
from portrl.trainer.reference_repair import restore_reference
from portrl.trainer.run_identity import MODEL_KEYS, fingerprint, run_identity
from portrl.workers.actor import ActorRolloutWorker
from portrl.workers.trained_model import TrainedModelWorker
from portrl.workers.training import rng_state, set_rng_state

if TYPE_CHECKING:  # annotations only
    from portrl.config.schema import PortRLConfig
    from portrl.workers.critic import CriticWorker
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)

#: ``meta`` key of a checkpoint that holds its own reference policy (``ref``): written with
#: ``trainer.ref_update_freq > 0``, where the reference changes during the run (portrl/trainer/reference_update.py)
OWN_REFERENCE = "reference_in_checkpoint"


class ReferenceCopy:
    """The run's reference policy in ``<root>/reference``: written at the run's first checkpoint (or again when
    that copy is gone or changed), then pinned by every later checkpoint."""

    def __init__(self) -> None:
        self.root: Optional[Path] = None
        self.meta: Optional[Dict[str, str]] = None  # the checkpoints' ``meta.reference``

    def remember(self, root: Path, meta: Dict[str, str]) -> None:
        """A reference copy known to be in ``root`` (written, or found by a resume in place)."""
        self.root, self.meta = root, meta

    def pinned(self, ckpt: CheckpointManager, ref: Dict[str, Any]) -> Dict[str, str]:
        """``meta.reference`` for the next checkpoint under ``ckpt``, writing ``ref`` only when needed."""
        manifest = ckpt.root / REFERENCE / MANIFEST
        if self.meta is not None and self.root == ckpt.root and manifest.is_file() \
                and sha256_file(manifest) == self.meta["manifest_sha256"]:
            return self.meta
        meta = ckpt.save_reference(lambda path: save_state(path, "ref", ref))
        self.remember(ckpt.root, meta)
        return meta


class CheckpointedRun(Protocol):
    """What a run's checkpoint is written from and read into (an :class:`portrl.trainer.rl_trainer.RLTrainer` is
    one): the config, the step, the trained worker groups (None where the run has no such role; ``prm``: PRIME's
    phase, with its worker ``group`` and ``loaded_from_checkpoint()``), whether it has a reference and its :class:`ReferenceCopy`,
    the checkpoint manager (absent before ``fit``: a policy-only load reads it with getattr), the training data
    (``load_state_dict``; ``data_position()`` is what a checkpoint keeps: before the requests still in flight in the
    asynchronous modes) and ``restart_data()`` after it is restored, the adaptive KL controller or None."""

    cfg: PortRLConfig
    global_step: int
    actor: WorkerGroup[ActorRolloutWorker]
    critic: Optional[WorkerGroup[CriticWorker]]
    prm: Optional[Any]
    use_ref: bool
    reference_copy: ReferenceCopy
    ckpt: CheckpointManager
    train_ds: Any
    kl_ctrl: Optional[Any]

    def restart_data(self) -> None: ...

    def data_position(self) -> Dict[str, Any]: ...


def save_run_checkpoint(trainer: CheckpointedRun) -> Path:
    """A checkpoint of ``trainer`` at its current step."""
    ident = run_identity(trainer.cfg)
    meta: Dict[str, Any] = {"step": trainer.global_step, "identity": ident, "fingerprint": fingerprint(ident)}
    groups = [(name, group) for name, group in (("actor", trainer.actor), ("critic", trainer.critic),
                                                ("prm", _prm_group(trainer))) if group is not None]
    # FSDP2 over several ranks: every rank writes its own shard in write(); otherwise rank 0's gathered state
    states = {name: None if group.rank0(TrainedModelWorker.sharded_checkpoint) else
              group.rank0(TrainedModelWorker.state_dict) for name, group in groups}
    actor = states["actor"]
    ref = trainer.actor.rank0(ActorRolloutWorker.reference_state) if actor is None else actor.pop("ref", None)
    own_ref = ref is not None and int(trainer.cfg.trainer.ref_update_freq) > 0  # SPIN: the reference moves
    if own_ref:
        meta[OWN_REFERENCE] = True
    elif ref is not None:
        meta["reference"] = trainer.reference_copy.pinned(trainer.ckpt, ref)
    state = {"step": trainer.global_step, "data": trainer.data_position(), "rng": rng_state(),
             "kl_coef": None if trainer.kl_ctrl is None else float(trainer.kl_ctrl.value)}

    def write(path: Path) -> None:
        for name, group in groups:
            group_state = states[name]
            if group_state is None:
                group.run(TrainedModelWorker.save_shard, str(path.resolve()), name)  # <path>/<name>/rank_<r>.*
            else:
                save_state(path, name, group_state)
        save_state(path, "trainer", state)
        if own_ref and ref is not None:  # own_ref says it is
            save_state(path, "ref", ref)

    return trainer.ckpt.save(trainer.global_step, write, meta)


def _prm_group(trainer: CheckpointedRun) -> Optional[WorkerGroup[TrainedModelWorker]]:
    """The workers of PRIME's implicit PRM (portrl/trainer/prime_phase.py), None when the run has none."""
    return None if trainer.prm is None else trainer.prm.group


def _worker_state(path: Path, name: str, group: WorkerGroup[TrainedModelWorker]) -> Tuple[Dict[str, Any], bool]:
    """``(state, by_rank)`` of worker state ``name`` in checkpoint ``path`` for ``group``: the whole state (one
    file pair, or shards joined for a group that does not shard), or, for a sharded group and shards
    (``by_rank``), its JSON part alone: every rank then reads its own rows (``load_shard``), from a checkpoint
    of any number of ranks (a reference the shards hold included, so the JSON part leaves it out). Raises
    StateFormatError."""
    if not is_sharded(path, name):
        return load_state(path, name), False
    shards = ShardedState(path, name)  # checks that the shards are one complete set
    if group.rank0(TrainedModelWorker.sharded_checkpoint):
        state = shards.load(tensors=False)
        state.pop("ref", None)
        return state, True
    return shards.load(), False


def _restore_reference(trainer: CheckpointedRun, path: Path, manifest: Dict[str, Any]) -> None:
    """The run's reference copy that checkpoint ``path`` pins, made intact before it loads: checked, or (damaged,
    missing) rebuilt as a fresh start of ``trainer`` freezes it, from the actor's starting policy (call it before
    the checkpoint loads into the actor), and checked against the pin. Raises CheckpointError."""
    pin, problem = reference_pin(manifest)
    if problem is not None:
        raise unusable(path, problem)
    if pin is None:
        return

    def write(folder: Path) -> None:
        ref = trainer.actor.rank0(ActorRolloutWorker.reference_state)  # held by a trainer that ran fit() before
        if ref is None:
            trainer.actor.run(ActorRolloutWorker.init_reference)  # what fit() freezes on a fresh start (no warm start)
            ref = trainer.actor.rank0(ActorRolloutWorker.reference_state)
        assert ref is not None  # init_reference froze one
        save_state(folder, "ref", ref)  # as save_run_checkpoint writes it

    sft = bool(getattr(trainer.cfg.model, "sft_warm_start", False))
    restore_reference(path.parent, pin, write, f"model.path={trainer.cfg.model.path}",
                      " (with model.sft_warm_start the reference is the policy after the warm start, which "
                      "model.path does not hold)" if sft else "")


def load_run_checkpoint(trainer: CheckpointedRun, path: Path, policy_only: bool = False) -> None:
    """Load checkpoint ``path`` into ``trainer`` after verifying it (manifest sizes and sha256, format version,
    the model it was trained from; the run's reference when this run uses one, rebuilt when damaged or missing:
    :func:`_restore_reference`); nothing is unpickled. A learning rate changed since the checkpoint is applied
    and logged. ``policy_only`` (``portrl eval``): the actor and the step only, not the critic, data position,
    RNG, KL controller or reference of the training run."""
    path = Path(path)
    use_ref = trainer.use_ref and not policy_only
    manifest = open_checkpoint(path, run_identity(trainer.cfg), only=MODEL_KEYS)
    if use_ref:
        _restore_reference(trainer, path, manifest)
    ref_meta = manifest["meta"].get("reference")
    prm_group = _prm_group(trainer)
    try:
        actor, actor_by_rank = _worker_state(path, "actor", trainer.actor)
        critic, critic_by_rank = _worker_state(path, "critic", trainer.critic) \
            if trainer.critic is not None and not policy_only else (None, False)
        prm, prm_by_rank = _worker_state(path, "prm", prm_group) \
            if prm_group is not None and not policy_only else (None, False)
        state = None if policy_only else load_state(path, "trainer")
        if use_ref and ref_meta is not None:  # the run's reference, written once (save_run_checkpoint)
            actor["ref"] = load_state(path.parent / ref_meta["dir"], "ref")
        elif use_ref and manifest["meta"].get(OWN_REFERENCE):  # the reference of this very step
            actor["ref"] = load_state(path, "ref")
    except StateFormatError as exc:
        raise unusable(path, str(exc)) from None
    if policy_only:
        actor.pop("ref", None)
    ckpt = getattr(trainer, "ckpt", None)
    if ref_meta is not None and ckpt is not None and path.parent.resolve() == ckpt.root.resolve():
        trainer.reference_copy.remember(ckpt.root, ref_meta)  # resumed in place: no need to write it again
    groups: Tuple[Tuple[str, Optional[WorkerGroup[TrainedModelWorker]], Optional[Dict[str, Any]], bool, str], ...] = (
        ("actor", trainer.actor, actor, actor_by_rank, "actor.optim.lr"),
        ("critic", trainer.critic, critic, critic_by_rank, "critic.optim.lr"),
        ("prm", prm_group, prm, prm_by_rank, "reward_model.model.optim.lr"))
    for name, group, worker_state, by_rank, key in groups:
        if worker_state is None:
            continue
        assert group is not None  # a state was read above only for a group the run has
        # the model restores itself: a learning rate changed since the checkpoint rescales its schedule (the note)
        with _fitting(path, f"its {name} state"):
            if by_rank:  # each rank reads its own rows; the driver's part: the reference
                extra = {"ref": worker_state["ref"]} if "ref" in worker_state else {}
                note = group.rank0(TrainedModelWorker.load_shard, str(path.resolve()), name, extra)  # a Ray cwd differs
            else:
                note = group.rank0(TrainedModelWorker.load_state_dict, worker_state)
        if note and not policy_only:
            log.warning("%s %s", key, note)
    if prm is not None:
        assert trainer.prm is not None  # its state was read above for its group
        trainer.prm.loaded_from_checkpoint()
    trainer.global_step = int(manifest["step"])
    if state is None:
        return
    with _fitting(path, "trainer.json"):
        try:
            trainer.train_ds.load_state_dict(state["data"])
        except ValueError as exc:  # the same data keys (run identity), but the files' contents changed
            raise unusable(path, f"{exc}; the training data changed since it was written: restore them, or start "
                                 f"a fresh run (a new trainer.output_dir)") from None
        trainer.restart_data()
        set_rng_state(state["rng"])
        if trainer.kl_ctrl is not None and state.get("kl_coef") is not None:
            trainer.kl_ctrl.value = float(state["kl_coef"])


@contextmanager
def _fitting(path: Path, what: str) -> Iterator[None]:
    """Loading ``what`` of checkpoint ``path`` into the run: an error of a value the checkpoint holds that does not
    fit (a tensor of another shape, a state without a key, a shard that does not decode, in this process or a
    worker's) is raised as UnusableCheckpoint naming ``what``; running out of memory is not the checkpoint's doing
    and passes through."""
    try:
        yield
    except torch.OutOfMemoryError:  # any device's (the vendors' own classes are this one)
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise unusable(path, f"{what} does not fit this run ({detail if len(detail) <= 300 else detail[:297] + '...'})"
                       ) from exc


def resume_run(trainer: CheckpointedRun, path: Path) -> Path:
    """Load checkpoint ``path``, the one ``trainer.resume`` chose (:meth:`CheckpointManager.resolve_resume`), into
    ``trainer`` and return the checkpoint loaded. With ``trainer.resume=auto``, a checkpoint whose files do not load
    (:class:`UnusableCheckpoint`, its sha256 matching or not) is skipped with a warning naming it and why, and the
    previous intact one is loaded instead (every state is loaded again, over what the skipped one left), as a
    checkpoint that fails its manifest is skipped; when none is left, the error lists each with its problem. A
    checkpoint named by its path (``trainer.resume=PATH``) is never replaced: its UnusableCheckpoint is raised."""
    skipped: Dict[Path, str] = {}
    while True:
        try:
            load_run_checkpoint(trainer, path)
            return path
        except UnusableCheckpoint as exc:
            if str(trainer.cfg.trainer.resume) != "auto":
                raise
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, exc.problem)
            skipped[path] = exc.problem
            previous = trainer.ckpt.resolve_auto(run_identity(trainer.cfg), skip=skipped)
            if previous is None:  # the checkpoints are gone meanwhile
                raise
            path = previous
