"""Where a step's generation batches come from: asked for when the step needs them (``trainer.mode=sync``), or
generated ahead on the separated rollout workers while the actor trains (``one_step_off``, ``async``).

Policy versions: version v is the policy after step v's update (0: the starting policy); the trainer sends each
version to the rollout workers right after its update (portrl/workers/partial_rollout.py stages it there). A
request asked for while the trainer had sent version v is generated with version v or newer.

Schedule (one rule for every mode): when a step takes a generation batch it takes the oldest request in flight (or
asks for one and waits), then keeps ``depth`` requests in flight, asked for now, so that they generate while the
step trains. A request asked for at step k (version k-1) is trained at step k+depth at the latest (version
k+depth-1), so no token lags the policy it updates by more than ``depth`` versions:

* ``sync``: depth 0; nothing generates during an update (the rollout waits for the update, the update for the
  rollout);
* ``one_step_off``: depth 1, no partial rollout: batch k+1 generates with version k-1 while step k trains
  (verl's one-step-off-policy trainer);
* ``async``: depth ``async_training.max_staleness`` with ``stale_samples=wait``; with ``drop`` one request more is
  in flight (the rollout never idles) and a request whose oldest token lags more than ``max_staleness`` versions
  when taken is asked for again (same prompts, newest weights) in its place: its samples are dropped and counted.
  With ``partial_rollout`` new weights stop the generations in flight, which continue under them, so tokens lag
  less than whole requests. ``max_staleness=0`` is the synchronous run, sample for sample.

Generation seeds: a request asked for at step k to be trained at step k+i gets ``generation_seed(cfg, k+i, j)``
with j counting that step's requests, so a run without prefetch (depth 0) samples exactly what ``sync`` samples.

Checkpoints keep the data position before the oldest request in flight (:meth:`RolloutPipeline.data_state`):
requests in flight at a stop are lost, and a resumed run asks for their prompts again with the resumed policy.
Every prompt of an epoch is trained on once across a stop and resume.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Optional, Tuple

from portrl.trainer.generation import Generates, generation_seed, sampling_params
from portrl.workers.batch import Batch
from portrl.workers.partial_rollout import staleness_metrics

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncPlan:
    """How a run's rollout overlaps its training (see the module docstring)."""

    mode: str
    max_staleness: int  # the most versions a trained token may lag
    depth: int  # requests kept in flight beyond the one a step takes
    drop: bool  # requests over the bound are generated again
    partial: bool  # new weights stop and continue generations in flight

    @property
    def overlaps(self) -> bool:
        return self.mode != "sync"


def async_plan(cfg: PortRLConfig) -> AsyncPlan:
    """The :class:`AsyncPlan` of ``cfg.trainer.mode`` and ``cfg.async_training``."""
    mode = str(cfg.trainer.mode)
    if mode == "sync":
        return AsyncPlan(mode, 0, 0, False, False)
    if mode == "one_step_off":
        return AsyncPlan(mode, 1, 1, False, False)
    a = cfg.async_training
    s, drop = int(a.max_staleness), str(a.stale_samples) == "drop"
    return AsyncPlan(mode, s, s + 1 if drop else s, drop, bool(a.partial_rollout))


def batch_index(state: Dict[str, Any], batch_size: int) -> int:
    """The index, counted from the run's first, of the prompt batch a dataset in ``state`` draws next."""
    return int(state["epoch"]) * (int(state["num_rows"]) // batch_size) + int(state["position"]) // batch_size


@dataclass
class Request:
    key: Tuple[int, int]  # (step, j) of its generation seed
    prompts: Batch
    data_state: Dict[str, Any]  # the dataset's position before its prompts were drawn
    index: int  # its prompt batch's index in the run (batch_index)
    version: int  # the version the trainer had sent when it was asked for
    call: Any  # portrl.workers.group.PendingCall


class RolloutPipeline:
    """Generation requests of one run on ``gen`` (a WorkerGroup of rollout workers, or the colocated actor in sync
    mode): ``draw()`` gives the next prompt Batch, ``data_state()`` the dataset's position."""

    def __init__(self, cfg: PortRLConfig, gen: WorkerGroup[Generates], draw: Callable[[], Batch],
                 data_state: Callable[[], Dict[str, Any]]):
        self.cfg, self.gen, self.draw, self.dataset_state = cfg, gen, draw, data_state
        self.plan = async_plan(cfg)
        self.queue: Deque[Request] = deque()
        self._seeds: Dict[int, int] = {}  # step -> requests keyed with it so far
        self.dropped = 0  # samples dropped for staleness since the last metrics()

    def _ask(self, for_step: int, version: int, extra: Dict[str, Any], again: Optional[Request] = None) -> Request:
        j = self._seeds.get(for_step, 0)
        self._seeds[for_step] = j + 1
        if again is None:
            state = self.dataset_state()
            prompts, index = self.draw(), batch_index(state, int(self.cfg.data.train_batch_size))
        else:
            state, prompts, index = again.data_state, again.prompts, again.index
        sampling = sampling_params(self.cfg, generation_seed(self.cfg, for_step, j))
        kwargs = dict(extra, min_version=version) if self.plan.overlaps else dict(extra)
        call = self.gen.submit(Generates.generate_from, prompts, sampling, **kwargs)
        return Request((for_step, j), prompts, state, index, version, call)

    def take(self, step: int, version: int, extra: Optional[Dict[str, Any]] = None) -> Tuple[Batch, Batch, int]:
        """``(prompts, generated batch, prompt batch index)`` of the oldest request (asked for now when none is in
        flight), then requests asked for up to the plan's depth; ``version``: the trainer's (sent) policy version;
        ``extra``: keyword arguments of the generate calls (the colocated actor's ``for_update``)."""
        extra = dict(extra or {})
        req = self.queue.popleft() if self.queue else self._ask(step, version, extra)
        batch = req.call.batch()
        if self.plan.drop and _oldest(batch, req.version) < version - self.plan.max_staleness:
            self.dropped += len(batch)
            log.debug("request %s: oldest token version %d lags version %d by more than %d: generated again",
                      req.key, _oldest(batch, req.version), version, self.plan.max_staleness)
            req = self._ask(step, version, extra, again=req)
            batch = req.call.batch()
            if _oldest(batch, version) < version:
                raise RuntimeError(f"a request asked for with min_version={version} came back with tokens of "
                                   f"version {_oldest(batch, version)}: the rollout worker ignored min_version")
        self._seeds = {s: n for s, n in self._seeds.items() if s >= step}
        for i in range(len(self.queue) + 1, self.plan.depth + 1):
            self.queue.append(self._ask(step + i, version, extra))
        return req.prompts, batch, req.index

    def data_state(self) -> Dict[str, Any]:
        """The dataset position a checkpoint keeps: before the oldest request in flight (see the module docstring)."""
        return dict(self.queue[0].data_state) if self.queue else self.dataset_state()

    def discard(self) -> None:
        """Forget the requests in flight (their results are never read: a resume or a stop)."""
        self.queue.clear()

    def step_metrics(self, batch: Optional[Batch], version: int) -> Dict[str, float]:
        """In the overlapping modes: how far the step's tokens lag ``version``, the policy their update starts from
        (portrl.workers.partial_rollout.staleness_metrics), ``async/dropped_samples`` since the last call and
        ``async/requests_in_flight``. Takes the per-token versions out of ``batch`` (the update does not read them)."""
        versions = batch.tensors.pop("rollout_versions", None) if batch is not None else None
        if not self.plan.overlaps:
            return {}
        out = {"async/dropped_samples": float(self.dropped), "async/requests_in_flight": float(len(self.queue))}
        self.dropped = 0
        if batch is not None and versions is not None:
            out.update(staleness_metrics(versions, batch.tensors["response_mask"], version))
        return out


def _oldest(batch: Batch, asked_at: int) -> int:
    """The oldest policy version among ``batch``'s response tokens (``asked_at`` when it records none)."""
    if "rollout_versions" not in batch:
        return asked_at
    mask = batch.tensors["response_mask"].bool()
    v = batch.tensors["rollout_versions"][mask]
    return int(v.min()) if v.numel() else asked_at
