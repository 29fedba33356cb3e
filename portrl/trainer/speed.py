"""Speed you can judge: each step's MFU, tokens per second per device and distance from its roofline, from the
policy's shape (portrl/plan/shape.py), the counts of portrl/plan/flops.py and the backend's peak for the run's
device model and dtype (portrl/device/peaks.py; the cpu measures its own). docs/performance.md explains them.

Per step (verl's names where verl has the metric), with ``D`` the devices of a stage and ``P`` the peak::

    perf/mfu/actor        = train_flops(seqlens) * ppo_epochs / update seconds / (P.flops * D_update)
    perf/mfu/rollout      = rollout FLOPs (a shared prompt prefilled once) / generation seconds / (P.flops * D_rollout)
    perf/throughput       = tokens (prompts and responses) / step seconds / (D_update + separated rollout devices)
    perf/roofline/update  = (executed FLOPs / (P.flops * D_update)) / update seconds       (bound by FLOPs)
    perf/roofline/rollout = max(rollout FLOPs / (P.flops * D_rollout),
                                (weight bytes / rollout TP + cache bytes / D_rollout) / P.bytes) / generation seconds

Executed FLOPs count a prompt that rows share once (``model.share_prompts``), add the recomputed forward under
gradient checkpointing and leave out the layers' forward where the update replays the rollout's
(``model.reuse_rollout_forward``); verl's count in the MFU does neither, so it can pass 1 where portrl saves that
work. Each rollout replica (``D_rollout / TP``
of them) reads its weights at every decode step, so the weight bytes do not shrink with more replicas; the cache
bytes are shared out. A CPU counts as one device per node (its cores share the measured peak). A stage below
``1 / FLAG_FACTOR`` of its roofline on average is flagged in the run summary (:func:`speed_lines`). Without a peak
figure (a device model that has none) only ``perf/throughput`` is logged, and the summary says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from portrl.device.peaks import named_model
from portrl.errors import UserError
from portrl.plan.flops import (executed_train_flops, prefill_flops, rollout_flops, rollout_read_bytes,
                               train_flops)
from portrl.plan.memory import DTYPE_BYTES
from portrl.plan.shape import ModelShape, shape_of_config
from portrl.workers.setup import AUTO_CHECKPOINTING_PARAMS, resolve_dtype

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.device.backend import Backend
    from portrl.workers.batch import Batch

FLAG_FACTOR = 2.0  # a stage this many times slower than its roofline is flagged
STAGES = {"update": "bound by FLOPs", "rollout": "bound by its memory reads or FLOPs, the larger"}


class StepSpeed:
    """The speed metrics of a run's steps: :meth:`step` per step, :meth:`summary` at the end."""

    def __init__(self, cfg: PortRLConfig, backend: Backend, trainer_workers: int, rollout_workers: int | None):
        """``rollout_workers``: the separated rollout workers (None when the rollout runs on the trainer's)."""
        self.no_count = ""
        try:
            self.shape: ModelShape | None = shape_of_config(cfg)
        except UserError as exc:  # a family portrl has no FLOP count for: throughput only, the summary says why
            self.shape, self.no_count = None, str(exc)
        self.dtype = resolve_dtype(cfg, backend)
        flag = cfg.model.gradient_checkpointing
        self.checkpointing = bool(flag) if flag is not None else (
            self.shape is not None and self.shape.params >= AUTO_CHECKPOINTING_PARAMS)
        self.epochs = int(cfg.actor.ppo_epochs)
        m = cfg.model
        self.shares_prompts = bool(m.use_packing) and bool(m.share_prompts)
        # the update replays the rollout's recorded forward (portrl.workers.actor._can_record_forward, as far as the
        # config tells) for the rows of its first optimizer step
        self.replays = (bool(m.reuse_rollout_forward) and trainer_workers == 1 and rollout_workers is None
                        and cfg.rollout.engine == "hf" and self.shares_prompts and not cfg.rollout.multi_turn.enable)
        self.mini_rows = int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n)
        self.tp = int(cfg.rollout.tensor_model_parallel_size) if cfg.rollout.engine != "hf" else 1
        per_node = backend.device_type == "cpu"
        self.update_devices = int(cfg.trainer.nnodes) if per_node else trainer_workers
        separated = 0 if rollout_workers is None else rollout_workers * (1 if per_node else self.tp)
        self.rollout_devices = separated or self.update_devices
        self.all_devices = self.update_devices + separated
        self.backend, self.model = backend, cfg.device.model
        if self.model:  # device.name=auto skips the config's check: an unknown model stops the run before step 1
            named_model(backend.device_models, str(self.model), backend.name)
        self._peak: Any = False  # measured or looked up at the first step (the cpu measures for under a second)

    @property
    def peak(self):
        if self._peak is False:
            self._peak = self.backend.peak_throughput(self.dtype, self.model)
        return self._peak

    def step(self, batch: Batch, times: Mapping[str, float]) -> dict[str, float]:
        """This step's metrics from its batch (``attention_mask``, ``response_mask``) and phase seconds (``gen``,
        ``update_actor``, ``step``: portrl.trainer.metrics.Timer)."""
        total = batch.tensors["attention_mask"].sum(-1).tolist()
        responses = batch.tensors["response_mask"].sum(-1).tolist()
        prompts = [int(t) - int(r) for t, r in zip(total, responses)]
        m = {"perf/throughput": sum(total) / max(times.get("step", 0.0), 1e-9) / self.all_devices}
        shape, peak = self.shape, self.peak if self.shape is not None else None
        if peak is None or shape is None:
            return m
        update_s, gen_s = times.get("update_actor", 0.0), times.get("gen", 0.0)
        if update_s > 0:
            seqlens = [int(t) for t in total]
            flops_s = peak.flops_per_s * self.update_devices
            m["perf/mfu/actor"] = train_flops(shape, seqlens) * self.epochs / update_s / flops_s
            m["perf/roofline/update"] = self._executed(shape, batch, seqlens, prompts) / update_s / flops_s
        if gen_s > 0:
            rows = [int(r) for r in responses]
            flops = rollout_flops(shape, prompts, rows) - self._shared_prefill(shape, batch, prompts)
            weights, cache = rollout_read_bytes(shape, prompts, rows, DTYPE_BYTES.get(self.dtype, 4))
            flops_s = peak.flops_per_s * self.rollout_devices
            read_s = (weights / self.tp + cache / self.rollout_devices) / peak.bytes_per_s
            m["perf/mfu/rollout"] = flops / gen_s / flops_s
            m["perf/roofline/rollout"] = max(flops / flops_s, read_s) / gen_s
        return m

    @staticmethod
    def _shared_prefill(shape: ModelShape, batch: Batch, prompts: list[int]) -> float:
        """The prefill FLOPs of rows whose prompt another row of the same ``uid`` already prefilled (the hf engine
        prefills a prompt once for its ``n`` samples; an engine's prefix cache does the same)."""
        seen: set = set()
        repeated = 0.0
        for uid, p in zip(batch.meta.get("uid", ()), prompts):
            if uid in seen:
                repeated += prefill_flops(shape, p)
            seen.add(uid)
        return repeated

    def _executed(self, shape: ModelShape, batch: Batch, seqlens: list[int], prompts: list[int]) -> float:
        """The update's executed FLOPs over its epochs: a prompt its rows share run once (``uid``), and less the
        layers' forward of the rows whose first optimizer step replays the rollout's (``2 L layer_matmul_params T +
        4 sum(s^2) d a L`` of their share of the batch)."""
        run = sum(seqlens)
        if self.shares_prompts and "uid" in batch.meta:
            firsts = {uid: p for uid, p in zip(batch.meta["uid"], prompts)}
            run -= sum(prompts) - sum(firsts.values())
        flops = executed_train_flops(shape, seqlens, self.checkpointing, tokens=run) * self.epochs
        if self.replays:
            share = min(1.0, self.mini_rows / max(len(seqlens), 1))
            layers = shape.layers * shape.layer_matmul_params
            width = shape.layers * shape.heads * shape.head_dim
            flops -= share * (2.0 * layers * run + 4.0 * sum(s * s for s in seqlens) * width)
        return flops

    def summary(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """``{"speed": lines}`` for the run summary (:func:`speed_lines` over the steps' records)."""
        if self.shape is None:
            return {"speed": [f"no MFU or rooflines: {self.no_count}"]}
        peak = self.peak
        source = None if peak is None else peak.source
        return {"speed": speed_lines(records, source, self.model or self.backend.device_name() or self.backend.name)}


def speed_lines(records: Sequence[Mapping[str, Any]], source: str | None, device: str) -> list[str]:
    """The run summary's speed lines: none where every stage is within ``FLAG_FACTOR`` of its roofline on average
    over ``records``; one per stage that is not (its mean share, its bound, the peak's ``source``); one line when
    the device has no peak figure."""
    if source is None:
        return [f"no peak figure for {device} (docs/performance.md): MFU and rooflines not measured"]
    lines = []
    for stage, bound in STAGES.items():
        shares = [float(r[f"perf/roofline/{stage}"]) for r in records if f"perf/roofline/{stage}" in r]
        if shares and sum(shares) / len(shares) < 1.0 / FLAG_FACTOR:
            mean = sum(shares) / len(shares)
            lines.append(f"{stage} at {100 * mean:.1f}% of its roofline ({bound}), more than {FLAG_FACTOR:g}x off; "
                         f"peak: {source}")
    return lines
