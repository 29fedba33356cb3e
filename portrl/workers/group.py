"""WorkerGroup: N data-parallel copies of a worker class, as Ray actors or in this process.

``WorkerGroup(worker_cls, cfg, num_workers, backend)`` builds ``worker_cls(cfg, rank=r, world_size=N)`` in
each of N Ray actors (one per bundle of a :class:`~portrl.workers.ray_env.ResourcePool`), after setting the
worker's device and initialising ``torch.distributed`` with ``backend.dist_backend`` (MASTER_ADDR = rank 0's
node address -- 127.0.0.1 on a local Ray -- and a port rank 0 finds free). With ``num_workers == 1`` and no
cluster it builds the worker in this process instead (no Ray, no process group).

``.call(method, *args)`` is data-parallel dispatch: every :class:`Batch` argument is cut into N contiguous
pieces (``Batch.chunk``), rank r gets piece r, and the results are combined: Batches concatenated in rank
order, metric dicts reduced by :func:`reduce_metrics`, ``None`` stays ``None``, anything else is a list per
rank. ``.call_all`` / ``.call_rank0`` run the same arguments on every rank and return them uncombined.

A worker process that dies makes every call raise :class:`WorkerDiedError` naming the worker (role, rank,
node, pid); the group's other actors are killed, since their collectives can no longer complete. With
``timeout_s`` set (seconds; the trainer sets it from ``trainer.worker_timeout_s``), a call whose results do
not all arrive in time raises :class:`WorkerTimeoutError` (a WorkerDiedError) naming the workers that did not
answer, and the group is shut down the same way.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from portrl.workers.batch import Batch
from portrl.workers.ray_calls import WorkerDiedError, WorkerTimeoutError, gather  # noqa: F401  (the group's API)

log = logging.getLogger(__name__)

MAX_KEYS = ("max", "timing", "time/")
MIN_KEYS = ("min",)
SUM_KEYS = ("count", "num_tokens", "num_seqs", "/sum", "_sum")


def _rule(key: str) -> str:
    k = key.lower()
    if any(s in k for s in MAX_KEYS):
        return "max"
    if any(s in k.rsplit("/", 1)[-1] for s in MIN_KEYS):
        return "min"
    if any(k.endswith(s) for s in SUM_KEYS):
        return "sum"
    return "mean"


def reduce_metrics(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Combine the metric dicts of the ranks into one.

    Lists are concatenated (rank order). Numbers (and one-element tensors) are reduced by key name: ``max`` when
    the name contains ``max`` or is a timing (``timing``, ``time/``: the slowest rank sets the pace), ``min``
    when the last path part contains ``min``, ``sum`` for counts (``count``, ``num_tokens``, ``num_seqs``,
    ``.../sum``), else the mean over ranks (ranks hold equal shares of the batch, up to one row). Other values
    are taken from rank 0.
    """
    out: Dict[str, Any] = {}
    keys: List[str] = []
    for d in per_rank:
        keys += [k for k in d if k not in keys]
    for k in keys:
        vals = [d[k] for d in per_rank if k in d]
        if all(isinstance(v, (list, tuple)) for v in vals):
            out[k] = [x for v in vals for x in v]
            continue
        nums = []
        for v in vals:
            if hasattr(v, "numel") and v.numel() == 1:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                nums = None
                break
            nums.append(float(v))
        if nums is None:
            out[k] = vals[0]
            continue
        rule = _rule(k)
        out[k] = (max(nums) if rule == "max" else min(nums) if rule == "min" else
                  sum(nums) if rule == "sum" else sum(nums) / len(nums))
    return out


def combine_results(results: List[Any]) -> Any:
    """Concatenate Batches (rollouts padded to the widest prompt / response with ``info["pad_token_id"]``,
    see :func:`portrl.workers.batch.concat_rollouts`), reduce metric dicts, keep ``None``; else the list of
    per-rank results."""
    if all(r is None for r in results):
        return None
    if all(isinstance(r, Batch) for r in results):
        if all("prompts" in r and "responses" in r for r in results):  # rollouts: ranks' widths may differ
            from portrl.workers.batch import concat_rollouts

            return concat_rollouts(results, int(results[0].info.get("pad_token_id", 0)))
        return Batch.concat(results)
    if all(isinstance(r, Mapping) for r in results):
        return reduce_metrics(results)
    return results


def split_args(args: Sequence[Any], kwargs: Mapping[str, Any], n: int) -> List[tuple]:
    """Per-rank ``(args, kwargs)``: each Batch cut into ``n`` contiguous pieces, other values repeated."""
    pieces: Dict[Any, List[Batch]] = {}
    for key, v in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(v, Batch):
            if len(v) < n:
                raise ValueError(f"cannot split a batch of {len(v)} rows over {n} data-parallel workers; "
                                 f"give each worker at least one row (batch size >= {n})")
            pieces[key] = v.chunk(n)
    out = []
    for r in range(n):
        a = tuple(pieces[i][r] if i in pieces else v for i, v in enumerate(args))
        kw = {k: pieces[k][r] if k in pieces else v for k, v in kwargs.items()}
        out.append((a, kw))
    return out


class WorkerHost:
    """What runs inside each Ray actor: sets the device, joins the process group, builds and drives the worker."""

    def __init__(self, role: str, rank: int, world_size: int, backend):
        self.role, self.rank, self.world_size, self.backend = role, rank, world_size, backend
        self.worker = None

    def node_info(self) -> Dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        res = self.backend.ray_resource
        ids = list(ctx.get_accelerator_ids().get(res, [])) if res else []
        env = self.backend.visible_devices_env
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "accelerator_ids": ids, "visible_devices": os.environ.get(env) if env else None}

    def free_port(self) -> int:
        from portrl.workers.parallel import find_free_port

        return find_free_port(self.node_info()["node_ip"])

    def setup(self, worker_cls, cfg, master_addr: str, master_port: int, worker_kwargs: Mapping[str, Any]) -> None:
        from portrl.workers.parallel import init_distributed
        from portrl.workers.ray_env import local_device_index

        index = local_device_index(self.backend, self.node_info()["accelerator_ids"])
        if index is not None:  # workers read LOCAL_RANK to pick their device
            os.environ["LOCAL_RANK"] = str(index)
            self.backend.set_device(index)
        if self.world_size > 1:
            init_distributed(self.backend, self.rank, self.world_size, master_addr, master_port)
        self.worker = worker_cls(cfg, rank=self.rank, world_size=self.world_size, **dict(worker_kwargs))

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_for_rank0(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``execute`` on every rank (collectives need them all); only rank 0 sends its result back (a full state
        dict from each of N ranks would cost the driver N copies)."""
        result = getattr(self.worker, method)(*args, **kwargs)
        return result if self.rank == 0 else None

    # weight sync (separated placement, see portrl.workers.weight_sync)
    def join_weight_sync(self, addr: str, port: int, group_rank: int, group_size: int, bucket_mb: float) -> None:
        from portrl.workers.weight_sync import WeightReceiver, WeightSender

        self._sync = (WeightSender(self.backend, addr, port, group_size, bucket_mb) if group_rank == 0
                      else WeightReceiver(self.backend, addr, port, group_rank, group_size))

    def full_weights(self) -> Dict[str, Any]:
        """``worker.named_weights()`` as full CPU tensors (sharded ones all-gathered: call it on every rank)."""
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
                for n, t in self.worker.named_weights()}

    def push_weights(self) -> Optional[Dict[str, int]]:
        """Every trainer rank gathers ``worker.named_weights()`` (a collective under FSDP); the sender sends."""
        from dataclasses import asdict

        named = [(n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in self.worker.named_weights()]
        sender = getattr(self, "_sync", None)
        return asdict(sender.send(named)) if sender is not None else None

    def pull_weights(self) -> Dict[str, int]:
        """``worker.update_weights(...)`` with the received tensors (drained fully, so the broadcast completes)."""
        from dataclasses import asdict

        stream = self._sync.receive()
        self.worker.update_weights(stream)
        for _ in stream:
            pass
        return asdict(self._sync.last_stats)


class WorkerGroup:
    """N data-parallel workers of one role (see the module docstring).

    ``pool``: a :class:`ResourcePool` (default: a new one of ``num_workers`` bundles of 1 CPU + 1 device).
    ``share``: how many groups share each bundle of ``pool`` (colocation: each asks for 1/share of it).
    ``share_devices``: set the backend's Ray no-set opt-outs (see ``ray_env``). ``use_ray``: None = Ray when
    ``num_workers > 1``, ``trainer.use_ray`` is true or ``trainer.ray_address`` names a cluster.
    """

    def __init__(self, worker_cls, cfg, num_workers: int, backend, *, role: Optional[str] = None,
                 pool=None, share: int = 1, share_devices: bool = False, use_ray: Optional[bool] = None,
                 worker_kwargs: Optional[Mapping[str, Any]] = None):
        from portrl.workers.ray_env import _cfg_get

        if num_workers < 1:
            raise ValueError(f"WorkerGroup: num_workers must be >= 1, got {num_workers}")
        self.role = role or getattr(worker_cls, "__name__", "worker")
        self.num_workers, self.backend, self.cfg = num_workers, backend, cfg
        if use_ray is None:
            use_ray = _cfg_get(cfg, "trainer.use_ray")
        if use_ray is None:
            use_ray = num_workers > 1 or bool(_cfg_get(cfg, "trainer.ray_address"))
        if not use_ray and num_workers > 1:
            raise ValueError(f"WorkerGroup {self.role}: {num_workers} workers need Ray (trainer.use_ray must not be false)")
        self.use_ray = bool(use_ray)
        self.timeout_s: Optional[float] = None  # limit on each call's answers (module docstring); None = none
        self._local = None
        self.actors: List[Any] = []
        self.info: List[Dict[str, Any]] = []
        self._own_pool = pool is None
        if not self.use_ray:
            self._local = worker_cls(cfg, rank=0, world_size=1, **dict(worker_kwargs or {}))
            self.info = [{"node_ip": "local", "node_id": "", "pid": os.getpid()}]
            return
        self._start(worker_cls, cfg, pool, share, share_devices, dict(worker_kwargs or {}))

    # ------------------------------------------------------------------------------ start-up
    def _start(self, worker_cls, cfg, pool, share, share_devices, worker_kwargs):
        import ray

        from portrl.workers.ray_env import ResourcePool, init_ray, worker_env

        init_ray(cfg, self.backend)
        if pool is None:
            pool = ResourcePool(self.role, self.num_workers, self.backend)
        if pool.num_workers != self.num_workers:
            raise ValueError(f"WorkerGroup {self.role}: pool {pool.name!r} has {pool.num_workers} bundles "
                             f"for {self.num_workers} workers")
        self.pool = pool
        bundle = pool.bundle()
        res = self.backend.ray_resource
        env = worker_env(cfg, self.backend, share_devices=share_devices)
        remote = ray.remote(WorkerHost)
        for rank in range(self.num_workers):
            opts = dict(num_cpus=bundle["CPU"] / share, scheduling_strategy=pool.scheduling(rank),
                        runtime_env={"env_vars": env}, max_restarts=0)
            if res is not None and res in bundle:  # Ray takes GPUs as num_gpus, other accelerators as resources
                opts.update({"num_gpus": bundle[res] / share} if res == "GPU" else {"resources": {res: bundle[res] / share}})
            self.actors.append(remote.options(**opts).remote(self.role, rank, self.num_workers, self.backend))
        self.info = self._gather([a.node_info.remote() for a in self.actors])
        master_addr = self.info[0]["node_ip"]
        port = self._gather([self.actors[0].free_port.remote()])[0]
        self._gather([a.setup.remote(worker_cls, cfg, master_addr, port, worker_kwargs) for a in self.actors])
        log.info("worker group %s: %d workers on nodes %s", self.role, self.num_workers,
                 sorted({i["node_ip"] for i in self.info}))

    def describe(self, rank: int) -> str:
        """``"<role> rank <r> on node <ip> (node id <id8>, pid <pid>)"``."""
        if rank >= len(self.info):
            return f"{self.role} rank {rank}"
        i = self.info[rank]
        return f"{self.role} rank {rank} on node {i['node_ip']} (node id {str(i['node_id'])[:8]}, pid {i['pid']})"

    # ------------------------------------------------------------------------------ dispatch
    def _gather(self, refs: List[Any], method: str = "") -> List[Any]:
        return gather([(self, rank, ref) for rank, ref in enumerate(refs)], method=method)

    def call(self, method: str, *args, **kwargs) -> Any:
        """Data-parallel call: Batch arguments split over the ranks, results combined (module docstring)."""
        if self._local is not None:
            return combine_results([getattr(self._local, method)(*args, **kwargs)])
        per_rank = split_args(args, kwargs, self.num_workers)
        refs = [a.execute.remote(method, a_args, a_kw) for a, (a_args, a_kw) in zip(self.actors, per_rank)]
        return combine_results(self._gather(refs, method))

    def call_all(self, method: str, *args, **kwargs) -> List[Any]:
        """The same call on every rank (collective methods such as a sharded state_dict); results per rank."""
        if self._local is not None:
            return [getattr(self._local, method)(*args, **kwargs)]
        return self._gather([a.execute.remote(method, args, kwargs) for a in self.actors], method)

    def call_rank0(self, method: str, *args, **kwargs) -> Any:
        """Rank 0's result of a call made on every rank (every rank must join collectives); the other ranks' results
        stay in their processes. Worker state for a checkpoint comes from here, never from :meth:`call`'s metrics
        reduction (which would, say, sum a counter over the ranks)."""
        if self._local is not None:
            return getattr(self._local, method)(*args, **kwargs)
        return self._gather([a.execute_for_rank0.remote(method, args, kwargs) for a in self.actors], method)[0]

    def full_weights(self) -> Dict[str, Any]:
        """The workers' ``named_weights()`` as full CPU tensors, from rank 0 (every rank joins the gather)."""
        if self._local is not None:
            return {n: t.detach().cpu() for n, t in self._local.named_weights()}
        return self._gather([a.full_weights.remote() for a in self.actors])[0]

    @property
    def local_worker(self):
        """The in-process worker (None when the workers are Ray actors)."""
        return self._local

    def shutdown(self) -> None:
        """Kill the actors and release an own resource pool (idempotent)."""
        if self.actors:
            import ray

            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # already dead
                    pass
            self.actors = []
            if self._own_pool and getattr(self, "pool", None) is not None:
                self.pool.remove()
        self._local = None
