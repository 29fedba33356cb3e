"""ImplicitPRMWorker: PRIME's implicit process reward model, its frozen reference and its optimizer.

PRIME (Cui et al. 2025, arXiv:2502.01456; verl recipe/prime, ``reward_model`` section): the implicit PRM is a
causal LM ``π_rm``, initialised like the policy, whose token rewards are ``β·(log π_rm(y_t) − log π_ref(y_t))``
(``β`` = ``reward_model.model.beta_train``) against a frozen reference ``π_ref``. Both start from
``reward_model.model.path`` / ``ref_path``, or, unset, from the policy's starting weights: ``model.path``, or the
policy after the SFT warm start, which the trainer hands over with :meth:`start_from_policy`.

* :meth:`compute_log_ratio`: ``q = log π_rm − log π_ref`` ``(B,T)`` on the response tokens (0 on padding), the
  raw implicit reward; the trainer scales and normalises it (``portrl/trainer/prime_phase.py``).
* :meth:`update_rm`: one pass over the rows in mini-batches of ``reward_model.mini_batch_size`` prompts (else
  ``actor.ppo_mini_batch_size``) times ``rollout.n``, one optimizer step each, through the shared update loop
  (portrl.workers.update_loop): verl's ``ce`` loss, the binary cross-entropy of ``σ(β·Σ_t q_t)`` against each
  row's 0/1 ``acc``, or its ``dpo`` loss against the other side of the prompt group
  (``portrl.algo.implicit_prm.prm_dpo_loss``; the loss records: ``portrl/workers/prm_modes.py``), averaged over the mini-batch's rows (all ranks). AdamW and the schedule from
  ``reward_model.model.optim`` (verl: lr 1e-6, constant).

Log-probs are taken at temperature 1 (verl's PRM reads the raw logits), through
:func:`portrl.models.compute_logprobs` like the actor's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch

from portrl.algo.implicit_prm import implicit_token_rewards
from portrl.config.checks_mesh import mesh_sizes
from portrl.models import compute_logprobs, load_causal_lm
from portrl.workers.batch import Batch
from portrl.workers.master_weights import load_dtype
from portrl.workers.prm_modes import prm_mode
from portrl.workers.setup import resolve_dtype, start_worker, use_gradient_checkpointing
from portrl.workers.trained_model import TrainedModel, TrainedModelWorker, model_strategy
from portrl.workers.training import inference_micro_batches, shares_prompts
from portrl.workers.update_loop import LoopSettings, Position


class ImplicitPRMWorker(TrainedModelWorker):
    """Implicit PRM + frozen reference + optimizer, built as ``cls(cfg, rank, world_size)`` (a WorkerGroup member)."""

    config_sections = ("trainer", "device", "model", "data", "rollout", "actor", "reward_model")  # what it reads

    def __init__(self, cfg, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.backend, self.device = start_worker(cfg, rank)
        rm = cfg.reward_model.model
        path, ref_path = str(rm.path or cfg.model.path), str(rm.ref_path or cfg.model.path)
        self.dtype = resolve_dtype(cfg, self.backend)
        self.strategy = model_strategy(cfg, self.backend, world_size)
        attn = cfg.device.attn_impl or cfg.model.attn_impl
        with torch.random.fork_rng(devices=[]):  # building the PRM must not shift the run's RNG stream
            module = load_causal_lm(path, dtype=load_dtype(self.dtype), backend=self.backend, attn_impl=attn,
                                    gradient_checkpointing=use_gradient_checkpointing(cfg, path))
            module.to(self.device).eval()
            self.ref_module = load_causal_lm(ref_path, dtype=self.dtype, backend=self.backend,
                                             attn_impl=attn).to(self.device).eval()
        for p in self.ref_module.parameters():
            p.requires_grad_(False)
        self.ref_from_policy = False  # the reference holds handed-over policy weights (saved with the state)
        # masters, the wrap (ForwardModule(module, compute_logprobs) with several workers), optimizer, schedule
        self.trained = TrainedModel(cfg, module, backend=self.backend, device=self.device, dtype=self.dtype,
                                    strategy=self.strategy, optim=cfg.reward_model.model.optim, rank=rank,
                                    world_size=world_size, forward=compute_logprobs,
                                    mesh_sizes=mesh_sizes(cfg, "reward_model.model"))

    def start_from_policy(self, weights: Mapping[str, torch.Tensor], into_model: bool = True,
                          into_ref: bool = True) -> None:
        """Load the policy's weights (its model state, keyed as the causal LM's) into the PRM (``into_model``) and
        its reference (``into_ref``): the SFT warm start's result, where PRIME's PRM starts when no path is given."""
        if into_model:  # under FSDP2 each rank keeps its rows of the full tensors (TrainedModel.load_weights)
            self._check_fit(*self.trained.load_weights(weights))
        if into_ref:
            keys = self.ref_module.load_state_dict(dict(weights), strict=False)
            self._check_fit(keys.missing_keys, keys.unexpected_keys)
        self.ref_from_policy = self.ref_from_policy or into_ref

    @staticmethod
    def _check_fit(missing: List[str], unexpected: List[str]) -> None:
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise ValueError(f"the policy's weights do not fit the implicit PRM (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}); set reward_model.model.path and ref_path to model "
                             f"directories")

    # ------------------------------------------------------------------------------ forward
    def _logp(self, module, micro: Batch, grad: bool = False) -> torch.Tensor:
        fn = module if module is self.train_module and module is not self.module else (
            lambda *a, **k: compute_logprobs(module, *a, **k))
        m = self.cfg.model
        with torch.set_grad_enabled(grad):
            logp, _ = fn(micro.tensors["input_ids"].to(self.device), micro.tensors["attention_mask"].to(self.device),
                         response_length=micro.tensors["responses"].shape[1], temperature=1.0, with_entropy=False,
                         packed=bool(m.use_packing), chunk_size=m.logprob_chunk_size,
                         share_prompts=bool(m.share_prompts))
        return logp

    def _q(self, module, micro: Batch, grad: bool = False) -> torch.Tensor:
        ref = self._logp(self.ref_module, micro)
        q, _ = implicit_token_rewards(self._logp(module, micro, grad), ref, micro.tensors["response_mask"].to(
            self.device), 1.0)
        return q

    def compute_log_ratio(self, batch: Batch) -> Batch:
        """``implicit_log_ratio`` ``(B,T)``: ``log π_rm − log π_ref`` of the current PRM on the response tokens."""
        micro = inference_micro_batches(batch, self.cfg.actor, self.trained.dp_size, shares_prompts(self.cfg.model))
        return Batch({"implicit_log_ratio": torch.cat([self._q(self.train_module, mb).cpu() for mb in micro])})

    # ------------------------------------------------------------------------------- update
    def loop_settings(self) -> LoopSettings:
        """One epoch, mini-batches of ``reward_model.mini_batch_size`` (else the actor's) prompts, the actor's
        micro-batch limits, ``reward_model.model.optim.grad_clip``; rows keep their order."""
        a, rm = self.cfg.actor, self.cfg.reward_model
        return self.trained.loop_settings(1, rm.mini_batch_size if rm.mini_batch_size is not None
                                          else a.ppo_mini_batch_size)

    def update_rm(self, batch: Batch) -> Dict[str, float]:
        """One online update on ``batch`` (input_ids, attention_mask, responses, response_mask, acc; for the dpo loss
        also ``prm_dpo_others``) with the loss record of ``reward_model.model.loss_type``
        (portrl.workers.prm_modes); returns ``reward_model/*`` metrics (``ce_loss`` or ``dpo_loss``: the mean over
        the rows of each mini-batch before its step)."""
        beta = float(self.cfg.reward_model.model.beta_train)
        record = prm_mode(self.cfg.reward_model.model).loss
        name = record.metric

        def prm_loss(micro: Batch, counts: Dict[str, Any], pos: Position):
            q = self._q(self.train_module, micro, grad=True)
            acc, mask = micro.tensors["acc"].float(), micro.tensors["response_mask"]
            per_row = record.row_loss(q, acc, micro.tensors, mask, beta)
            loss = per_row.sum() / counts["global_batch_size"] * counts["dp_size"]
            # summed over micro-batches and averaged over ranks (each scaled by dp_size): the mini-batch's mean
            return loss, {name: float(loss.detach())}

        return self.trained.update(batch, self.loop_settings(), prm_loss, prefix="reward_model",
                                   additive=frozenset({name}))

    # ----------------------------------------------------------------------------- state / io
    # weights_finite, state_dict, load_state_dict, sharded_checkpoint, save_shard, load_shard: TrainedModelWorker
    def extra_state(self, sharded: bool) -> Dict[str, Any]:
        """The reference when it holds handed-over policy weights (a path's reference is loaded again from the
        path): a full copy, in the gathered state and in every rank's shard alike (each rank holds it whole)."""
        if not self.ref_from_policy:
            return {}
        return {"ref": {k: v.detach().cpu() for k, v in self.ref_module.state_dict().items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "ref" in state:
            self.ref_module.load_state_dict(state["ref"])
            self.ref_from_policy = True
