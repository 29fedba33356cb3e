"""RLTrainer: the single-controller RL loop (the path of one step through the files: docs/ARCHITECTURE.md).

One step::

    prompts -> generate n responses each (uid per prompt) -> reward (score on the last token)
      [-> more generation batches, keeping informative groups (DAPO dynamic sampling)]
      -> old log-probs (skipped when provably equal to the current policy, see
         portrl.workers.actor.old_log_probs_needed) -> reference log-probs (when a KL term needs them)
      -> critic values -> KL in the reward -> advantages -> critic update -> actor update
      -> weight sync to the rollout engine -> metrics

Before step 1 of a fresh run: the SFT warm start (``model.sft_warm_start``), then value pretraining
(``critic.pretrain_steps``, portrl.trainer.value_pretrain).

Validation (greedy by default, mean@k accuracy per data source) runs before training and every
``trainer.test_freq`` steps. Checkpoints (model, optimizer, LR schedule, RNG, data position, KL controller) every
``trainer.save_freq`` steps (portrl.trainer.run_checkpoints; when one is due: portrl.trainer.step_schedule);
``trainer.resume`` = auto | off | PATH. Generation seeds derive from (trainer.seed, step), so a resumed run samples
what an uninterrupted run samples.

SIGINT / SIGTERM end a run between steps with a checkpoint and :class:`portrl.errors.RunStopped`; calls to
Ray workers have a time limit that follows the step time (portrl.trainer.interrupts).

A run that diverges stops with one line naming the checkpoint to resume from (portrl.trainer.divergence):
``trainer.max_nonfinite_steps`` steps in a row whose updates were skipped for a non-finite loss or gradient norm,
or a policy whose logits are not finite; a checkpoint is never written from non-finite weights.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import torch

from portrl.algo import critic_enabled, get_kl_controller, reference_enabled
from portrl.algo.pf_ppo import pf_ppo_resample_indices
from portrl.config.checks_mesh import mesh_replicas
from portrl.config.placement import placement_of
from portrl.data import PromptBatch
from portrl.device.weight_transport import sync_metrics
from portrl.errors import RunStopped, UserError
from portrl.models import load_processor, load_tokenizer
from portrl.outputs import OutputExists
from portrl.trainer.advantage_phase import apply_reward_kl, compute_batch_advantages, old_policy_phase
from portrl.trainer.agent_metrics import agent_metrics
from portrl.trainer.checkpoint import CheckpointManager
from portrl.trainer.data_fit import warm_start_task
from portrl.trainer.divergence import DivergenceWatch, nonfinite_roles
from portrl.trainer.generation import StepGeneration, generation_seed, prompt_batch, run_dataset
from portrl.trainer.interrupts import StopSignals, stop_signals, stopped_message, worker_timeout
from portrl.trainer.memory_plan import StepPlan
from portrl.trainer.metrics import Timer, data_metrics
from portrl.trainer.plot import plot_run
from portrl.trainer.prime_phase import build_prime_phase
from portrl.trainer.profiling import StepProfiling
from portrl.trainer.reference_update import refresh_reference
from portrl.trainer.resources import builtin_sft_rows, is_settled, settle_config, settled_num_workers
from portrl.trainer.rollout_pipeline import RolloutPipeline
from portrl.trainer.reward_scoring import RewardScorer
from portrl.trainer.run_checkpoints import ReferenceCopy, load_run_checkpoint, resume_run, save_run_checkpoint
from portrl.trainer.run_dir import prepare_run_dir
from portrl.trainer.run_end import run_failure
from portrl.trainer.run_identity import run_identity
from portrl.trainer.speed import StepSpeed
from portrl.trainer.step_schedule import StepSchedule
from portrl.trainer.tracking import Tracker, read_metrics_up_to
from portrl.trainer.traces import TraceWriter
from portrl.trainer.validation import validate, validation_prompts
from portrl.trainer.value_pretrain import pretrain_critic
from portrl.workers.actor import ActorRolloutWorker
from portrl.workers.batch import Batch
from portrl.workers.critic import CriticWorker
from portrl.workers.group import WorkerGroup
from portrl.workers.ray_env import shutdown_ray, terminate_local_ray
from portrl.workers.setup import seed_all, setup_process, worker_backend

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

log = logging.getLogger(__name__)


class RLTrainer:
    """Builds workers, data, reward, tracker and checkpoints from ``cfg``; :meth:`fit` runs the loop.

    ``cfg`` is a settled config (:func:`portrl.trainer.resources.settle_config`: read-only, with
    ``trainer.num_workers``, ``model.path`` and the data files resolved); the trainer writes nothing into it."""

    def __init__(self, cfg: PortRLConfig):
        if not is_settled(cfg):
            raise TypeError("RLTrainer takes a settled config: portrl.trainer.resources.settle_config(cfg) after "
                            "the preflight (run_training settles the config it is given)")
        self.cfg = cfg
        self.backend = worker_backend(cfg)
        setup_process(cfg, self.backend)
        seed_all(int(cfg.trainer.seed))
        self.out_dir = Path(str(cfg.trainer.output_dir))  # created by fit(): validate() alone (eval) writes nothing
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.processor = load_processor(cfg.model.path)  # a vision-language model's; None for a text model
        d = cfg.data
        self.train_ds = run_dataset(cfg, [str(f) for f in d.train_files], self.tokenizer, self.processor,
                                    shuffle=bool(d.shuffle), seed=int(d.seed))
        self.val_prompts = validation_prompts(cfg, [str(f) for f in d.val_files], self.tokenizer, self.processor)
        self.actor = WorkerGroup(ActorRolloutWorker, cfg, settled_num_workers(cfg), self.backend,
                                 replicas=mesh_replicas(cfg, "actor"))
        # a placement whose actor holds no engine (separated): its own rollout workers and a weight link
        self.rollout, self.weight_link = placement_of(cfg).rollout_side(cfg, self.backend, self.actor)
        self.gen = self.rollout if self.rollout is not None else self.actor  # where generation runs
        self.speed = StepSpeed(cfg, self.backend, self.actor.num_workers, getattr(self.rollout, "num_workers", None))
        self.memory_plan = StepPlan(cfg, self.backend, self.actor.num_workers)  # memory/plan_gib/<phase>
        self.critic = None
        if critic_enabled(cfg):
            self.critic = WorkerGroup(CriticWorker, cfg, settled_num_workers(cfg), self.backend,
                                      replicas=mesh_replicas(cfg, "critic"))
        self.prm = build_prime_phase(cfg, self.backend)  # PRIME's implicit PRM when the algorithm reads its rewards
        self.profiling = StepProfiling(cfg, self.backend, self.out_dir, lambda: {
            "actor": self.actor, "critic": self.critic, "prm": getattr(self.prm, "group", None), "rollout": self.rollout})
        self.reward = RewardScorer(cfg, self.tokenizer)
        self.pipeline = RolloutPipeline(cfg, self.gen, self._next_prompts, self.train_ds.state_dict)  # trainer.mode
        if self.pipeline.plan.overlaps and self.weight_link is None:
            raise UserError(f"trainer.mode={cfg.trainer.mode} overlaps rollout and training on disjoint resources: "
                            f"set rollout.placement=separated")
        self.generation = StepGeneration(cfg, self.gen, self.reward, self.tokenizer, self.pipeline,
                                         records_forward=self.gen is self.actor)
        self.use_ref = reference_enabled(cfg)
        self.kl_ctrl = None
        if cfg.algorithm.use_kl_in_reward:
            k = cfg.algorithm.kl_ctrl
            self.kl_ctrl = get_kl_controller(str(k.type), float(k.kl_coef), float(k.target_kl), int(k.horizon))
        self.global_step = 0
        self.traces: Optional[TraceWriter] = None  # train() opens it: train_step alone (benchmarks) writes none
        self.sent_version = 0  # the policy version last sent to the rollout (the step of its update)
        self._train_iter: Optional[Iterator[PromptBatch]] = None
        self.reference_copy = ReferenceCopy()  # the run's reference policy, written once (run_checkpoints)
        self.history: List[Dict[str, float]] = []

    # ------------------------------------------------------------------------------------- data
    def _next_prompts(self) -> Batch:
        if self._train_iter is None:
            self._train_iter = self.train_ds.batches(int(self.cfg.data.train_batch_size))
        return prompt_batch(next(self._train_iter))

    def _rollout(self, step: int, timer: Timer, for_update: bool = True) -> tuple:
        """A step's generated and scored batch (portrl.trainer.generation.StepGeneration.rollout)."""
        return self.generation.rollout(step, timer, for_update, self.sent_version)

    def data_position(self) -> Dict[str, Any]:
        """The dataset position a checkpoint keeps (before the requests in flight: rollout_pipeline)."""
        return self.pipeline.data_state()

    def train_step(self, step: int) -> Dict[str, float]:
        cfg = self.cfg
        # peak memory per phase where the workers run in this process (a Ray worker's memory is its own)
        in_process = not any(g is not None and g.use_ray for g in (self.actor, self.critic, self.rollout))
        timer = Timer(memory=self.backend if in_process else None, ranges=self.profiling.ranges(step))
        m: Dict[str, float] = {}
        t0 = time.perf_counter()
        with self.profiling.step(step), timer("step"):  # trainer.profile.steps: portrl/trainer/profiling.py
            refresh_reference(self, step, timer)  # SPIN: trainer.ref_update_freq
            batch, gm = self._rollout(step, timer)
            m.update(gm)
            m.update(self.pipeline.step_metrics(batch, self.sent_version))  # staleness, dropped samples
            if batch is None:
                m["train/skipped"] = 1.0
                return {**m, **timer.metrics()}
            m.update(agent_metrics(batch))  # multi-turn rollouts: turns, tool calls, tool errors (else nothing)
            if self.traces is not None:  # trainer.trace_freq: decoded turns to traces.jsonl
                self.traces.observe(step, batch)
            m.update(old_policy_phase(cfg, self.actor, batch, timer))  # old log-probs (or the rollout's)
            if self.use_ref:
                with timer("ref"):
                    batch.union(self.actor.concat(ActorRolloutWorker.compute_ref_log_probs, batch))
            if self.critic is not None:
                with timer("values"):
                    batch.union(self.critic.concat(CriticWorker.compute_values, batch))
            m.update(self.prm.run(self, batch, timer) if self.prm is not None else {})  # PRIME: implicit rewards
            with timer("adv"):
                m.update(apply_reward_kl(cfg, batch, self.kl_ctrl))
                m.update(compute_batch_advantages(cfg, batch))
                if cfg.algorithm.use_pf_ppo:  # PF-PPO: the update sees the batch resampled by score
                    pf = cfg.algorithm.pf_ppo
                    batch = batch.select(pf_ppo_resample_indices(batch.tensors["token_level_scores"].sum(-1),
                                                                 str(pf.reweight_method), float(pf.weight_pow),
                                                                 seed=generation_seed(cfg, step, 700)))
            if self.critic is not None:
                with timer("update_critic"):
                    m.update(self.critic.metrics(CriticWorker.update_critic, batch))
            if step > int(cfg.critic.warmup_steps) or self.critic is None:
                with timer("update_actor"):
                    m.update(self.actor.metrics(ActorRolloutWorker.update_actor, batch))
                with timer("sync"):
                    m.update(self.sync_weights(step))
        elapsed = time.perf_counter() - t0
        m.update({**data_metrics(batch, int(cfg.data.max_response_length)), **timer.metrics()})
        tokens = float(batch.tensors["attention_mask"].sum())
        m["perf/tokens_per_s"] = tokens / max(elapsed, 1e-9)
        m["perf/gen_tokens_per_s"] = float(batch.tensors["response_mask"].sum()) / max(timer.times.get("gen", 0), 1e-9)
        m["perf/num_tokens"] = tokens
        m.update({**self.speed.step(batch, timer.times), **self.memory_plan.metrics(batch, m)})  # speed.py, memory_plan.py
        return m

    def validate(self, step: int) -> Dict[str, float]:
        """Accuracy and score per data source on the validation prompts (portrl.trainer.validation); in the
        asynchronous modes with the policy last sent."""
        extra = {"min_version": self.sent_version} if self.pipeline.plan.overlaps else None
        return validate(self.cfg, self.gen, self.reward, self.val_prompts, step, extra)

    def sync_weights(self, version: int) -> Dict[str, float]:
        """The policy (``version``: its step) to the engines: colocated ones (``sync_weights`` on the actors) or the
        separated rollout workers (``weight_link``, whose sync's seconds and bytes are returned as metrics)."""
        self.sent_version = version
        if self.weight_link is not None:
            return sync_metrics(self.weight_link.sync(version))
        self.actor.run(ActorRolloutWorker.sync_weights)
        return {}

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Optional[Path]:
        """A checkpoint of the current step (portrl.trainer.run_checkpoints.save_run_checkpoint); None, with a
        warning, when some worker's weights are not finite: a checkpoint never holds them
        (portrl.trainer.divergence)."""
        bad = nonfinite_roles(self)
        if bad:
            log.warning("no checkpoint of step %d: the %s weights are not finite (training diverged)", self.global_step,
                        " and ".join(bad))
            return None
        return save_run_checkpoint(self)

    def load_checkpoint(self, path: Path, policy_only: bool = False) -> None:
        """Load a verified checkpoint (portrl.trainer.run_checkpoints.load_run_checkpoint); ``policy_only``: the
        actor and the step only (``portrl eval``)."""
        load_run_checkpoint(self, path, policy_only)

    def restart_data(self) -> None:
        """Take the next prompts from the dataset's current position (after it was restored)."""
        self._train_iter = None
        self.pipeline.discard()

    # -------------------------------------------------------------------------------------- fit
    def fit(self) -> Dict[str, Any]:
        """Run to ``trainer.total_steps``; returns the summary dict (see :func:`run_training`)."""
        cfg, t = self.cfg, self.cfg.trainer
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", max_to_keep=int(t.max_ckpt_to_keep))
        # this run's checkpoint, a fresh start, or an error: never another run's files (portrl.trainer.run_dir)
        resume, record = prepare_run_dir(cfg, self.out_dir, self.ckpt, run_identity(cfg),
                                         getattr(self, "_run_id", None))
        self._run_id = record.get("run_id")
        started = time.perf_counter()
        summary: Dict[str, Any] = {"run_dir": str(self.out_dir)}
        if resume is not None:  # with resume=auto, the previous intact one if it does not load (resume_run)
            resume = resume_run(self, resume)
            summary["resumed_from"] = str(resume)
        elif cfg.model.sft_warm_start:
            rows = builtin_sft_rows(cfg, at_least=2000) if warm_start_task(cfg) is not None else None
            if rows is None:  # the preflight turns a preset's off for such data (portrl.trainer.data_fit)
                raise ValueError(f"model.sft_warm_start needs the generated rows of a task with built-in SFT rows "
                                 f"(data.name={cfg.data.name}, data.train_files empty); run `portrl sft` first")
            if t.val_before_train and self.val_prompts is not None:
                summary["val_before"] = self.validate(-1).get("val/acc/mean")  # the untrained model
            sft = self.actor.metrics(ActorRolloutWorker.run_sft, rows, int(cfg.model.sft_steps),
                                     float(cfg.model.sft_lr), int(cfg.model.sft_batch_size))
            summary.update(sft)
        if self.use_ref and resume is None:
            self.actor.run(ActorRolloutWorker.init_reference)
        if self.weight_link is not None:  # separated rollout workers start from the resumed / warm-started policy
            if self.pipeline.plan.overlaps:
                self.weight_link.start_listeners()  # they receive each version while they generate
            self.sync_weights(self.global_step)
        if self.critic is not None and resume is None and int(cfg.critic.pretrain_steps) > 0:
            summary.update(pretrain_critic(cfg, self.critic, self._rollout))
        tracker = Tracker(str(self.out_dir), loggers=tuple(t.loggers), config=cfg, total_steps=int(t.total_steps),
                          progress_bar=bool(t.progress_bar), resume_step=self.global_step)
        self.traces = TraceWriter(self.out_dir, int(t.trace_freq), int(t.trace_rows), self.tokenizer, self.global_step)
        # a resumed run's summary covers the whole run: its earlier steps come back from metrics.jsonl
        earlier = read_metrics_up_to(self.out_dir, self.global_step) if resume is not None else []
        if earlier and "val/acc/mean" in earlier[0] and int(earlier[0].get("step", -1)) == 0:
            summary["val_before"] = earlier[0]["val/acc/mean"]
        # checkpoint cadence and the divergence stop (skipped updates counted over the run): step_schedule
        self.schedule = StepSchedule(DivergenceWatch(int(t.max_nonfinite_steps), earlier), self.ckpt,
                                     total_steps=int(t.total_steps), save_freq=int(t.save_freq),
                                     save_final=bool(t.save_final), save_on_interrupt=bool(t.save_on_interrupt))
        stop: Optional[StopSignals] = None
        try:
            with stop_signals() as stop:  # SIGINT / SIGTERM: finish the step, save, raise RunStopped
                self._loop(tracker, resume, summary, stop)
        except RunStopped:
            self.shutdown_workers()
            raise
        except Exception as exc:
            err = run_failure(self, exc, stop)  # one line instead of a traceback, where there is one (run_end)
            if err is None or err is exc:
                raise
            raise err from exc
        finally:
            tracker.close()
        return self._finish(summary, started, earlier)

    def _loop(self, tracker: Any, resume: Optional[Path], summary: Dict[str, Any], stop: StopSignals) -> None:
        """Validation before RL, then the steps. Between steps: a stop asked for by a signal (``stop``) saves
        the finished step and raises RunStopped; each step's time scales the workers' time limit."""
        t = self.cfg.trainer
        last_ckpt = resume
        stop.abort_message = lambda name: "portrl: " + self._stopped_message(name, last_ckpt, at_once=True)
        then = "saving a checkpoint and stopping" if t.save_on_interrupt else "stopping"
        stop.notice = lambda name: (f"portrl: {name} received: finishing step {self.global_step + 1}, then {then} "
                                    f"(send it again to stop at once)")
        stop.at_once = False  # from here a signal lets the validation or step that runs finish
        if any(getattr(g, "use_ray", False) for g in (self.rollout, self.critic, self.actor)):
            stop.on_abort = [terminate_local_ray]
        slowest: Optional[float] = None
        self._set_worker_timeout(worker_timeout(t.worker_timeout_s, slowest))
        if stop.requested:  # asked while the workers started or during the warm start
            raise RunStopped("portrl: " + self._stopped_message(stop.name, last_ckpt), stop.exit_code)
        if resume is None and t.val_before_train and self.val_prompts is not None:
            v = self.validate(0)
            summary.setdefault("val_before", v.get("val/acc/mean"))
            summary["val_before_rl"] = v.get("val/acc/mean")
            tracker.log(v, step=0)
        for step in range(self.global_step + 1, int(t.total_steps) + 1):
            if stop.requested:  # asked during the validation before training: nothing of a step to save
                raise RunStopped("portrl: " + self._stopped_message(stop.name, last_ckpt), stop.exit_code)
            began = time.perf_counter()
            m = self.train_step(step)
            self.global_step = step
            last = step == int(t.total_steps)
            if int(t.test_freq) > 0 and (step % int(t.test_freq) == 0 or last):
                m.update(self.validate(step))
            self.schedule.metrics(step, m)  # the last save's seconds, the divergence counts
            # the step's metrics line is written before its checkpoint: a run killed in between resumes
            # from the previous checkpoint (its later lines are dropped), never past an unlogged step
            tracker.log(m, step=step)
            self.history.append(m)
            # a diverged run stops here, unsaved; else a due checkpoint (None: none written)
            last_ckpt = self.schedule.end_step(step, stop.requested, self.save_checkpoint) or last_ckpt
            if stop.requested and not last:
                raise RunStopped("portrl: " + self._stopped_message(stop.name, last_ckpt), stop.exit_code)
            slowest = max(slowest or 0.0, time.perf_counter() - began)
            self._set_worker_timeout(worker_timeout(t.worker_timeout_s, slowest))

    def _stopped_message(self, signal_name: str, checkpoint: Optional[Path], at_once: bool = False,
                         abandoned: str = "") -> str:
        """One line: what stopped the run, after which step, and how to resume (interrupts.stopped_message)."""
        return stopped_message(signal_name, self.global_step, int(self.cfg.trainer.total_steps),
                               str(self.cfg.trainer.resume), checkpoint, at_once=at_once, abandoned=abandoned)

    def _set_worker_timeout(self, limit: Optional[float]) -> None:
        """The time limit on each call to Ray workers (portrl.trainer.interrupts.worker_timeout)."""
        for group in (self.actor, self.critic, self.rollout):
            if group is not None:
                group.timeout_s = limit

    def shutdown_workers(self) -> None:
        """Stop the worker processes of a run that stops early: with Ray workers, Ray itself goes
        (portrl.workers.ray_env.shutdown_ray); in-process workers need nothing."""
        if any(g is not None and g.use_ray for g in (self.rollout, self.critic, self.actor)):
            shutdown_ray()

    def _finish(self, summary: Dict[str, Any], started: float, earlier: List[Dict[str, Any]]) -> Dict[str, Any]:
        t = self.cfg.trainer
        if t.export_hf:
            summary["export_dir"] = self.actor.rank0(ActorRolloutWorker.export_hf, str(self.out_dir / "hf_model"))
        if t.plot:
            try:
                summary["plots"] = [str(p) for p in plot_run(str(self.out_dir))]
            except (ImportError, OutputExists) as exc:  # a broken matplotlib, a user's file: the run is kept
                log.warning("plotting skipped: %s", exc)
        records = [r for r in earlier if int(r.get("step", 0)) > 0] + self.history  # step 0: val_before only
        vals = [h["val/acc/mean"] for h in records if "val/acc/mean" in h]
        summary.update({"steps": self.global_step, "val_after": vals[-1] if vals else None,
                        "time_s": time.perf_counter() - started})
        tps = [h["perf/tokens_per_s"] for h in records if "perf/tokens_per_s" in h]
        summary["tokens_per_s"] = sum(tps) / len(tps) if tps else None
        summary.update(self.speed.summary(records))
        return summary


def run_training(cfg: PortRLConfig) -> Dict[str, Any]:
    """Run RL training as configured (``cfg`` is settled here when it is not yet: resources.settle_config);
    returns ``{"run_dir", "steps", "val_before" (before any training, SFT included), "val_before_rl", "val_after",
    "time_s", "tokens_per_s", "export_dir", "plots", "resumed_from"?, "sft/*"?, "critic/pretrain_*"?}``
    (validation accuracies are val/acc/mean, None without validation; critic/pretrain_* from
    portrl.trainer.value_pretrain)."""
    trainer: Optional[RLTrainer] = None

    def stopped_while_starting(name: str) -> str:  # the line of a signal before step 1 (interrupts)
        step = getattr(trainer, "global_step", 0)  # > 0 once a checkpoint is loaded
        manager = getattr(trainer, "ckpt", None)
        ckpt = manager.path_for(step) if step and manager is not None else None
        return "portrl: " + stopped_message(name, step, int(cfg.trainer.total_steps), str(cfg.trainer.resume),
                                            ckpt if ckpt is not None and ckpt.is_dir() else None)

    with stop_signals() as stop:  # until the loop starts, a signal stops at once: there is nothing to finish
        stop.at_once, stop.abort_message, stop.on_abort = True, stopped_while_starting, [terminate_local_ray]
        trainer = RLTrainer(settle_config(cfg))  # resources resolved into a read-only copy (resources.py)
        stop.install()  # again: ray.init replaced the SIGTERM handler
        return trainer.fit()
