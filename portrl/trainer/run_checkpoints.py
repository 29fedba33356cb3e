"""What an RL run writes into a checkpoint and reads back: :func:`save_run_checkpoint`, :func:`load_run_checkpoint`.

One checkpoint (``<output_dir>/checkpoints/global_step_<step>/``, written atomically and verified by
:class:`portrl.trainer.checkpoint.CheckpointManager`, files in the format of ``portrl/trainer/checkpoint_io.py``):

* ``actor``: rank 0's full state (model, optimizer, LR schedule, RNG, update count; under FSDP2 every rank joins
  the gather), never a metrics reduction over ranks;
* ``critic``: the same for the critic, when the run has one;
* ``trainer``: the step, the data position, the driver's RNG and the adaptive KL coefficient.

The frozen reference policy is not copied into every checkpoint: it is written once per run to
``checkpoints/reference`` (after an SFT warm start it is the post-SFT policy, which nothing else holds) and each
checkpoint's manifest pins it by sha256 (:class:`ReferenceCopy`). A run's manifest also records the format,
portrl's version and the run identity (``portrl/trainer/run_identity.py``), checked before anything loads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional

from portrl.trainer.checkpoint import MANIFEST, REFERENCE, CheckpointError, CheckpointManager, open_checkpoint, \
    sha256_file
from portrl.trainer.checkpoint_io import StateFormatError, load_state, save_state
from portrl.trainer.run_identity import MODEL_KEYS, apply_lr, fingerprint, run_identity
from portrl.workers.training import rng_state, set_rng_state

log = logging.getLogger(__name__)


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


def save_run_checkpoint(trainer: Any) -> Path:
    """A checkpoint of ``trainer`` (an :class:`portrl.trainer.rl_trainer.RLTrainer`) at its current step."""
    ident = run_identity(trainer.cfg)
    meta: Dict[str, Any] = {"step": trainer.global_step, "identity": ident, "fingerprint": fingerprint(ident)}
    actor = trainer.actor.rank0("state_dict")
    critic = trainer.critic.rank0("state_dict") if trainer.critic is not None else None
    ref = actor.pop("ref", None)
    if ref is not None:
        meta["reference"] = trainer.reference_copy.pinned(trainer.ckpt, ref)
    state = {"step": trainer.global_step, "data": trainer.train_ds.state_dict(), "rng": rng_state(),
             "kl_coef": None if trainer.kl_ctrl is None else float(trainer.kl_ctrl.value)}

    def write(path: Path) -> None:
        save_state(path, "actor", actor)
        if critic is not None:
            save_state(path, "critic", critic)
        save_state(path, "trainer", state)

    return trainer.ckpt.save(trainer.global_step, write, meta)


def load_run_checkpoint(trainer: Any, path: Path, policy_only: bool = False) -> None:
    """Load checkpoint ``path`` into ``trainer`` after verifying it (manifest sizes and sha256, format version,
    the model it was trained from; the run's reference when this run uses one); nothing is unpickled. A learning
    rate changed since the checkpoint is applied and logged. ``policy_only`` (``portrl eval``): the actor and the
    step only, not the critic, data position, RNG or KL controller of the training run."""
    path = Path(path)
    use_ref = trainer.use_ref and not policy_only
    manifest = open_checkpoint(path, run_identity(trainer.cfg), only=MODEL_KEYS, with_reference=use_ref)
    ref_meta = manifest["meta"].get("reference")
    try:
        actor = load_state(path, "actor")
        critic = load_state(path, "critic") if trainer.critic is not None and not policy_only else None
        state = None if policy_only else load_state(path, "trainer")
        if use_ref and ref_meta is not None:  # the run's reference, written once (save_run_checkpoint)
            actor["ref"] = load_state(path.parent / ref_meta["dir"], "ref")
    except StateFormatError as exc:
        raise CheckpointError(f"checkpoint {path} is unusable: {exc}") from None
    if policy_only:
        actor.pop("ref", None)
    ckpt = getattr(trainer, "ckpt", None)
    if ref_meta is not None and ckpt is not None and path.parent.resolve() == ckpt.root.resolve():
        trainer.reference_copy.remember(ckpt.root, ref_meta)  # resumed in place: no need to write it again
    for worker_state, optim, key in ((actor, trainer.cfg.actor.optim, "actor.optim.lr"),
                                     (critic, trainer.cfg.critic.optim, "critic.optim.lr")):
        note = apply_lr(worker_state, float(optim.lr), key) if worker_state is not None else None
        if note and not policy_only:
            log.warning("%s", note)
    trainer.actor.run("load_state_dict", actor)
    if critic is not None:
        trainer.critic.run("load_state_dict", critic)
    trainer.global_step = int(manifest["step"])
    if state is None:
        return
    try:
        trainer.train_ds.load_state_dict(state["data"])
    except ValueError as exc:  # the same data keys (run identity), but the files' contents changed
        raise CheckpointError(f"checkpoint {path}: {exc}; the training data changed since it was written: "
                              f"restore them, or start a fresh run (a new trainer.output_dir)") from None
    trainer.restart_data()
    set_rng_state(state["rng"])
    if trainer.kl_ctrl is not None and state.get("kl_coef") is not None:
        trainer.kl_ctrl.value = float(state["kl_coef"])
