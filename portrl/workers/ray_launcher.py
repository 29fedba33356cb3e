"""The Ray launcher of a :class:`~portrl.workers.group.WorkerGroup`: N workers as Ray actors, one per bundle of a
:class:`~portrl.workers.ray_env.ResourcePool`.

Start-up: a local Ray starts (or ``trainer.ray_address`` is joined, :func:`portrl.workers.ray_env.init_ray`);
each actor is a :class:`WorkerHost` that sets its device (``LOCAL_RANK`` from the ids Ray gave it), pins itself
to its cores where the run splits them (``rollout.placement=separated`` on the CPU:
:func:`portrl.workers.placement.group_pinning`), joins ``torch.distributed`` with ``backend.dist_backend``
(MASTER_ADDR = rank 0's node address -- 127.0.0.1 on a local Ray -- and a port rank 0 finds free), then builds
``worker_cls(cfg, rank=r, world_size=N)``.

Ray is optional: it is imported inside the methods that need it, so importing this module needs no Ray.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

import torch

from portrl.device.split import describe_cores
from portrl.device.weight_transport import (TransportReceiver, TransportSender, make_receiver, make_sender,
                                            transport_spec)
from portrl.workers.parallel import find_free_port, init_distributed
from portrl.workers.placement import group_pinning
from portrl.workers.ray_calls import wait_results
from portrl.workers.ray_env import ResourcePool, init_ray, local_device_index, worker_env
from portrl.workers.setup import pin_process

if TYPE_CHECKING:
    from portrl.device.backend import Backend

log = logging.getLogger(__name__)

LISTENER = "listener"  # the concurrency group of WorkerHost.listen_for_weights


def devices_per_worker(worker_cls: Any, cfg: Any) -> float:
    """The devices one worker of ``worker_cls`` asks Ray for: its ``devices_needed(cfg)`` (a rollout worker's
    engine spreads its tensor-parallel workers over ``rollout.tensor_model_parallel_size`` devices), else 1."""
    needed = getattr(worker_cls, "devices_needed", None)
    return float(needed(cfg)) if needed is not None else 1.0


def _full(t: Any) -> Any:
    """A sharded (DTensor) weight gathered to the full tensor; a plain one as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class WorkerHost:
    """What runs inside each Ray actor: sets the device, joins the process group, builds and drives the worker."""

    def __init__(self, role: str, rank: int, world_size: int, backend: Backend):
        self.role, self.rank, self.world_size, self.backend = role, rank, world_size, backend
        self.worker: Any = None  # the worker class's instance, built by start()
        self._sync: TransportSender | TransportReceiver | None = None

    def node_info(self) -> Dict[str, Any]:
        import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        ctx = ray.get_runtime_context()
        res = self.backend.ray_resource
        ids = list(ctx.get_accelerator_ids().get(res, [])) if res else []
        env = self.backend.visible_devices_env
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "accelerator_ids": ids, "visible_devices": os.environ.get(env) if env else None}

    def free_port(self) -> int:
        return find_free_port(self.node_info()["node_ip"])

    def compute_info(self) -> Dict[str, Any]:
        """Where this process computes now: ``cores`` (``os.sched_getaffinity(0)``, sorted; None where the
        platform does not say) and torch's intra-op ``threads``."""
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {"cores": cores, "threads": torch.get_num_threads()}

    def setup(self, worker_cls, cfg, master_addr: str, master_port: int, worker_kwargs: Mapping[str, Any],
              cores: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """Set the device, pin to ``cores`` (None: not pinned), join the process group, build the worker; returns
        :meth:`compute_info`."""
        index = local_device_index(self.backend, self.node_info()["accelerator_ids"])
        if index is not None:  # workers read LOCAL_RANK to pick their device
            os.environ["LOCAL_RANK"] = str(index)
            self.backend.set_device(index)
        if cores is not None:  # before the worker's threads and torch's thread pool start
            pin_process(cores)
        if self.world_size > 1:
            init_distributed(self.backend, self.rank, self.world_size, master_addr, master_port)
        self.worker = worker_cls(cfg, rank=self.rank, world_size=self.world_size, **dict(worker_kwargs))
        return self.compute_info()

    def execute(self, method: str, args: tuple, kwargs: dict, reply: bool = True) -> Any:
        """``worker.<method>(*args, **kwargs)``; the result is sent back only when ``reply`` (a rank whose result
        is not wanted, e.g. a full state dict from every rank, sends ``None`` instead of a copy)."""
        result = getattr(self.worker, method)(*args, **kwargs)
        return result if reply else None

    def full_weights(self) -> Dict[str, Any]:
        """``worker.named_weights()`` as full CPU tensors (sharded ones all-gathered: call it on every rank)."""
        return {n: _full(t).detach().cpu() for n, t in self.worker.named_weights()}

    # weight sync (separated placement, see portrl.device.weight_transport)
    def join_weight_sync(self, addr: str, port: int, group_rank: int, group_size: int, bucket_mb: float,
                         transport: str = "broadcast", mode: str = "bucketed") -> None:
        spec = transport_spec(transport)
        # a receiver waits for the next sync as long as a step lasts (its listener thread waits between steps, and
        # the driver's own time limit on the workers covers a trainer that stops answering): a day, not 600 s
        self._sync = (make_sender(spec, self.backend, addr, port, group_size, bucket_mb, mode) if group_rank == 0
                      else make_receiver(spec, self.backend, addr, port, group_rank, group_size, timeout_s=86400.0))

    def push_weights(self, version: int = 0) -> Optional[Dict[str, Any]]:
        """Every trainer rank iterates ``worker.named_weights()`` (its gathers are collective under FSDP or a mesh);
        the sender sends them as policy ``version`` and returns its stats. With the worker's ``weight_meta()``
        the sender gathers bucket by bucket and the other ranks one tensor at a time: no rank holds a full copy."""
        named = ((n, _full(t)) for n, t in self.worker.named_weights())
        if not isinstance(self._sync, TransportSender):
            for _ in named:
                pass
            return None
        weight_meta = getattr(self.worker, "weight_meta", None)
        return asdict(self._sync.send(named, version, meta=None if weight_meta is None else weight_meta()))

    def pull_weights(self) -> Dict[str, Any]:
        """``worker.update_weights(...)`` with the received tensors (drained fully, so the sync completes)."""
        if not isinstance(self._sync, TransportReceiver):
            raise RuntimeError("pull_weights: this rank has not joined a weight sync as a receiver")
        stream = self._sync.receive()
        self.worker.update_weights(stream)
        for _ in stream:
            pass
        assert self._sync.last_stats is not None  # set once the stream is drained
        set_version = getattr(self.worker, "set_weights_version", None)  # a worker that tags its rollouts with it
        if set_version is not None:
            set_version(self._sync.last_version)
        return asdict(self._sync.last_stats)

    def listen_for_weights(self) -> None:
        """Receive every later sync and stage it with ``worker.stage_weights(named, version)`` while the worker
        generates (the asynchronous modes, portrl.workers.partial_rollout). Called in the ``listener``
        concurrency group (its own thread; the worker's other calls still run one at a time), it returns only by
        raising: its pending result is how the driver sees this worker alive (WeightSyncLink). A failure is also
        kept for the worker's next generation (``worker.weights.fail``), which raises it."""
        receiver = self._sync
        if not isinstance(receiver, TransportReceiver):
            raise RuntimeError("listen_for_weights: this rank has not joined a weight sync as a receiver")
        try:
            while True:
                named = list(receiver.receive())
                self.worker.stage_weights(named, receiver.last_version)
        except BaseException as exc:
            self.worker.weights.fail(exc)
            raise


class RayLauncher:
    """``group.num_workers`` :class:`WorkerHost` actors of ``group`` (a WorkerGroup: its role names them, its
    ``timeout_s`` bounds every wait, and a dead worker shuts it down). ``pool``: a ResourcePool (default: a new one
    of ``num_workers`` bundles of 1 CPU + 1 device, removed on shutdown; pinned workers' bundles hold their cores
    instead of 1 CPU: :func:`~portrl.workers.placement.group_pinning`); ``share``: how many groups share each
    bundle (colocation: each asks for 1/share of it); ``share_devices``: set the backend's Ray no-set opt-outs
    (``portrl.workers.ray_env``). :meth:`start` starts them."""

    uses_ray = True

    def __init__(self, group: Any, *, pool=None, share: int = 1, share_devices: bool = False):
        self.group, self.num_workers = group, group.num_workers
        self.pool, self.share, self.share_devices = pool, share, share_devices
        self._own_pool = pool is None
        self.actors: List[Any] = []
        self.info: List[Dict[str, Any]] = []

    def start(self, worker_cls, cfg, worker_cfg, worker_kwargs: Mapping[str, Any]) -> None:
        """Start Ray (``cfg``: the run config, for the cluster and the workers' env), the actors, their process
        group, then the workers (built with ``worker_cfg``)."""
        import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        group, backend, share = self.group, self.group.backend, self.share
        init_ray(cfg, backend)
        pinning = group_pinning(cfg, backend, worker_cls, self.num_workers)  # None: every worker on every core
        if self.pool is None:  # a pinned worker asks Ray for the CPUs it is pinned to
            self.pool = ResourcePool(group.role, self.num_workers, backend,
                                     cpus_per_worker=pinning.ray_cpus if pinning else 1.0,
                                     devices_per_worker=devices_per_worker(worker_cls, cfg))
        if self.pool.num_workers != self.num_workers:
            raise ValueError(f"WorkerGroup {group.role}: pool {self.pool.name!r} has {self.pool.num_workers} "
                             f"bundles for {self.num_workers} workers")
        bundle = self.pool.bundle()
        res = backend.ray_resource
        env = worker_env(cfg, backend, share_devices=self.share_devices)
        # "listener": one more thread for a rollout worker's weight listener (listen_for_weights); every other
        # call runs in the default group, one at a time
        remote = ray.remote(concurrency_groups={LISTENER: 1})(WorkerHost)  # type: ignore[call-overload]  # Ray's stubs omit it
        for rank in range(self.num_workers):
            opts = dict(num_cpus=bundle["CPU"] / share, scheduling_strategy=self.pool.scheduling(rank),
                        runtime_env={"env_vars": env}, max_restarts=0)
            if res is not None and res in bundle:  # Ray takes GPUs as num_gpus, other accelerators as resources
                opts.update({"num_gpus": bundle[res] / share} if res == "GPU" else {"resources": {res: bundle[res] / share}})
            self.actors.append(remote.options(**opts).remote(group.role, rank, self.num_workers, backend))
        self.info = self._wait([a.node_info.remote() for a in self.actors])
        master_addr = self.info[0]["node_ip"]
        port = self._wait([self.actors[0].free_port.remote()])[0]
        cores = pinning.cores if pinning else [None] * self.num_workers
        placed = self._wait([a.setup.remote(worker_cls, worker_cfg, master_addr, port, worker_kwargs, c)
                             for a, c in zip(self.actors, cores)])
        for rank, (info, where) in enumerate(zip(self.info, placed)):  # the cores and threads each reports
            info.update(where)
            if pinning:
                log.info("%s rank %d (pid %s) pinned to cores %s, %d torch thread(s) (%s)", group.role, rank,
                         info["pid"], describe_cores(where["cores"] or ()), where["threads"], pinning.why)
        nodes = sorted({(i["node_ip"], str(i.get("node_id", ""))[:8]) for i in self.info})
        log.info("worker group %s: %d workers on %d node(s): %s", group.role, self.num_workers, len(nodes),
                 ", ".join(f"{ip} (node {nid})" for ip, nid in nodes))

    def _wait(self, refs: Sequence[Any], method: str = "") -> List[Any]:
        return wait_results([(self.group, rank, ref) for rank, ref in enumerate(refs)], method=method)

    def execute(self, method: str, per_rank: Sequence[tuple], reply: Sequence[bool]) -> List[Any]:
        """``method`` on every rank r with ``per_rank[r] = (args, kwargs)``; results in rank order (``None`` where
        ``reply[r]`` is false)."""
        return self.collect(self.submit(method, per_rank, reply), method)

    def submit(self, method: str, per_rank: Sequence[tuple], reply: Sequence[bool]) -> List[Any]:
        """Start :meth:`execute`'s call without waiting: the object refs, in rank order, for :meth:`collect`."""
        return [a.execute.remote(method, args, kwargs, want)
                for a, (args, kwargs), want in zip(self.actors, per_rank, reply)]

    def collect(self, refs: Sequence[Any], method: str = "") -> List[Any]:
        """The results of :meth:`submit`'s refs (a dead or silent worker raises, as in :meth:`execute`)."""
        return self._wait(refs, method)

    def full_weights(self) -> Dict[str, Any]:
        return self._wait([a.full_weights.remote() for a in self.actors], "full_weights")[0]

    def shutdown(self) -> None:
        """Kill the actors and release an own resource pool (idempotent)."""
        if not self.actors:
            return
        import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []
        if self._own_pool and self.pool is not None:
            self.pool.remove()
