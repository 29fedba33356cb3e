"""The trainer's run settings and the asynchronous modes (part of the structured config of portrl/config/schema.py).

``trainer.mode`` picks how rollout and training overlap; ``async_training`` holds the settings of ``mode=async``
(verl's section name for its asynchronous trainer). What each setting does: portrl/trainer/rollout_pipeline.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

MODES = ("sync", "one_step_off", "async")  # trainer.mode
STALE_SAMPLES = ("wait", "drop")  # async_training.stale_samples


@dataclass
class AsyncTrainingConfig:
    """trainer.mode=async: the rollout workers generate ahead of the trainer, at most ``max_staleness`` policy
    versions behind it (a version is one step's update; 0 = every sample comes from the current policy, exactly
    the synchronous run)."""

    max_staleness: int = 1  # >= 0: the most versions a trained token may lag the policy it updates
    # wait: the rollout generates at most max_staleness batches ahead, so no sample exceeds the bound | drop: it
    # keeps one more batch in flight, so it never idles; a batch older than the bound when taken is generated again
    stale_samples: str = "wait"
    # new weights stop the generations in flight; they keep their tokens and log-probs and go on under the new
    # policy (every token records the version that produced it)
    partial_rollout: bool = True


@dataclass
class ProfileConfig:
    """trainer.profile: steps recorded by the backend's profiler, with the vendor's ranges around each phase, in
    <output_dir>/profile/step_<k>/ (portrl/trainer/profiling.py)."""

    steps: List[int] = field(default_factory=list)  # e.g. [2, 10]; each in 1..trainer.total_steps; [] = none


# ----------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    total_steps: int = 40
    # the preflight refuses a run its memory plan predicts will not fit one device (portrl plan); false: go on anyway
    memory_check: bool = True
    # sync: every step generates, then trains | one_step_off: the rollout of step k+1 runs on the separated rollout
    # workers while step k trains (staleness 1) | async: async_training.* (portrl/trainer/rollout_pipeline.py)
    mode: str = "sync"
    # data-parallel actor workers in all (all nodes together); None (auto) = every device the backend sees on this
    # node (its visible-devices variable respected) x nnodes, less separated rollout workers; 1 on the CPU.
    # resolved and logged when the run starts (portrl.workers.setup.resolve_num_workers); `portrl config show`: null
    num_workers: Optional[int] = None
    nnodes: int = 1
    ray_address: Optional[str] = None  # join an existing cluster; None = a local one on 127.0.0.1
    ray_dashboard: bool = False
    use_ray: Optional[bool] = None  # None = only when num_workers > 1 or a cluster is named
    output_dir: str = "outputs/run"
    test_freq: int = 5  # validate every k steps (0 = never)
    val_before_train: bool = True
    save_freq: int = 0  # checkpoint every k steps (0 = only at the end when save_final)
    save_final: bool = True
    max_ckpt_to_keep: int = 2
    resume: str = "auto"  # auto | off | PATH
    # resume=off (or another run's output_dir under auto): refuse | move_aside (rename it to <output_dir>.old-<time>)
    on_existing_run: str = "refuse"
    export_hf: bool = True  # write a transformers-loadable copy of the final policy
    loggers: List[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard | wandb | mlflow
    project_name: str = "portrl"
    experiment_name: str = "run"
    seed: int = 0
    deterministic: bool = False
    progress_bar: bool = True
    plot: bool = True
    save_on_interrupt: bool = True  # SIGINT / SIGTERM: checkpoint the finished step before stopping
    # SPIN (verl recipe/spin): before every step k with k % ref_update_freq == 0 the reference policy becomes a copy
    # of the current policy (portrl.trainer.reference_update); 0 = never (the reference stays the starting policy)
    ref_update_freq: int = 0
    # a call to the workers that gets no answer within max(worker_timeout_s, 5 x the slowest RL step so far)
    # stops the run naming the worker (the first step gets 3 x worker_timeout_s); None = wait forever
    worker_timeout_s: Optional[float] = 300.0
    # a step whose loss or gradient norm is not finite skips its optimizer step (actor, critic, PRIME's reward model;
    # counted in <role>/nonfinite_skipped); after this many steps in a row with a skipped update the run stops with
    # one line naming the last good checkpoint (portrl.trainer.divergence); 0 = never stop
    max_nonfinite_steps: int = 3
    # every trace_freq steps the decoded turns of the batch's first trace_rows trajectories go to
    # <output_dir>/traces.jsonl (portrl/trainer/traces.py; shown by `portrl trace RUN`); 0 = never
    trace_freq: int = 0
    trace_rows: int = 4
    profile: ProfileConfig = field(default_factory=ProfileConfig)
