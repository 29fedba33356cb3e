"""Which prompt groups of a generation batch the step trains on (the trainer's dynamic sampling keeps generating
until ``data.train_batch_size`` groups pass; ``portrl/trainer/rl_trainer.py``).

Filters, each on when its key says so; a group must pass every filter that is on:

* DAPO's dynamic sampling (``algorithm.filter_groups``): the group's metric is not the same for all its rows
  (``portrl.algo.filter_groups``);
* verl's accuracy filter of recipe/prime (``data.filter_accuracy``): the group's mean accuracy is within
  ``[data.accuracy_lower_bound, data.accuracy_upper_bound]`` (``portrl.algo.implicit_prm.accuracy_band_keep``);
* verl's truncation filter (``data.filter_truncate``): no response of the group reached
  ``data.max_response_length − 1`` tokens (all its valid tokens: a multi-turn response's tool tokens count,
  portrl.workers.batch.response_lengths).

verl's recipe samples ``data.oversample_factor`` times the prompts at once and fills the batch with failing groups
when too few pass; here more batches are generated (up to ``algorithm.filter_groups.max_num_gen_batches``) and the
step trains on the groups that passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portrl.algo import filter_groups
from portrl.algo.implicit_prm import accuracy_band_keep, untruncated_keep
from portrl.trainer.advantage_phase import seq_metric
from portrl.workers.batch import Batch, response_lengths

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def group_filter_enabled(cfg: PortRLConfig) -> bool:
    """Whether any group filter is on (the trainer then samples until enough groups pass)."""
    return bool(cfg.algorithm.filter_groups.enable or cfg.data.filter_accuracy or cfg.data.filter_truncate)


def keep_groups(cfg: PortRLConfig, batch: Batch) -> torch.Tensor:
    """A bool ``(B,)`` mask of the rows whose prompt group passes every filter that is on."""
    uid, d = batch.meta["uid"], cfg.data
    keep = torch.ones(len(batch), dtype=torch.bool)
    if cfg.algorithm.filter_groups.enable:
        keep &= filter_groups(uid, seq_metric(cfg, batch))
    if d.filter_accuracy:
        keep &= accuracy_band_keep(uid, batch.tensors["acc"], float(d.accuracy_lower_bound),
                                   float(d.accuracy_upper_bound))
    if d.filter_truncate:
        keep &= untruncated_keep(uid, response_lengths(batch), int(d.max_response_length))
    return keep
