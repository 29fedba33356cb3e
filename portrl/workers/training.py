"""Pieces shared by the actor and critic updates: optimizer, LR schedule, batch splitting, global counts, RNG.

Global counts: a loss aggregated with ``agg_loss`` over micro-batches must divide by the token /
sequence count of the *whole mini-batch on all data-parallel ranks*; :func:`global_counts` sums the
local counts with ``torch.distributed.all_reduce`` when a process group is initialised and
``world_size > 1`` (the wrapped model averages gradients over ranks; ``agg_loss`` multiplies by
``dp_size`` to undo that average), so N ranks give the update of one rank on the whole batch.

Under a mesh with sequence or tensor parallelism (portrl.workers.mesh) several ranks hold the same rows; these
sums and maxima then run over the data-parallel group only (:func:`set_data_parallel_group`: one rank per piece of
rows), so a piece is counted once, and ``world_size`` means the data-parallel size.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from portrl.algo.rollout_correction import correction_metrics
from portrl.workers.batch import Batch
from portrl.workers.parallel import clip_grad_norm  # plain and DTensor (FSDP2) gradients alike

if TYPE_CHECKING:
    from portrl.config.schema import ActorConfig, ModelConfig, PortRLConfig

SCHEDULERS = ("constant", "cosine", "linear")


def build_optimizer(params, optim_cfg: Mapping[str, Any], fused: bool = True) -> torch.optim.Optimizer:
    """AdamW with lr, betas, eps and weight_decay from ``optim_cfg`` (an OptimConfig), its state allocated now
    (:func:`allocate_adamw_state`).

    The fused implementation (one kernel per step instead of a dozen multi-tensor passes) where
    torch offers it for the parameters' device and dtype (and ``fused``), else the multi-tensor (foreach) one.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    betas = tuple(float(b) for b in optim_cfg["betas"])
    if len(betas) != 2:
        raise ValueError(f"optim.betas must have two values, got {list(betas)}")
    kwargs: dict[str, Any] = dict(lr=float(optim_cfg["lr"]), betas=betas, eps=float(optim_cfg["eps"]),
                  weight_decay=float(optim_cfg["weight_decay"]))
    optimizer: Optional[torch.optim.AdamW] = None
    try:
        if fused:
            optimizer = torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # fused kernels not available for this device / dtype / tensor type
        pass
    if optimizer is None:
        optimizer = torch.optim.AdamW(params, foreach=True, **kwargs)
    allocate_adamw_state(optimizer)
    return optimizer


def allocate_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Give every parameter the state AdamW's first step would create (step 0, zero moments) now, through
    ``load_state_dict`` (torch's own rules for the step counter's dtype and device): the first step then updates
    bit for bit as it would have. Allocated with the model, the moments take their place in memory before the
    first rollout's buffers; created at the end of the first update they took the freed buffers' place, and the
    second step's rollout allocated ~2 GiB afresh and decoded slower (docs/performance.md). For a new optimizer: any
    state it held is replaced."""
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
    state = {i: {"step": torch.tensor(0.0, dtype=step_dtype), "exp_avg": torch.zeros_like(p),
                 "exp_avg_sq": torch.zeros_like(p)} for i, p in zip(ids, params)}
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def clip_and_step(optimizer: torch.optim.Optimizer, master, clip: float, skip: bool = False) -> float:
    """One optimizer step over ``master`` (a :class:`~portrl.workers.master_weights.MasterWeights` whose
    masters the optimizer holds): gradients to the float32 masters, clipped to total L2 norm ``clip``
    (``clip <= 0`` only measures), the step (skipped when the norm is not finite or ``skip`` is set: then no
    parameter and no optimizer state changes), the masters rounded back into the compute parameters, every
    gradient freed. Returns the norm before clipping (measured also when skipped: under FSDP2 a collective)."""
    master.grads_to_masters()
    norm = clip_grad_norm(master.masters, clip)
    if math.isfinite(norm) and not skip:
        optimizer.step()
        master.masters_to_params()
    master.zero_grad()
    return norm


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, scheduler: str, min_lr_ratio: float) -> float:
    """LR factor at optimizer step ``step`` (0-based): linear warm-up ``(step+1)/warmup`` for ``step < warmup``,
    then constant 1, cosine ``m + (1-m)(1+cos(pi p))/2`` or linear ``1 - (1-m) p`` with progress
    ``p = (step-warmup)/(total-warmup)`` clamped to [0, 1] and ``m = min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    p = min(1.0, max(0.0, (step - warmup_steps) / span))
    if scheduler == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if scheduler == "linear":
        return 1.0 - (1 - min_lr_ratio) * p
    raise ValueError(f"optim.scheduler {scheduler!r} is unknown; valid: {list(SCHEDULERS)}")


def build_lr_scheduler(optimizer, optim_cfg: Mapping[str, Any], total_steps: int):
    """A LambdaLR stepped once per RL step, following :func:`lr_multiplier`."""
    sched = str(optim_cfg["scheduler"])
    if sched not in SCHEDULERS:
        raise ValueError(f"optim.scheduler {sched!r} is unknown; valid: {list(SCHEDULERS)}")
    warmup = int(optim_cfg["warmup_steps"]) or int(float(optim_cfg["warmup_ratio"]) * total_steps)
    m = float(optim_cfg["min_lr_ratio"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total_steps, warmup, sched, m))


def rescale_lr(state: Mapping[str, Any], lr: float) -> Optional[str]:
    """A trained model's state (``{"optimizer": {"param_groups"}, "scheduler": {"base_lrs", "_last_lr"}}``) saved
    with another base learning rate than ``lr``, rescaled in place so that the schedule continues from the saved
    step with base ``lr``. Returns what changed, ``"changed since the checkpoint (<old> -> <lr>): ..."`` (the
    caller puts the config key in front), None when nothing did."""
    sched = state.get("scheduler") or {}
    base = [float(b) for b in sched.get("base_lrs", [])]
    lr = float(lr)
    if not base or all(b == lr for b in base):
        return None
    for i, group in enumerate(state.get("optimizer", {}).get("param_groups", [])):
        old = base[min(i, len(base) - 1)]
        group["lr"] = float(group.get("lr", old)) * lr / old if old else lr
        group["initial_lr"] = lr
    if isinstance(sched.get("_last_lr"), list):
        sched["_last_lr"] = [float(v) * lr / b if b else lr for v, b in zip(sched["_last_lr"], base)]
    sched["base_lrs"] = [lr] * len(base)
    return (f"changed since the checkpoint ({base[0]:g} -> {lr:g}): the learning-rate schedule continues "
            f"from step {sched.get('last_epoch', '?')} with the new base rate")


_DATA_GROUP: list = [None]  # the data-parallel process group of this process's mesh (None: the default group)


def set_data_parallel_group(group: Any) -> None:
    """The process group the sums and maxima of this module run over (a worker process trains one model, so one
    group per process; portrl.workers.trained_model sets it when it builds a mesh; None: the default group)."""
    _DATA_GROUP[0] = group


def dist_active(world_size: int) -> bool:
    return world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce_sum(values: List[float], world_size: int) -> List[float]:
    """Sum a few numbers over the data-parallel group (identity on one rank). float64 keeps counts exact."""
    if not dist_active(world_size):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=_DATA_GROUP[0])
    return t.tolist()


def all_reduce_max(values: List[float], world_size: int) -> List[float]:
    """The maximum of a few numbers over the data-parallel group (identity on one rank)."""
    if not dist_active(world_size):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=_DATA_GROUP[0])
    return t.tolist()


def global_counts(response_mask: torch.Tensor, world_size: int) -> Tuple[int, int]:
    """(tokens, sequences) of a mini-batch summed over all data-parallel ranks."""
    tokens, seqs = all_reduce_sum([float(response_mask.sum()), float(response_mask.shape[0])], world_size)
    return int(tokens), int(seqs)


def shares_prompts(model_cfg: ModelConfig) -> bool:
    """Whether packed training forwards run each distinct prompt of a micro-batch once (``model`` config section)."""
    return bool(model_cfg.use_packing) and bool(model_cfg.share_prompts)


def same_piece_count(batch: Batch, pieces: List[Batch], world_size: int) -> List[Batch]:
    """``pieces`` (a split of ``batch``), re-cut so every data-parallel rank holds the same number of them.

    Each forward of a wrapped model is a collective (FSDP2 gathers parameters, DDP syncs buffers and
    all-reduces gradients on backward), as is each mini-batch's :func:`global_counts`, so the ranks must run
    the same number of passes. When their counts differ (uneven rows, a token budget), every rank re-cuts its
    rows into the largest count with ``Batch.chunk`` (pieces may then exceed the micro-batch size a little).
    """
    if not dist_active(world_size):
        return pieces
    t = torch.tensor([len(pieces)], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=_DATA_GROUP[0])
    count = int(t.item())
    if count == len(pieces):
        return pieces
    if len(batch) < count:
        raise ValueError(f"data-parallel rank holds {len(batch)} rows but another rank runs {count} passes; give "
                         f"every worker the same number of rows (batch rows divisible by the number of workers)")
    return batch.chunk(count)


def split_micro_batches(batch: Batch, micro_size: int, max_tokens: Optional[int] = None,
                        shared_prompts: bool = False) -> List[Batch]:
    """Micro-batches of at most ``micro_size`` rows, and, with ``max_tokens``, at most that many
    tokens each (a single longer row still gets its own micro-batch). Order is kept.

    A row's tokens are its non-pad tokens; with ``shared_prompts`` (the packed forward runs each distinct prompt of
    a micro-batch once: model.share_prompts) a row whose prompt is the previous row's in the same micro-batch
    counts its response tokens only, so the budget measures what the forward runs."""
    if max_tokens is None:
        return batch.split(max(1, micro_size))
    mask = batch.tensors["attention_mask"]
    full = mask.sum(-1).tolist()
    after_first = list(full)  # a row's tokens when it is not its micro-batch's first (its prompt may be shared)
    if shared_prompts and "responses" in batch and len(full) > 1:
        split = mask.shape[1] - batch.tensors["responses"].shape[1]
        ids, pm = batch.tensors["input_ids"][:, :split], mask[:, :split]
        same = ((ids[1:] == ids[:-1]) & (pm[1:] == pm[:-1])).all(-1).tolist()
        after_first[1:] = [n - p if s else n for n, p, s in zip(full[1:], pm[1:].sum(-1).tolist(), same)]
    out, start, used = [], 0, 0
    for i in range(len(full)):
        n = after_first[i] if i > start else full[i]
        if i > start and (used + n > max_tokens or i - start >= micro_size):
            out.append(batch.slice(start, i))
            start, used, n = i, 0, full[i]
        used += n
    if start < len(batch):
        out.append(batch.slice(start, len(batch)))
    return out


def inference_micro_batches(batch: Batch, actor_cfg: ActorConfig, world_size: int, shared_prompts: bool = False) -> List[Batch]:
    """``batch`` cut for a no-grad forward (log-probs, values): micro-batches of at most
    ``4 * actor_cfg.ppo_micro_batch_size_per_device`` rows and ``actor_cfg.max_tokens_per_micro_batch`` tokens
    (:func:`split_micro_batches`, with ``shared_prompts``; ``actor_cfg`` is the ``actor`` config section), then
    re-cut so all ``world_size`` data-parallel ranks run the same number of forwards (:func:`same_piece_count`: a
    sharded model's forward is a collective). Pass ``world_size=1`` for a module each rank runs alone (no re-cut)."""
    pieces = split_micro_batches(batch, 4 * int(actor_cfg.ppo_micro_batch_size_per_device),
                                 actor_cfg.max_tokens_per_micro_batch, shared_prompts)
    return same_piece_count(batch, pieces, world_size)


def rng_state() -> Dict[str, Any]:
    """torch (host), python and numpy RNG states."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def mean_metrics(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """Mean of each key over the dicts that have it."""
    acc: Dict[str, List[float]] = {}
    for r in rows:
        for k, v in r.items():
            acc.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def combine_micro_metrics(rows: List[Dict[str, float]], additive: frozenset) -> Dict[str, float]:
    """One mini-batch's metrics from its micro-batches: keys in ``additive`` summed (partial sums of a
    loss aggregated with global counts), the others averaged."""
    out: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    for r in rows:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    return {k: (v if k in additive else v / counts[k]) for k, v in out.items()}


def rollout_gap_metrics(gaps: List[Dict[str, float]], world_size: int) -> Dict[str, float]:
    """verl's ``training/rollout_probs_diff_{mean,max}`` (``|p_trainer - p_rollout|``) and the same in log space,
    over every response token of the step on every rank, from per-micro-batch sums and maxima (``probs_sum``,
    ``log_probs_sum``, ``tokens``, ``probs_max``, ``log_probs_max``). Every rank calls it (collectives)."""
    keys = ("probs_sum", "log_probs_sum", "tokens")
    sums = all_reduce_sum([sum(g[k] for g in gaps) for k in keys], world_size)
    maxes = all_reduce_max([max((g[k] for g in gaps), default=0.0) for k in ("probs_max", "log_probs_max")],
                           world_size)
    if sums[2] == 0:
        return {}
    return {"training/rollout_probs_diff_mean": sums[0] / sums[2], "training/rollout_probs_diff_max": maxes[0],
            "training/rollout_log_probs_diff_mean": sums[1] / sums[2],
            "training/rollout_log_probs_diff_max": maxes[1]}


def rollout_corr_metrics(parts: List[Dict[str, float]], world_size: int) -> Dict[str, float]:
    """verl's ``rollout_corr/*`` metrics over every response token of the step on every rank, from per-micro-batch
    partial statistics (:func:`portrl.algo.rollout_correction.correction_stats`: keys ending in ``_max`` combine by
    maximum, the others by sum). Every rank calls it (collectives); empty when there were none."""
    if not parts:
        return {}
    keys = sorted(parts[0])
    maxed = [k for k in keys if k.endswith("_max")]
    summed = [k for k in keys if k not in maxed]
    sums = all_reduce_sum([sum(p[k] for p in parts) for k in summed], world_size)
    maxes = all_reduce_max([max(p[k] for p in parts) for k in maxed], world_size)
    return correction_metrics({**dict(zip(summed, sums)), **dict(zip(maxed, maxes))})
