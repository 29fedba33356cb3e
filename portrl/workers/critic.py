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

from typing import Any, Dict, Optional

import torch

from portrl.algo import compute_value_loss, masked_mean
from portrl.config.checks_mesh import mesh_sizes
from portrl.models import load_causal_lm
from portrl.models.hf_types import HFModule
from portrl.models.logprobs import response_hidden_states
from portrl.workers.batch import Batch
from portrl.workers.master_weights import load_dtype
from portrl.workers.offload import holding
from portrl.workers.setup import resolve_dtype, start_worker, use_gradient_checkpointing
from portrl.workers.trained_model import TrainedModel, TrainedModelWorker, model_strategy
from portrl.workers.training import inference_micro_batches, shares_prompts
from portrl.workers.update_loop import LoopSettings, Position


class ValueModel(torch.nn.Module):
    """A causal LM's decoder (``base``) with a scalar head; ``forward`` returns values ``(B, T)``.

    The head starts at zero, so an untrained critic predicts 0 everywhere: a random head gives values
    of order 1 that vary from token to token, and GAE passes that noise straight into the advantages
    (PPO's gain with each head: docs/performance.md).
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


class CriticWorker(TrainedModelWorker):
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
            self.strategy = model_strategy(cfg, self.backend, world_size)
            lm = load_causal_lm(str(path), dtype=load_dtype(self.dtype), backend=self.backend,
                                attn_impl=cfg.device.attn_impl or cfg.model.attn_impl,
                                gradient_checkpointing=use_gradient_checkpointing(cfg, str(path)))
            module = ValueModel(lm).to(self.device).eval()
        # DDP / FSDP2 over the ValueModel itself: its forward is the whole value computation, so the wrapper's root
        # forward sees it (no ForwardModule needed)
        self.trained = TrainedModel(cfg, module, backend=self.backend, device=self.device, dtype=self.dtype,
                                    strategy=self.strategy, optim=cfg.critic.optim, rank=rank, world_size=world_size,
                                    mesh_sizes=mesh_sizes(cfg, "critic"), offload=cfg.critic.offload)

    def _values(self, module, batch: Batch) -> torch.Tensor:
        return module(batch.tensors["input_ids"].to(self.device), batch.tensors["attention_mask"].to(self.device),
                      batch.tensors["responses"].shape[1], packed=bool(self.cfg.model.use_packing),
                      share_prompts=bool(self.cfg.model.share_prompts))

    @torch.no_grad()
    @holding("module")
    def compute_values(self, batch: Batch) -> Batch:
        """``values (B,T)`` of the current critic (0 on padding)."""
        micro = inference_micro_batches(batch, self.cfg.actor, self.trained.dp_size, shares_prompts(self.cfg.model))
        return Batch({"values": torch.cat([self._values(self.module, mb).cpu() for mb in micro])})

    def loop_settings(self) -> LoopSettings:
        """The shared update loop's settings: ``critic.ppo_epochs`` (else the actor's), the actor's mini- and
        micro-batch sizes, ``critic.optim.grad_clip``; rows keep their order."""
        c, a = self.cfg.critic, self.cfg.actor
        return self.trained.loop_settings(int(c.ppo_epochs or a.ppo_epochs), a.ppo_mini_batch_size)

    @holding("params", "optimizer")
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

        return self.trained.update(batch, self.loop_settings(), value_loss, prefix="critic",
                                   additive=frozenset({"critic/vf_loss"}), advance_schedule=advance_schedule)

    # weights_finite, state_dict (model, optimizer, scheduler; the process RNG is the actor worker's to save),
    # load_state_dict, sharded_checkpoint, save_shard, load_shard: TrainedModelWorker
