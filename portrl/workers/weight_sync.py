"""The ``broadcast`` weight transport, and the link that joins a trainer group to its rollout workers.

The contract (sender ``send(named_tensors, version) -> SyncStats``, receiver ``receive()`` yielding ``(name,
tensor)``, the ``full`` / ``bucketed`` / ``delta`` modes, how a backend chooses a transport and how a new one is
added) is :mod:`portrl.device.weight_transport`. Here:

* :class:`WeightSender` / :class:`WeightReceiver`, the ``broadcast`` transport: the sender (trainer rank 0,
  group rank 0) and the receivers (rollout workers, group ranks 1..R) form their own process group of the
  backend's collective (``backend.dist_backend``: gloo on the CPU, NCCL / RCCL / HCCL as the accelerator
  backends name it), created beside whatever default group each process already has. One sync broadcasts the
  header (version, mode, metadata, bucket plan) as an object, then each bucket as one flat buffer. Buffers
  live on the CPU for gloo and on the process's current device for the accelerator collectives (only hardware
  can confirm that path; the CPU tests run gloo). Works across nodes.
* :class:`WeightSyncLink`: joins a trainer WorkerGroup's rank 0 to every rank of a rollout WorkerGroup over the
  transport the backend chooses (``rollout.weight_transport``, :func:`~portrl.device.weight_transport.choose_transport`).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portrl.device.weight_transport import (Meta, SyncHeader, SyncStats, TransportReceiver, TransportSender,
                                            choose_transport, element_size, plan_buckets, raw_bytes)
from portrl.workers.parallel import is_loopback, loopback_store
from portrl.workers.ray_calls import wait_results
from portrl.workers.ray_launcher import LISTENER

if TYPE_CHECKING:
    from portrl.device.backend import Backend

__all__ = ["Meta", "SyncStats", "WeightReceiver", "WeightSender", "WeightSyncLink", "new_group", "plan_buckets", "rendezvous_store"]


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    """The TCP store of a transport's members, served by rank 0 on ``master_addr:master_port`` (listening on
    that address only when it is a loopback one)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return (loopback_store(master_addr, master_port, rank == 0, world_size, timeout) if is_loopback(master_addr)
            else dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout))


def new_group(backend: Backend, master_addr: str, master_port: int, rank: int, world_size: int,
              name: Optional[str] = None, timeout_s: float = 600.0):
    """A process group of ``backend.dist_backend`` over TCP ``master_addr:master_port`` that lives beside the
    process's default group (each side may already have its own). Every member must call this concurrently.
    ``name``: the group's name (default ``portrl_weight_sync_<port>``: one per link).

    torch has no public call for a second, independent group; this uses the helper ``init_process_group``
    itself uses (``distributed_c10d._new_process_group_helper``, as OpenRLHF does), registered with an identity
    rank map so ``group_src=0`` addresses the sender.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    name = name or f"portrl_weight_sync_{master_port}"
    store = rendezvous_store(master_addr, master_port, rank, world_size, timeout_s)
    prefix = c10d.PrefixStore(name, store)
    try:
        group_name = c10d.GroupName(name) if hasattr(c10d, "GroupName") else name
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend.dist_backend, prefix,
                                               group_name=group_name,  # type: ignore[arg-type]  # a str on torch without GroupName
                                               timeout=timeout)
    except (AttributeError, TypeError) as exc:
        raise RuntimeError(f"torch {torch.__version__}: cannot create a side process group for weight sync "
                           f"(distributed_c10d._new_process_group_helper changed: {exc})") from exc
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _comm_device(backend: Backend) -> torch.device:
    """Where the buffers live: the CPU for gloo, else this process's current device (with its index, so that a
    receiver called from another thread uses the same device)."""
    if backend.dist_backend == "gloo":
        return torch.device("cpu")
    return backend.device(int(torch.get_device_module(backend.device_type).current_device()))


class WeightSender(TransportSender):
    """The ``broadcast`` transport's sender (group rank 0); ``send`` broadcasts full tensors (gather sharded ones
    first, e.g. with ``parallel.full_state_dict``)."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, world_size: int, bucket_mb: float,
                 mode: str = "bucketed", timeout_s: float = 600.0):
        super().__init__(mode, bucket_mb)
        self.backend, self.device = backend, _comm_device(backend)
        self.group = new_group(backend, master_addr, master_port, 0, world_size, timeout_s=timeout_s)

    def _send_header(self, header: SyncHeader) -> None:
        dist.broadcast_object_list([header], group=self.group, group_src=0, device=self.device)

    def _send_bucket(self, index: int, tensors: List[torch.Tensor]) -> int:
        flat = torch.cat([raw_bytes(t.to(self.device)) for t in tensors])  # bytes on the wire: any dtype
        dist.broadcast(flat, group=self.group, group_src=0)
        return flat.numel()


class WeightReceiver(TransportReceiver):
    """The ``broadcast`` transport's receiver (group rank ``rank`` >= 1); ``receive()`` yields tensors on the
    comm device (the CPU for gloo); feed it to ``RolloutEngine.update_weights``."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 600.0):
        if rank < 1:
            raise ValueError(f"WeightReceiver: rank must be >= 1 (0 is the sender), got {rank}")
        super().__init__()
        self.backend, self.device = backend, _comm_device(backend)
        self.group = new_group(backend, master_addr, master_port, rank, world_size, timeout_s=timeout_s)

    def _recv_header(self) -> SyncHeader:
        if self.device.index is not None:  # the current device is per thread: this may be a listener thread
            self.backend.set_device(self.device.index)
        box: List[Any] = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=self.device)
        return box[0]

    def _recv_bucket(self, index: int, dtype: str, count: int) -> torch.Tensor:
        flat = torch.empty(count * element_size(dtype), dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, group=self.group, group_src=0)
        return flat.view(getattr(torch, dtype))


class WeightSyncLink:
    """Joins a trainer WorkerGroup (its rank 0 sends) to a rollout WorkerGroup (every rank receives), both on the
    Ray launcher (portrl.workers.ray_launcher: the hosts hold the sender / receivers). The trainer workers provide
    ``named_weights()`` (full tensors, every rank called), the rollout workers ``update_weights(named_tensors)``.
    ``transport``: ``rollout.weight_transport`` (``auto``: the backend's first that fits, shared memory only
    when every member is on the trainer's node); ``mode``: ``rollout.weight_sync_mode``.
    ``sync(version)`` runs one sync and returns the sender's stats (a ``SyncStats`` dict)."""

    def __init__(self, trainer, rollout, bucket_mb: float, transport: str = "auto", mode: str = "bucketed"):
        if not (trainer.use_ray and rollout.use_ray):
            raise ValueError("WeightSyncLink needs Ray worker groups on both sides (trainer.use_ray must not be false)")
        self.trainer, self.rollout, self.version = trainer, rollout, 0
        senders, receivers = trainer.launcher.actors, rollout.launcher.actors
        nodes = {trainer.info[0]["node_id"]} | {i["node_id"] for i in rollout.info}
        self.transport = choose_transport(trainer.backend, transport, same_node=len(nodes) == 1)
        addr = trainer.info[0]["node_ip"]
        port = wait_results([(trainer, 0, senders[0].free_port.remote())])[0]
        size, name = 1 + rollout.num_workers, self.transport.name
        items = [(trainer, 0, senders[0].join_weight_sync.remote(addr, port, 0, size, bucket_mb, name, mode))]
        items += [(rollout, r, a.join_weight_sync.remote(addr, port, r + 1, size, bucket_mb, name, mode))
                  for r, a in enumerate(receivers)]
        wait_results(items)
        self.listeners: List[Tuple[Any, int, Any]] = []  # (group, rank, pending listen_for_weights) per rollout rank

    def sync(self, version: Optional[int] = None) -> Dict[str, Any]:
        """One sync of the trainer's current policy as ``version`` (default: one more than the last); waits until
        every rollout worker loaded it, or, once :meth:`start_listeners` ran, until it is sent: the listeners stage
        it while their workers generate (the asynchronous modes)."""
        self.version = self.version + 1 if version is None else int(version)
        items = [(self.trainer, r, a.push_weights.remote(self.version))
                 for r, a in enumerate(self.trainer.launcher.actors)]
        if not self.listeners:
            items += [(self.rollout, r, a.pull_weights.remote()) for r, a in enumerate(self.rollout.launcher.actors)]
        # a listener's result only comes when it fails or its worker dies: then the sync cannot complete, and the
        # error names that rollout worker instead of the sender that waits for it
        return wait_results(items, watch=self.listeners)[0]

    def start_listeners(self) -> None:
        """From now on each rollout worker receives every sync in a thread of its own while it generates
        (``WorkerHost.listen_for_weights``; portrl.workers.partial_rollout.StagedWeights)."""
        self.listeners = [(self.rollout, r, a.listen_for_weights.options(concurrency_group=LISTENER).remote())
                          for r, a in enumerate(self.rollout.launcher.actors)]
