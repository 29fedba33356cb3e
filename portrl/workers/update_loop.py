"""The training loop every trained model shares (actor, critic, implicit PRM, SFT): one update on a batch of rows.

For each of ``epochs`` passes (rows shuffled per epoch when ``shuffle_seed`` is set), the batch is cut into
mini-batches of ``mini_rows`` rows (one optimizer step each); every mini-batch into micro-batches of at most
``micro_rows`` rows and ``max_tokens`` non-pad tokens (gradient accumulation). Data-parallel ranks run the same
number of passes (:func:`portrl.workers.training.same_piece_count`: each forward is a collective). Each
micro-batch loss is aggregated with the *global* counts of its mini-batch (tokens and sequences on all ranks,
:func:`portrl.workers.training.global_counts`), so micro-batching and data parallelism do not change the update.
After each mini-batch: gradients clipped to ``grad_clip`` and the optimizer step
(:func:`portrl.workers.training.clip_and_step`); after the step: the LR schedule advances once.

Non-finite updates are skipped (as torch AMP's GradScaler and verl's actor do): when the mini-batch's loss (the sum of
its micro-batch losses) or its gradient norm is NaN or infinite, its optimizer step is not taken (gradients zeroed,
no parameter change, no step of the optimizer's moments or step count). The decision is the same on every
data-parallel rank (the norm is global; a non-finite loss on any rank counts for all). The LR schedule still
advances once per update: it is a function of the RL step (``trainer.total_steps``), so a skipped step does not
shift the rest of it. ``<prefix>/nonfinite_skipped`` counts the skipped optimizer steps of the update; the trainer
stops a run whose updates keep being skipped (``trainer.max_nonfinite_steps``, portrl.trainer.divergence).

A worker supplies its loss on one micro-batch, ``loss_fn(micro, counts, pos) -> (loss, metrics)``: ``micro`` on
the training device; ``counts`` the keyword arguments of ``portrl.algo.agg_loss`` (``dp_size``,
``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) plus whatever ``extra_counts(mini)`` adds;
``pos`` the :class:`Position` of the pass (epoch, optimizer steps done so far).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import re
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from portrl.workers.batch import Batch
from portrl.workers.offload import saved_on_host
from portrl.workers.training import (
    all_reduce_max,
    clip_and_step,
    combine_micro_metrics,
    global_counts,
    mean_metrics,
    same_piece_count,
    split_micro_batches,
)


@dataclass(frozen=True)
class LoopSettings:
    """What one update needs to know (from the worker's config section, not the run config).

    ``mini_rows``: rows of one mini-batch on this rank (:func:`mini_batch_rows`); ``micro_rows`` / ``max_tokens``:
    the micro-batch limits (``max_tokens`` None = rows only; ``shared_prompts``: count a prompt once per micro-batch,
    :func:`~portrl.workers.training.split_micro_batches`); ``shuffle_seed``: epoch e permutes the rows with
    ``torch.Generator().manual_seed(shuffle_seed + e)`` (None = keep the order); ``loss_scale_factor``: the
    ``agg_loss`` constant of the seq-mean-token-sum-norm mode (``data.max_response_length``); ``offload_activations``:
    each micro-batch's forward runs under :func:`portrl.workers.offload.saved_on_host`."""

    epochs: int
    mini_rows: int
    micro_rows: int
    max_tokens: Optional[int]
    grad_clip: float
    loss_scale_factor: int
    world_size: int = 1
    shuffle_seed: Optional[int] = None
    shared_prompts: bool = False
    offload_activations: bool = False  # saved tensors in host memory until backward (portrl.workers.offload)


class Position(NamedTuple):
    """Where a micro-batch sits in the update: its epoch, the optimizer steps taken before it, and whether it is
    the last micro-batch of its mini-batch (the last before that optimizer step)."""

    epoch: int
    steps_done: int
    last_micro: bool = True


@dataclass
class Trainable:
    """A worker's trained state: the module forwards run through (a data-parallel wrapper or the plain model),
    its float32 masters (:class:`~portrl.workers.master_weights.MasterWeights`), optimizer, LR scheduler, device."""

    module: torch.nn.Module
    master: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device


LossFn = Callable[[Batch, Dict[str, Any], Position], Tuple[torch.Tensor, Dict[str, float]]]


def mini_batch_rows(mini_batch_size: int, n: int, world_size: int) -> int:
    """Rows of one mini-batch on each of ``world_size`` ranks: ``actor.ppo_mini_batch_size * rollout.n /
    world_size`` (prompts times samples, shared over the ranks)."""
    rows = int(mini_batch_size) * int(n) // world_size
    if rows < 1:
        raise ValueError(f"actor.ppo_mini_batch_size * rollout.n ({int(mini_batch_size) * int(n)}) is smaller than "
                         f"the number of workers ({world_size})")
    return rows


def run_update(state: Trainable, batch: Batch, settings: LoopSettings, loss_fn: LossFn, *, prefix: str,
               additive: frozenset = frozenset(), extra_counts: Optional[Callable[[Batch], Dict[str, Any]]] = None,
               advance_schedule: bool = True, set_mode: bool = True) -> Dict[str, float]:
    """One update of ``state`` on ``batch`` (see the module docstring). The module is in train mode during it and
    in eval mode after. Returns the mean over mini-batches of their metrics (a mini-batch's metrics: the keys in
    ``additive`` summed over its micro-batches -- partial sums of a loss aggregated with global counts --, the
    others averaged), ``<prefix>/grad_norm`` (mean over steps, before clipping; NaN when one was not finite),
    ``<prefix>/nonfinite_skipped`` (optimizer steps skipped for a non-finite loss or gradient norm, see the module
    docstring) and ``<prefix>/lr`` (after the schedule step). ``advance_schedule=False`` leaves the LR schedule
    where it is; ``set_mode=False`` leaves the train / eval mode to the caller (the SFT's steps, each an update:
    a transformers model's ``train()`` walks every submodule)."""
    s, world = settings, settings.world_size
    if set_mode:
        state.module.train()
    rows: List[Dict[str, float]] = []
    norms: List[float] = []
    skipped = 0
    for epoch in range(s.epochs):
        data = batch
        if s.shuffle_seed is not None:
            g = torch.Generator().manual_seed(s.shuffle_seed + epoch)
            data = batch.select(torch.randperm(len(batch), generator=g))
        for mini in same_piece_count(data, data.split(s.mini_rows), world):
            tokens, seqs = global_counts(mini.tensors["response_mask"], world)
            counts = {"dp_size": world, "batch_num_tokens": tokens, "global_batch_size": seqs,
                      "loss_scale_factor": s.loss_scale_factor}
            if extra_counts is not None:
                counts.update(extra_counts(mini))
            state.master.zero_grad()
            micro_rows: List[Dict[str, float]] = []
            micros = same_piece_count(mini, split_micro_batches(mini, s.micro_rows, s.max_tokens, s.shared_prompts), world)
            total = None  # the mini-batch's loss (its micro-batch losses summed), checked once before the step
            for i, micro in enumerate(micros):
                pos = Position(epoch, len(norms), i == len(micros) - 1)
                with saved_on_host(s.offload_activations, state.device):
                    loss, metrics = loss_fn(micro.to(state.device), counts, pos)
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
                micro_rows.append(metrics)
            rows.append(combine_micro_metrics(micro_rows, additive))
            bad_loss = total is not None and not math.isfinite(float(total))
            bad_loss = all_reduce_max([float(bad_loss)], world)[0] > 0  # every rank skips, or none
            norm = clip_and_step(state.optimizer, state.master, s.grad_clip, skip=bad_loss)
            skipped += int(bad_loss or not math.isfinite(norm))
            norms.append(norm)
    if advance_schedule:
        with warnings.catch_warnings():
            if skipped == len(norms):  # torch warns of a schedule stepped before any optimizer step: wanted here
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            state.scheduler.step()
    if set_mode:
        state.module.eval()
    out = mean_metrics(rows)
    out[f"{prefix}/grad_norm"] = sum(norms) / max(1, len(norms))
    out[f"{prefix}/nonfinite_skipped"] = float(skipped)
    out[f"{prefix}/lr"] = float(state.optimizer.param_groups[0]["lr"])
    return out
