"""Weight sync for the separated placement: trainer rank 0 broadcasts the policy to the rollout workers.

The sender (trainer rank 0, group rank 0) and the receivers (rollout workers, group ranks 1..R) form their
own process group of the backend's collective (``backend.dist_backend``: gloo on the CPU), created beside
whatever default group each process already has. One sync:

1. the sender broadcasts the metadata: ``[(name, shape, dtype), ...]`` in order;
2. tensors are packed, in that order, into buckets of at most ``bucket_mb`` MiB of one dtype (a tensor larger
   than a bucket travels alone); each bucket is one flat buffer, broadcast from rank 0 and unpacked;
3. receivers yield ``(name, tensor)`` bucket by bucket, so an engine's ``update_weights`` can load them while
   the next bucket is in flight, and peak extra memory is one bucket.

Buffers live on the CPU for gloo and on the current device for the accelerator collectives (only hardware
can confirm the latter path; the CPU tests run gloo).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portrl.workers.parallel import is_loopback, loopback_store
from portrl.workers.ray_calls import wait_results

if TYPE_CHECKING:
    from portrl.device.backend import Backend

Meta = Tuple[str, Tuple[int, ...], str]  # name, shape, dtype name


def plan_buckets(meta: Sequence[Meta], bucket_bytes: int) -> List[List[int]]:
    """Indices of ``meta`` grouped into buckets: consecutive tensors of one dtype while the bucket stays within
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight_sync_bucket_mb must be > 0, got {bucket_bytes} bytes")
    buckets: List[List[int]] = []
    cur: List[int] = []
    cur_bytes, cur_dtype = 0, None
    for i, (_, shape, dtype) in enumerate(meta):
        nbytes = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if cur and (dtype != cur_dtype or cur_bytes + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return buckets


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def new_group(backend: Backend, master_addr: str, master_port: int, rank: int, world_size: int,
              name: str = "portrl_weight_sync", timeout_s: float = 600.0):
    """A process group of ``backend.dist_backend`` over TCP ``master_addr:master_port`` that lives beside the
    process's default group (each side may already have its own). Every member must call this concurrently.

    torch has no public call for a second, independent group; this uses the helper ``init_process_group``
    itself uses (``distributed_c10d._new_process_group_helper``, as OpenRLHF does), registered with an identity
    rank map so ``group_src=0`` addresses the sender.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = (loopback_store(master_addr, master_port, rank == 0, world_size, timeout) if is_loopback(master_addr)
             else dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout))  # one node: 127.0.0.1
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
    return torch.device("cpu") if backend.dist_backend == "gloo" else backend.device()


@dataclass
class SyncStats:
    tensors: int
    buckets: int
    bytes: int


class WeightSender:
    """Group rank 0. ``send(named_tensors)`` broadcasts full tensors (gather sharded ones first, e.g. with
    ``parallel.full_state_dict``) and returns the :class:`SyncStats`."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, world_size: int, bucket_mb: float,
                 timeout_s: float = 600.0):
        self.backend, self.bucket_bytes = backend, int(bucket_mb * 1024 * 1024)
        self.group = new_group(backend, master_addr, master_port, 0, world_size, timeout_s=timeout_s)

    def send(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int = 0) -> SyncStats:
        """Broadcast ``named_tensors`` as policy ``version`` (it travels with the metadata)."""
        items = [(n, t.detach()) for n, t in named_tensors]
        meta: List[Meta] = [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in items]
        dist.broadcast_object_list([meta, self.bucket_bytes, int(version)], group=self.group, group_src=0)
        device, total = _comm_device(self.backend), 0
        buckets = plan_buckets(meta, self.bucket_bytes)
        for idx in buckets:
            flat = torch.cat([items[i][1].reshape(-1).to(device) for i in idx])
            dist.broadcast(flat, group=self.group, group_src=0)
            total += flat.numel() * flat.element_size()
        return SyncStats(len(items), len(buckets), total)


class WeightReceiver:
    """Group rank ``rank`` >= 1. ``receive()`` yields ``(name, tensor)`` bucket by bucket (tensors on the comm
    device: the CPU for gloo); feed it to ``RolloutEngine.update_weights``."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 600.0):
        if rank < 1:
            raise ValueError(f"WeightReceiver: rank must be >= 1 (0 is the sender), got {rank}")
        self.backend = backend
        self.group = new_group(backend, master_addr, master_port, rank, world_size, timeout_s=timeout_s)
        self.last_stats: SyncStats | None = None
        self.last_version = 0  # the policy version of the weights being (or last) received

    def receive(self) -> Iterator[Tuple[str, torch.Tensor]]:
        box: list = [None, None, None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        meta, bucket_bytes, self.last_version = box
        device, total = _comm_device(self.backend), 0
        buckets = plan_buckets(meta, bucket_bytes)
        for idx in buckets:
            dtype = getattr(torch, meta[idx[0]][2])
            flat = torch.empty(sum(_numel(meta[i][1]) for i in idx), dtype=dtype, device=device)
            dist.broadcast(flat, group=self.group, group_src=0)
            total += flat.numel() * flat.element_size()
            offset = 0
            for i in idx:
                name, shape, _ = meta[i]
                n = _numel(shape)
                yield name, flat[offset:offset + n].view(shape)
                offset += n
        self.last_stats = SyncStats(len(meta), len(buckets), total)


class WeightSyncLink:
    """Joins a trainer WorkerGroup (its rank 0 sends) to a rollout WorkerGroup (every rank receives), both on the
    Ray launcher (portrl.workers.ray_launcher: the hosts hold the sender / receivers). The trainer workers provide
    ``named_weights()`` (full tensors, every rank called), the rollout workers ``update_weights(named_tensors)``.
    ``sync()`` runs one broadcast and returns the sender's stats."""

    def __init__(self, trainer, rollout, bucket_mb: float):
        if not (trainer.use_ray and rollout.use_ray):
            raise ValueError("WeightSyncLink needs Ray worker groups on both sides (trainer.use_ray must not be false)")
        self.trainer, self.rollout = trainer, rollout
        senders, receivers = trainer.launcher.actors, rollout.launcher.actors
        addr = trainer.info[0]["node_ip"]
        port = wait_results([(trainer, 0, senders[0].free_port.remote())])[0]
        size = 1 + rollout.num_workers
        items = [(trainer, 0, senders[0].join_weight_sync.remote(addr, port, 0, size, bucket_mb))]
        items += [(rollout, r, a.join_weight_sync.remote(addr, port, r + 1, size, bucket_mb))
                  for r, a in enumerate(receivers)]
        wait_results(items)
        self.listening = False

    def sync(self, version: int = 0) -> dict:
        """Send the policy as ``version`` and wait until every rollout worker loaded it; once
        :meth:`start_listeners` ran, send it only: the listeners stage it (the asynchronous modes)."""
        items = [(self.trainer, r, a.push_weights.remote(version)) for r, a in enumerate(self.trainer.launcher.actors)]
        if not self.listening:
            items += [(self.rollout, r, a.pull_weights.remote()) for r, a in enumerate(self.rollout.launcher.actors)]
        return wait_results(items)[0]

    def start_listeners(self) -> None:
        """From now on each rollout worker receives every sync in a thread of its own while it generates
        (portrl.workers.partial_rollout.StagedWeights)."""
        wait_results([(self.rollout, r, a.start_weight_listener.remote())
                      for r, a in enumerate(self.rollout.launcher.actors)])
        self.listening = True
