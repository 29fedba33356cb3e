"""What every rank of a ``portrl parity mesh`` case runs: GRPO steps of the tiny model under one device mesh.

One step, on a fixed batch of ``ROWS`` rows (``GROUPS`` prompts x ``N`` responses, left-padded prompts of
different lengths, right-padded responses, fixed 0/1 rewards), with the functions the actor uses:

1. GRPO advantages of the whole batch (portrl.algo.compute_grpo_outcome_advantage), as the trainer computes them
   before the update;
2. the rank's rows: data-parallel rank ``d`` of ``dp`` takes rows ``[d R/dp, (d+1) R/dp)`` (the sequence and
   tensor parallel ranks of a data-parallel group take the same rows);
3. log-probs of the response tokens under the mesh (portrl.models.compute_logprobs through the wrapped model:
   sequence-parallel decoder, vocabulary-parallel log-prob); the old (rollout) log-probs are the same values,
   detached, plus a fixed offset per token (std 0.3), so the ratios differ from 1, some clip, and the loss
   depends on the log-probs;
4. PPO-clip loss, token-mean over the whole batch's tokens (``dp_size`` and the global token count, so FSDP2's
   gradient average gives the one-rank gradient: portrl.algo.aggregation);
5. backward, the gradient norm clipped at 1.0 (portrl.workers.parallel.clip_grad_norm), AdamW.

Reported per step: the whole batch's log-probs (gathered from the data-parallel ranks), the loss summed over them,
the gradient norm before clipping, and after the last step the norm of every parameter (a fingerprint of the
weights, gathered over the mesh).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from portrl.algo.advantages_outcome import compute_grpo_outcome_advantage
from portrl.algo.policy_losses import compute_policy_loss_vanilla
from portrl.device.mesh_shape import MeshShape
from portrl.device.registry import get_backend
from portrl.models import compute_logprobs
from portrl.models.loader import load_causal_lm
from portrl.config.schema import ActorConfig
from portrl.workers.lora import ALL_LINEAR, apply_lora
from portrl.workers.mesh import build_mesh
from portrl.workers.parallel import ForwardModule, clip_grad_norm, full_state_dict, init_distributed, wrap_model

GROUPS, N, PROMPT, RESPONSE = 2, 4, 12, 10
ROWS = GROUPS * N
LR = 1e-3


@dataclass(frozen=True)
class MeshCase:
    """A mesh to check: ``world`` ranks with ``tp`` / ``sp`` and ``fsdp_size`` (-1: all data x sequence ranks)."""

    name: str
    world: int
    tp: int = 1
    sp: int = 1
    fsdp_size: int = -1
    checkpointing: bool = False  # gradient checkpointing: the backward recomputes each layer, collectives included
    lora_rank: int = 0  # > 0: LoRA adapters on every linear layer of the decoder train, the base weights frozen

    @property
    def shape(self) -> MeshShape:
        return MeshShape.of(self.world, tp=self.tp, sp=self.sp, fsdp_size=self.fsdp_size)


def step_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """The fixed batch: ``input_ids``, ``attention_mask`` (ROWS, PROMPT+RESPONSE), ``response_mask`` (ROWS,
    RESPONSE), ``rewards`` (ROWS,) and the GRPO group ``index`` (ROWS,)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (ROWS, PROMPT + RESPONSE), generator=g)
    prompt_len = torch.randint(4, PROMPT + 1, (GROUPS,), generator=g).repeat_interleave(N)
    response_len = torch.randint(2, RESPONSE + 1, (ROWS,), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    mask = (cols >= PROMPT - prompt_len[:, None]) & (cols < PROMPT + response_len[:, None])
    for i in range(GROUPS):  # the rows of a group share their prompt
        ids[i * N:(i + 1) * N, :PROMPT] = ids[i * N, :PROMPT]
    rewards = (torch.arange(ROWS) % 3 == 0).to(torch.float32)
    return {"input_ids": ids * mask, "attention_mask": mask.long(), "response_mask": mask[:, PROMPT:].long(),
            "rewards": rewards, "index": torch.arange(ROWS) // N}


def _advantages(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    m = batch["response_mask"]
    scores = torch.zeros(m.shape, dtype=torch.float32)
    last = m.sum(1) - 1
    scores[torch.arange(ROWS), last] = batch["rewards"]
    adv, _ = compute_grpo_outcome_advantage(scores, m, batch["index"].numpy())
    return adv


def run_steps(model_dir: str, shape: Optional[MeshShape], rank: int, steps: int,
              checkpointing: bool = False, lora_rank: int = 0) -> dict[str, Any]:
    """``steps`` GRPO steps of the model in ``model_dir`` under ``shape`` (None: one rank, no process group), with
    gradient ``checkpointing`` or without, with LoRA adapters of ``lora_rank`` (portrl.workers.lora.apply_lora,
    ``[all-linear]``, as the actor applies them) or without; the results of the module docstring (every rank
    returns the same)."""
    torch.manual_seed(0)
    backend = get_backend("cpu")
    model = load_causal_lm(model_dir, "float32", backend=backend, gradient_checkpointing=checkpointing)
    if lora_rank > 0:
        model = apply_lora(model, ActorConfig(lora_rank=lora_rank, lora_alpha=2 * lora_rank,
                                              lora_target_modules=[ALL_LINEAR]))
    dp, dp_rank = 1, 0
    module: torch.nn.Module = ForwardModule(model, compute_logprobs)
    if shape is not None:
        pm = build_mesh("cpu", shape, rank)
        dp, dp_rank = shape.dp, pm.dp_rank
        module = wrap_model(module, "fsdp", backend, device=torch.device("cpu"), mesh=pm)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    batch = step_batch()
    adv = _advantages(batch)
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    tokens = int(batch["response_mask"].sum())
    info = {"dp_size": dp, "batch_num_tokens": tokens}
    # the rollout's log-probs: the policy's moved by a fixed offset, so ratios differ from 1 and some clip
    offset = 0.3 * torch.randn(ROWS, RESPONSE, generator=torch.Generator().manual_seed(1))[rows]
    out: dict[str, Any] = {"loss": [], "grad_norm": [], "logp": []}
    for _ in range(steps):
        logp, _ = module(batch["input_ids"][rows], batch["attention_mask"][rows], RESPONSE)
        loss, _ = compute_policy_loss_vanilla(logp.detach() + offset, logp, adv[rows], batch["response_mask"][rows],
                                              "token-mean", {"global_batch_info": info})
        loss.backward()
        out["grad_norm"].append(clip_grad_norm(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["logp"].append(_gather_rows(logp.detach(), shape).tolist())
        out["loss"].append(_sum_over_dp(loss.detach() / dp, shape))
    out["param_norms"] = {k: float(v.double().norm()) for k, v in full_state_dict(model).items()}
    return out


def _gather_rows(local: torch.Tensor, shape: Optional[MeshShape]) -> torch.Tensor:
    """The whole batch's rows from the data-parallel ranks' pieces (every rank gathers all, keeps one per group)."""
    if shape is None:
        return local
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local.contiguous())
    per_group = shape.sp * shape.tp
    return torch.cat(pieces[::per_group])


def _sum_over_dp(value: torch.Tensor, shape: Optional[MeshShape]) -> float:
    if shape is None:
        return float(value)
    t = value.reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / (shape.sp * shape.tp)


def rank_main(rank: int, case: MeshCase, model_dir: str, port: int, out_dir: str, steps: int) -> None:
    """One rank of ``case`` (a spawned process): join the gloo group, run the steps, rank 0 writes
    ``<out_dir>/<case.name>.json`` (written, then renamed); an error is written to ``<case>.rank<r>.error``."""
    torch.set_num_threads(1)
    try:
        init_distributed(get_backend("cpu"), rank, case.world, "127.0.0.1", port, timeout_s=300)
        result = run_steps(model_dir, case.shape, rank, steps, case.checkpointing, case.lora_rank)
        if rank == 0:
            tmp = Path(out_dir) / f".{case.name}.json.tmp"
            tmp.write_text(json.dumps({"case": asdict(case), **result}))
            tmp.rename(Path(out_dir) / f"{case.name}.json")
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reads it: a child's traceback would otherwise be lost
        (Path(out_dir) / f"{case.name}.rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        raise
