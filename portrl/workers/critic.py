"""CriticWorker: a value model (a causal LM's decoder + a linear value head) for GAE-based methods.

``V[b, t]`` is the value of the state *before* response token ``t``: the head applied to the final
hidden state of the column that precedes it (the column that also predicts token ``t``), as verl's
``values[:, -T-1:-1]``. The decoder runs on packed rows (no padding) like the actor's forward.

Update (``update_critic``): the loop the actor's update runs too (portrl.workers.update_loop: mini-batches,
micro-batches, epochs, global counts, gradient clipping, LR schedule), with the critic's loss on each
micro-batch: the clipped value loss ``½·agg(max((V−R)², (clip(V, V_old±c)−R)²))``; AdamW and the schedule from
``critic.optim``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from portrl.algo import compute_value_loss, masked_mean
from portrl.models import load_causal_lm
from portrl.models.hf_types import HFModule
from portrl.models.logprobs import response_hidden_states
from portrl.state_files import ShardedState, merge_state, save_shard
from portrl.workers.batch import Batch
from portrl.workers.master_weights import MasterWeights, load_dtype, load_train_state, train_state
from portrl.workers.parallel import resolve_strategy, shard_wrap, wrap_model
from portrl.workers.setup import resolve_dtype, start_worker, use_gradient_checkpointing
from portrl.workers.training import build_lr_scheduler, build_optimizer, inference_micro_batches, shares_prompts
from portrl.workers.update_loop import LoopSettings, Position, Trainable, mini_batch_rows, run_update


class ValueModel(torch.nn.Module):
    """A causal LM's decoder (``base``) with a scalar head; ``forward`` returns values ``(B, T)``.

    The head starts at zero, so an untrained critic predicts 0 everywhere: a random head gives values
    of order 1 that vary from token to token, and GAE passes that noise straight into the advantages.
    Measured on the presets test's tiny setup (20 steps, from a random head std 1/sqrt(hidden+1) to
    zero): PPO's probe-reward gain went from +0.056 / +0.017 to +0.087 / +0.094 (trainer.seed 0 / 1).
    The decoder gets no gradient through a zero head; it trains from the head's first optimizer step on."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        prefix = getattr(lm, "base_model_prefix", "model")
        self.base = getattr(lm, prefix)
        config: HFModule = lm.config
        hidden = int(config.hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1, dtype=next(lm.parameters()).dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                packed: bool = True, share_prompts: bool = True) -> torch.Tensor:
        """Values ``(B, T)``: the head on the hidden state before each response token (0 on padding);
        layouts as in :func:`portrl.models.logprobs.response_hidden_states`."""
        hidden, resp_valid = response_hidden_states(self.base, input_ids, attention_mask, response_length, packed,
                                                    share_prompts)
        values = self.value_head(hidden).float().reshape(-1)
        return torch.zeros(resp_valid.shape, dtype=values.dtype, device=values.device).index_put((resp_valid,), values)


class CriticWorker:
    """Value model + optimizer. Built from ``critic.model_path`` or, when unset, the actor's model."""

    config_sections = ("trainer", "device", "model", "data", "rollout", "actor", "critic")  # what it reads

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, model_path: Optional[str] = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.backend, self.device = start_worker(cfg, rank)
        path = cfg.critic.model_path or model_path or cfg.model.path
        if not path:
            raise ValueError("CriticWorker: no model path (critic.model_path, or the actor's model.path)")
        with torch.random.fork_rng(devices=[]):  # building the critic must not shift the run's RNG stream
            torch.manual_seed(int(cfg.trainer.seed) + 1)
            self.dtype = resolve_dtype(cfg, self.backend)
            self.strategy = "none"
            if world_size > 1:
                self.strategy = resolve_strategy(str(cfg.actor.strategy), self.backend)
            lm = load_causal_lm(str(path), dtype=load_dtype(self.dtype), backend=self.backend,
                                attn_impl=cfg.device.attn_impl or cfg.model.attn_impl,
                                gradient_checkpointing=use_gradient_checkpointing(cfg, str(path)))
            self.module = ValueModel(lm).to(self.device).eval()
        # float32 master weights. bf16 / fp16 compute: the float32 module is cast before DDP buckets its
        # gradients; FSDP2 keeps float32 shards (its policy casts for compute), which are then the masters.
        if self.strategy != "fsdp":
            self.master = MasterWeights(self.module, self.dtype)
        self.train_module = self._wrap(self.module)
        if self.strategy == "fsdp":
            self.master = MasterWeights(self.module)
        self.optimizer = build_optimizer(self.master.masters, cfg.critic.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.critic.optim, int(cfg.trainer.total_steps))

    def _wrap(self, module):
        """DDP / FSDP2 over the ValueModel itself: its forward is the whole value computation, so the
        wrapper's root forward sees it (no ForwardModule needed)."""
        if self.world_size <= 1:
            return module
        return wrap_model(module, self.strategy, self.backend, device=self.device, compute_dtype=self.dtype)

    def _values(self, module, batch: Batch) -> torch.Tensor:
        return module(batch.tensors["input_ids"].to(self.device), batch.tensors["attention_mask"].to(self.device),
                      batch.tensors["responses"].shape[1], packed=bool(self.cfg.model.use_packing),
                      share_prompts=bool(self.cfg.model.share_prompts))

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values (B,T)`` of the current critic (0 on padding)."""
        micro = inference_micro_batches(batch, self.cfg.actor, self.world_size, shares_prompts(self.cfg.model))
        return Batch({"values": torch.cat([self._values(self.module, mb).cpu() for mb in micro])})

    def loop_settings(self) -> LoopSettings:
        """The shared update loop's settings: ``critic.ppo_epochs`` (else the actor's), the actor's mini- and
        micro-batch sizes, ``critic.optim.grad_clip``; rows keep their order."""
        c, a = self.cfg.critic, self.cfg.actor
        return LoopSettings(epochs=int(c.ppo_epochs or a.ppo_epochs),
                            mini_rows=mini_batch_rows(a.ppo_mini_batch_size, self.cfg.rollout.n, self.world_size),
                            micro_rows=int(a.ppo_micro_batch_size_per_device),
                            max_tokens=None if a.max_tokens_per_micro_batch is None else int(a.max_tokens_per_micro_batch),
                            grad_clip=float(c.optim.grad_clip),
                            loss_scale_factor=int(self.cfg.data.max_response_length), world_size=self.world_size,
                            shared_prompts=shares_prompts(self.cfg.model))

    def update_critic(self, batch: Batch, advance_schedule: bool = True) -> Dict[str, float]:
        """One RL step of value regression on ``returns`` (needs values, returns, response_mask) through the shared
        loop (portrl.workers.update_loop). ``advance_schedule=False`` (value pretraining) leaves the LR schedule
        where it is, so the schedule spans the RL steps alone."""
        cfg = self.cfg.critic
        mode = str(cfg.loss_agg_mode or self.cfg.actor.loss_agg_mode)
        cliprange = float(cfg.cliprange_value)

        def value_loss(micro: Batch, counts: Dict[str, Any], pos: Position):
            mask = micro.tensors["response_mask"]
            vpreds = self._values(self.train_module, micro)
            loss, clipfrac = compute_value_loss(vpreds, micro.tensors["returns"], micro.tensors["values"], mask,
                                                cliprange, mode, **counts)
            return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(clipfrac),
                          "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask))}

        state = Trainable(self.train_module, self.master, self.optimizer, self.scheduler, self.device)
        return run_update(state, batch, self.loop_settings(), value_loss, prefix="critic",
                          additive=frozenset({"critic/vf_loss"}), advance_schedule=advance_schedule)

    def weights_finite(self) -> bool:
        """Whether this worker's trained weights (its FSDP2 shards) are all finite: asked of every worker before a
        checkpoint is written (portrl.trainer.divergence)."""
        return self.master.finite()

    def state_dict(self) -> Dict[str, Any]:
        """model, optimizer, scheduler (the process RNG is the actor worker's to save); full tensors keyed by
        parameter name, whatever the number of workers (a collective under FSDP2: every rank calls it)."""
        model_sd, optim_sd = train_state(self.module, self.optimizer, self.master)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], sharded: bool = False) -> None:
        """The inverse of :meth:`state_dict`; ``sharded``: of :meth:`load_shard` (this rank's DTensor shards)."""
        load_train_state(self.module, self.optimizer, self.master, state["model"], state["optimizer"], sharded)
        self.scheduler.load_state_dict(state["scheduler"])

    def sharded_checkpoint(self) -> bool:
        """Whether every rank writes its own shard of the checkpoint state (FSDP2 over several ranks)."""
        return self.strategy == "fsdp" and self.world_size > 1

    def save_shard(self, directory: str, name: str) -> None:
        """This rank's part of :meth:`state_dict`, written by this rank with nothing gathered:
        ``<directory>/<name>/rank_<rank>.*`` (portrl.state_files.save_shard). Every rank calls it."""
        model_sd, optim_sd = train_state(self.module, self.optimizer, self.master, sharded=True)
        state = {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}
        save_shard(directory, name, state, self.rank, self.world_size)

    def load_shard(self, directory: str, name: str, extra: Optional[Mapping[str, Any]] = None) -> None:
        """Load this rank's rows of a state :meth:`save_shard` wrote (by any number of ranks); ``extra``: entries
        that replace the saved ones (a rescaled learning-rate schedule). Every rank calls it."""
        state = ShardedState(directory, name).load(self.rank, self.world_size, wrap=shard_wrap(self.module))
        self.load_state_dict(merge_state(state, extra or {}), sharded=True)
