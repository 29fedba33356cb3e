"""ActorRolloutWorker: the policy, its colocated rollout engine, the optimizer and the frozen reference.

One instance per data-parallel rank (``rank``, ``world_size``). Every method takes and returns a
:class:`~portrl.workers.batch.Batch` or plain Python values, so the same class runs in-process
(one worker) or as a Ray actor (``portrl.workers.group``).

Update (``update_actor``, through the loop shared with the critic, portrl.workers.update_loop): the rows
are cut into mini-batches of ``actor.ppo_mini_batch_size *
rollout.n / world_size`` sequences (one optimizer step each), every mini-batch into micro-batches
(gradient accumulation), repeated ``actor.ppo_epochs`` times. Every micro-batch loss is aggregated
with the *global* token / sequence counts of its mini-batch (:func:`portrl.workers.training.global_counts`),
so micro-batching and data parallelism do not change the update. Loss per mini-batch::

    L = L_pg(old, logp, A) - entropy_coeff * H + kl_loss_coef * KL(logp, ref) + positive_lm_coef * L_lm

with ``old = logp.detach()`` when no ``old_log_probs`` are given (on-policy: one epoch, one
mini-batch), ``L_pg`` from ``algorithm.objective`` (policy_gradient | sppo | dpo).
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from portrl.algo.rollout_correction import rollout_diff_stats
from portrl.algo.spec import algorithm_spec
from portrl.config.checks_mesh import mesh_sizes
from portrl.config.placement import placement_of
from portrl.models import compute_logprobs, load_causal_lm, load_tokenizer
from portrl.models.export import export_pretrained
from portrl.models.multimodal import batch_image_inputs, freeze_vision_tower
from portrl.rollout import choose_engine, engine_capabilities, make_engine
from portrl.rollout.weights import load_named_tensors
from portrl.workers.actor_correction import (UNREJECTED_MASK, apply_rejection, correction_stats_of,
                                             normalize_is_weights, proximal_before_update)
from portrl.workers.actor_loss import ADDITIVE_METRICS, actor_loss
from portrl.workers.batch import Batch
from portrl.workers.lora import apply_lora, merged_weight_meta, merged_weights
from portrl.workers.master_weights import load_dtype
from portrl.workers.offload import holding
from portrl.agent.rollout import AgentRollout, agent_rollout
from portrl.workers.rollout_worker import generate_batch, rollout_settings
from portrl.workers.sft import run_sft as run_sft_steps
from portrl.workers.tape_budget import tape_budget
from portrl.workers.training import (
    all_reduce_sum,
    inference_micro_batches,
    rng_state,
    rollout_corr_metrics,
    rollout_gap_metrics,
    set_rng_state,
    shares_prompts,
)
from portrl.workers.setup import resolve_dtype, start_worker, use_gradient_checkpointing
from portrl.workers.trained_model import TrainedModel, TrainedModelWorker, model_strategy
from portrl.workers.update_loop import LoopSettings, Position

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


class ActorRolloutWorker(TrainedModelWorker):
    """Policy + rollout engine (+ reference). ``model_path`` overrides ``cfg.model.path`` (the resolved tiny model)."""

    config_sections = ("trainer", "device", "model", "data", "rollout", "actor", "ref", "algorithm", "sandbox")  # reads

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, model_path: Optional[str] = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.backend, self.device = start_worker(cfg, rank)
        path = model_path or cfg.model.path
        if not path:
            raise ValueError("ActorRolloutWorker: model.path is empty; the trainer resolves the built-in tiny model first")
        self.model_path = str(path)
        self.dtype = resolve_dtype(cfg, self.backend)  # the compute dtype (engine copy, reference, export)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or self.model_path)
        self.strategy = model_strategy(cfg, self.backend, world_size)
        self.checkpointing = use_gradient_checkpointing(cfg, self.model_path)
        module = load_causal_lm(self.model_path, dtype=load_dtype(self.dtype),
                                backend=self.backend, attn_impl=cfg.device.attn_impl or cfg.model.attn_impl,
                                gradient_checkpointing=self.checkpointing)
        module.to(self.device).eval()
        if bool(cfg.actor.freeze_vision_tower):  # a vision-language model's image encoder stays as loaded
            freeze_vision_tower(module)
        self.lora = int(cfg.actor.lora_rank) > 0
        if self.lora:  # only the adapters train; the engine and exports get merged weights
            module = apply_lora(module, cfg)
        self.holds_engine = placement_of(cfg).actor_holds_engine  # else: the placement's own rollout workers
        # FSDP2 shards the policy in place, so a colocated engine needs a full copy of its own (made before
        # sharding, refreshed by sync_weights); otherwise the hf engine shares the trainer's module.
        engine_model = self._plain_copy(module) if self.strategy == "fsdp" and self.holds_engine else None
        # masters, the wrap every policy log-prob pass runs through (with data parallelism ForwardModule(module,
        # compute_logprobs) under DDP / FSDP2: the decoder, then the LM head's weight in the fused log-prob op, run
        # inside the wrapper's root forward, so DDP all-reduces the gradients and FSDP2 gathers the parameters)
        self.trained = TrainedModel(cfg, module, backend=self.backend, device=self.device, dtype=self.dtype,
                                    strategy=self.strategy, optim=cfg.actor.optim, rank=rank, world_size=world_size,
                                    forward=compute_logprobs, mesh_sizes=mesh_sizes(cfg, "actor"),
                                    offload=cfg.actor.offload)
        self.ref_module: Optional[torch.nn.Module] = None
        if bool(cfg.ref.param_offload):
            self.offload.add("reference", self._move_reference)
        self.engine = self._make_engine(engine_model) if self.holds_engine else None
        self.update_count = 0
        self._tape = None  # the last recorded rollout forward (portrl.models.forward_tape), until the update
        self._param_bytes: Optional[int] = None  # the policy's parameter bytes (the tape budget's first bound)

    # ---------------------------------------------------------------------------------- building
    def _move_reference(self, device: torch.device) -> None:
        if self.ref_module is not None:
            self.ref_module.to(device)

    def _plain_copy(self, module: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """A frozen, unwrapped, unsharded copy of the policy (``module``, default the trained one) with any LoRA
        deltas merged in (a collective under FSDP2: every rank must call it)."""
        module = self.module if module is None else module
        if not self.lora and self.strategy != "fsdp":
            copy_ = copy.deepcopy(module)
        else:
            copy_ = load_causal_lm(self.model_path, dtype=self.dtype, backend=self.backend,
                                   attn_impl=self.cfg.device.attn_impl or self.cfg.model.attn_impl).to(self.device)
            load_named_tensors(copy_, merged_weights(module))
        for p in copy_.parameters():
            p.requires_grad_(False)
        return copy_.eval()

    def _make_engine(self, model: Optional[torch.nn.Module] = None):
        """The colocated engine (:func:`portrl.rollout.choose_engine` decides which). One that declares
        ``in_process_weights`` decodes the trainer's module (or ``model``, the full copy FSDP2 needs); any other
        loads its own copy from ``model_path`` and gets the weights by :meth:`sync_weights`."""
        name = choose_engine(str(self.cfg.rollout.engine), self.backend, num_params=self._num_params)
        settings = rollout_settings(self.cfg.rollout, self.cfg.data, int(self.cfg.trainer.seed), self.dtype)
        if engine_capabilities(name).in_process_weights:
            return make_engine(name, model=self.module if model is None else model, tokenizer=self.tokenizer,
                               backend=self.backend, settings=settings)
        return make_engine(name, model_path=self.model_path, tokenizer=self.tokenizer, backend=self.backend,
                           settings=settings)

    def _can_record_forward(self) -> bool:
        """Whether the update can replay the rollout's recorded forward (portrl.models.forward_tape): one process,
        the hf engine decoding this very module on its fast path, packed shared-prompt forwards, and
        model.reuse_rollout_forward."""
        m = self.cfg.model
        return (bool(m.reuse_rollout_forward) and self.world_size == 1 and self.train_module is self.module
                and self.engine is not None and self.engine.shares_module(self.module)
                and self.engine.can_record_forward()
                and bool(m.use_packing) and bool(m.share_prompts)
                and not bool(self.cfg.rollout.multi_turn.enable))  # a trajectory is many generate calls

    def _agent(self) -> Optional[AgentRollout]:
        """The multi-turn rollouts (rollout.multi_turn.enable; tools loaded once), else None."""
        if not hasattr(self, "_agent_rollout"):
            self._agent_rollout = agent_rollout(self.cfg, self.tokenizer)
        return self._agent_rollout

    def _tape_budget(self) -> Optional[int]:
        """Most bytes a recorded rollout forward may hold now (portrl.workers.tape_budget; None: no limit)."""
        if not self.checkpointing:
            return None
        if self._param_bytes is None:
            self._param_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        trainable = sum(m.numel() * m.element_size() for m in self.master.masters if m.requires_grad)
        return tape_budget(self._param_bytes, trainable, bool(self.optimizer.state), self.backend.memory_available())

    def _num_params(self) -> int:
        """The policy's parameter count (choose_engine's rule for small models on the CPU)."""
        return sum(p.numel() for p in self.module.parameters())

    @holding("module")
    def init_reference(self) -> None:
        """Freeze a copy of the current policy as the reference (after any SFT warm start; ``ref.param_offload``)."""
        self.ref_module = self._plain_copy()
        self.offload.settle("reference")

    @holding("module", "reference")
    def update_reference(self) -> None:
        """Make the reference a copy of the current policy (SPIN's ``trainer.ref_update_freq``), in place: the
        weights the engine would get (LoRA deltas merged, :func:`portrl.workers.lora.merged_weights`) are copied
        into the existing reference module. A collective under FSDP2 (the shards are gathered): every rank calls it."""
        if self.ref_module is None:
            self.init_reference()
        else:
            load_named_tensors(self.ref_module, merged_weights(self.module))

    # -------------------------------------------------------------------------------- rollout
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Mapping[str, Any],
                 meta: Optional[Mapping[str, Sequence[Any]]] = None, for_update: bool = False) -> Batch:
        """Sample ``sampling["n"]`` responses per prompt -> a rollout Batch (rows prompt-major;
        ``meta`` lists, one entry per prompt, are repeated for each sample; see
        :func:`portrl.workers.rollout_worker.generate_batch`). ``for_update``: the batch goes to the next
        :meth:`update_actor`, which may then replay this rollout's forward instead of recomputing it."""
        if self.engine is None:
            raise RuntimeError(f"rollout.placement={self.cfg.rollout.placement}: this actor has no engine; generate "
                               "with the placement's rollout group (portrl.config.placement)")
        record = for_update and self._can_record_forward()
        if record:
            self.engine.start_recording(max_bytes=self._tape_budget())
        try:
            batch = generate_batch(self.engine, self.tokenizer, prompt_ids, sampling, meta,
                                   sleep_after=bool(self.cfg.rollout.enable_sleep_mode), agent=self._agent())
        finally:
            if record:
                self._tape = self.engine.stop_recording()
        return batch

    def generate_from(self, prompts: Batch, sampling: Mapping[str, Any], for_update: bool = False) -> Batch:
        """:meth:`generate` for a prompt Batch (``meta["prompt_ids"]`` plus per-prompt meta such as uid,
        data_source, ground_truth, extra_info), the form a data-parallel group splits across ranks."""
        meta = {k: v for k, v in prompts.meta.items() if k != "prompt_ids"}
        return self.generate(prompts.meta["prompt_ids"], sampling, meta, for_update=for_update)

    # ------------------------------------------------------------------------------ log-probs
    def _forward(self, module, batch: Batch, with_entropy: bool, tape=None, **extra):
        """Log-probs through ``module``: the data-parallel wrapper (already bound to compute_logprobs, see
        :meth:`_wrap`) or a plain causal LM (``tape``: a recorded rollout forward it may replay). ``extra``:
        more keywords of compute_logprobs (``with_sum_pi_squared``)."""
        fn = module if module is self.train_module and module is not self.module else (
            partial(compute_logprobs, module, tape=tape))
        model = self.cfg.model
        if "multi_modal" in batch:  # image rows: their processor inputs, in row order (portrl.models.multimodal)
            extra["multi_modal"] = batch_image_inputs(batch.meta["multi_modal"], self.device)
        return fn(batch.tensors["input_ids"].to(self.device), batch.tensors["attention_mask"].to(self.device),
                  response_length=batch.tensors["responses"].shape[1], temperature=float(self.cfg.rollout.temperature),
                  with_entropy=with_entropy, packed=bool(model.use_packing), chunk_size=model.logprob_chunk_size,
                  share_prompts=bool(model.share_prompts), **extra)

    @torch.no_grad()
    def _log_probs(self, module, batch: Batch, with_entropy: bool, with_sum_pi_squared: bool = False) -> tuple:
        """``(logp, entropy or None)`` (B,T) on the CPU, plus ``sum_pi_squared`` with ``with_sum_pi_squared``."""
        # only the trained (sharded) module's forward is a collective; the others run alone on each rank
        micro = inference_micro_batches(batch, self.cfg.actor, self.trained.dp_size if module is self.train_module else 1,
                                        shares_prompts(self.cfg.model))
        extra = {"with_sum_pi_squared": True} if with_sum_pi_squared else {}
        parts = [self._forward(module, mb, with_entropy, **extra) for mb in micro]
        logp = torch.cat([p[0].float() for p in parts]).cpu()
        ent = torch.cat([p[1].float() for p in parts]).cpu() if with_entropy else None
        if with_sum_pi_squared:
            return logp, ent, torch.cat([p[2].float() for p in parts]).cpu()
        return logp, ent

    def needs_old_log_probs(self, num_rows: int) -> bool:
        """See :func:`old_log_probs_needed` (``num_rows`` = rows of the whole step, all ranks)."""
        return old_log_probs_needed(self.cfg, num_rows)

    @holding("module")
    def compute_log_probs(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropys`` (B,T) under the current policy, and ``sum_pi_squared`` (B,T) when the
        algorithm's record needs it (``needs_sum_pi_squared``: optimal-token-baseline estimators)."""
        spi = algorithm_spec(self.cfg.algorithm).needs_sum_pi_squared
        parts = self._log_probs(self.train_module, batch, with_entropy=True, with_sum_pi_squared=spi)
        out = Batch({"old_log_probs": parts[0], "entropys": parts[1]})
        if spi:
            out["sum_pi_squared"] = parts[2]
        return out

    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """``ref_log_probs`` (B,T) under the frozen reference (created on first use if needed)."""
        if self.ref_module is None:
            self.init_reference()
        with self.offload.on_device("reference"):
            logp, _ = self._log_probs(self.ref_module, batch, with_entropy=False)
        return Batch({"ref_log_probs": logp})

    # --------------------------------------------------------------------------------- update
    def loop_settings(self) -> LoopSettings:
        """The shared update loop's settings from ``actor`` (epochs, mini- and micro-batch sizes, grad clip); with
        ``actor.shuffle`` the rows of epoch e are permuted with seed ``trainer.seed*7919 + update_count*31 + e``."""
        a = self.cfg.actor
        seed = int(self.cfg.trainer.seed) * 7919 + self.update_count * 31 if a.shuffle else None
        return self.trained.loop_settings(int(a.ppo_epochs), a.ppo_mini_batch_size, shuffle_seed=seed)

    @holding("params", "optimizer")
    def update_actor(self, batch: Batch) -> Dict[str, float]:
        """One RL step of policy optimisation through the shared loop (portrl.workers.update_loop; see the module
        docstring for the loss). Returns ``actor/*`` metrics, the rollout gap (``training/*``) and rollout
        correction's ``rollout_corr/*`` metrics."""
        settings = self.loop_settings()
        # rollout correction (portrl/workers/actor_correction.py): rejected tokens leave the loss; normalised weights
        batch = apply_rejection(self.cfg, batch)
        batch, normalized = normalize_is_weights(self.cfg, batch, self.trained.dp_size)
        use_old = "old_log_probs" in batch
        # the rollout's recorded forward holds until the first optimizer step (fused optimizers change the
        # weights without bumping their version counters, so the tape's own check cannot see that step)
        tape, self._tape = self._tape, None
        gaps: List[Dict[str, float]] = []  # rollout engine vs trainer on the same tokens (portrl.algo.rollout_correction)
        corr: List[Dict[str, float]] = []  # and the rollout_corr/* statistics

        def policy_loss(micro: Batch, counts: Dict[str, Any], pos: Position):
            if tape is not None and pos.steps_done == 0:
                tape.free_after_replay = pos.last_micro  # its last reader: free it layer by layer (forward_tape.py)
            logp, ent = self._forward(self.train_module, micro, with_entropy=True,
                                      tape=tape if pos.steps_done == 0 else None)
            if pos.epoch == 0 and "rollout_log_probs" in micro:  # every row once, before its first step
                old = micro.tensors["old_log_probs"] if use_old else logp
                full = micro.get(UNREJECTED_MASK, micro.tensors["response_mask"])
                gaps.append(rollout_diff_stats(old, micro.tensors["rollout_log_probs"], full))
                corr.append(correction_stats_of(self.cfg, micro, old))
            return actor_loss(self.cfg, micro, logp, ent, counts, use_old=use_old)

        spec = algorithm_spec(self.cfg.algorithm)

        def objective_counts(mini: Batch) -> Dict[str, Any]:  # the objective's counts of the mini-batch, all ranks
            local = spec.counts(mini.tensors)
            return dict(zip(local, all_reduce_sum(list(local.values()), self.trained.dp_size))) if local else {}

        out = self.trained.update(batch, settings, policy_loss, prefix="actor", additive=ADDITIVE_METRICS,
                                  extra_counts=objective_counts)
        self.update_count += 1
        out.update(rollout_gap_metrics(gaps, self.trained.dp_size))
        out.update(rollout_corr_metrics(corr, self.trained.dp_size), **normalized)
        return out

    @holding("params", "optimizer")
    def run_sft(self, rows: List[Dict[str, Any]], steps: int, lr: float, batch_size: int) -> Dict[str, float]:
        """Supervised warm start of the policy on (prompt, response) rows (see portrl.workers.sft)."""
        wrapped = self.trained.wrapped
        return run_sft_steps(self.cfg, self.train_module, self.tokenizer, rows, steps=steps, lr=lr,
                             batch_size=batch_size, device=self.device, world_size=self.trained.dp_size,
                             rank=self.trained.dp_rank,
                             forward=self.train_module if wrapped else None, master=self.master,
                             log_every=max(1, steps // 10) if self.rank == 0 else 0)

    # ---------------------------------------------------------------------------- weight sync
    def named_weights(self) -> Iterable[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter and buffer of the policy, named as in the base
        checkpoint, LoRA deltas merged in (:func:`portrl.workers.lora.merged_weights`). Under FSDP2 the
        shards are gathered as it is iterated: every rank must iterate it."""
        with self.offload.on_device("module"):
            yield from merged_weights(self.module)

    def weight_meta(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        """``(name, full shape, dtype name)`` of :meth:`named_weights`, in order, with nothing gathered."""
        return merged_weight_meta(self.module)

    @holding("module")
    def sync_weights(self) -> bool:
        """Push the policy to the rollout engine; False (nothing moved) when the engine shares the module
        (a peft-wrapped module included: its forward applies the adapters) or there is no engine here."""
        if self.engine is None or self.engine.shares_module(self.module):
            return False
        self.engine.update_weights(self.named_weights())
        return True

    # ----------------------------------------------------------------------------- state / io
    # weights_finite, state_dict, load_state_dict, sharded_checkpoint, save_shard, load_shard: TrainedModelWorker
    def extra_state(self, sharded: bool) -> Dict[str, Any]:
        """The actor's entries of its state after model, optimizer, scheduler: the process RNG, the update count, and
        (not in a shard: the trainer writes it once per run) the reference when one exists."""
        state: Dict[str, Any] = {"rng": rng_state(), "update_count": self.update_count}
        ref = None if sharded else self.reference_state()
        if ref is not None:
            state["ref"] = ref
        return state

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """RNG, update count and reference of :meth:`extra_state` (a ``ref`` entry the driver adds to a shard's
        state included), then the weights to the engine."""
        set_rng_state(state["rng"])
        self.update_count = int(state.get("update_count", 0))
        if "ref" in state:
            if self.ref_module is None:
                self.init_reference()
            assert self.ref_module is not None  # init_reference built it
            self.ref_module.load_state_dict(state["ref"])
        self.sync_weights()

    def reference_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The frozen reference's weights (a full copy on every rank; None while there is none)."""
        return None if self.ref_module is None else self.ref_module.state_dict()

    @holding("module")
    def export_hf(self, out_dir: str) -> str:
        """Write the policy as the user's model with new weights (portrl.models.export): a plain model of the
        base architecture, LoRA deltas merged in, the source's config and tokenizer files. Rank 0 writes;
        under FSDP2 every rank joins the gather."""
        model = self._plain_copy() if self.lora or self.strategy == "fsdp" else self.module
        if self.rank == 0:
            export_pretrained(model, out_dir, source_dir=self.model_path, tokenizer=self.tokenizer,
                              tokenizer_dir=self.cfg.model.tokenizer_path or self.model_path)
        return str(Path(out_dir))


def old_log_probs_needed(cfg: PortRLConfig, num_rows: int) -> bool:
    """Whether the step computes ``old_log_probs``: when the algorithm reads them (its record's
    ``needs_old_log_probs``: KL in the reward, an estimator such as optimal_token_baseline) or Σπ²
    (``needs_sum_pi_squared``), or rollout correction decides before the update which tokens it rejects or how it
    normalises its IS weights (``portrl.workers.actor_correction``), or when the old policy may differ from the
    current one at the update. It provably equals it with one PPO epoch and all ``num_rows`` rows of the step in one
    mini-batch (one optimizer step): then the update uses ``old = logp.detach()`` (no extra forward) and gets
    exactly the same loss and gradient."""
    spec = algorithm_spec(cfg.algorithm)
    if spec.needs_old_log_probs or spec.needs_sum_pi_squared:  # Σπ² comes from the same pass
        return True
    if proximal_before_update(cfg):  # rollout correction's rejection mask / normalised IS weights come first
        return True
    mini = int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n)
    return not (int(cfg.actor.ppo_epochs) == 1 and num_rows <= mini)
