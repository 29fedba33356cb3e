"""The weight-transport contract: how the trainer's policy reaches the rollout workers of a separated placement.

One sender (trainer rank 0, group rank 0) and R receivers (the rollout workers, group ranks 1..R).

* :meth:`TransportSender.send` ``(named_tensors, version, meta=None) -> SyncStats`` sends full tensors;
  ``version`` is the policy version (an int the trainer chooses: its step) and travels in the sync's header with
  the tensors' names, shapes and dtypes. Given those first (``meta``), a ``bucketed`` sync takes the tensors
  bucket by bucket, so a sharded model is gathered as it is sent (a training mesh never holds a full copy).
* :meth:`TransportReceiver.receive` yields ``(name, tensor)`` bucket by bucket; once the stream is drained,
  ``last_stats`` and ``last_version`` describe the sync. A yielded tensor belongs to the caller (no transport
  reuses its memory), so an engine may keep it. ``receive`` assumes nothing of the thread it runs on: a
  listener thread of the rollout worker may call it in a loop while the main thread generates (one caller at
  a time per receiver). It waits for the next sync at most the transport's ``timeout_s`` (600 s by default),
  then raises; a stream left undrained stalls the sender, which waits for every receiver.

Modes (``rollout.weight_sync_mode``, :data:`SYNC_MODES`), the same on every transport:

* ``full``: one buffer per dtype, unbounded (fewest messages, the largest buffer);
* ``bucketed``: buffers of consecutive tensors of one dtype of at most ``rollout.weight_sync_bucket_mb`` MiB;
  a tensor larger than that travels alone, so each side's extra memory is at most
  ``max(bucket, largest tensor)`` (:func:`bucket_cap`; on a receiver, while its caller drops each tensor once
  loaded: a caller that still holds the last one when it asks for the next holds two buckets);
* ``delta``: the sender keeps a host copy of the bytes it last sent (one copy of the policy) and sends, bucketed,
  only the tensors whose bytes changed (bitwise, no hash) or are new; the first sync is full. A receiver that
  applied every sync since the first then holds bitwise what a full sync would give it.

Transports are registered :class:`TransportSpec` records (``rollout.weight_transport``); built in:
``broadcast`` (a process group of ``backend.dist_backend``: gloo on the CPU, NCCL / RCCL / HCCL on the
accelerators; :mod:`portrl.workers.weight_sync`) and ``shared_memory`` (one node only: a /dev/shm segment;
:mod:`portrl.workers.weight_shm`). A backend lists the transports it offers, best first, in
``Backend.weight_transports``; ``auto`` takes the first that fits the placement (:func:`choose_transport`).
A new transport: subclass both classes here (``_send_header``, ``_send_bucket``, ``_recv_header``,
``_recv_bucket``; ``_end`` and ``close`` where needed), register its spec with :func:`register_transport` and
name it in the ``weight_transports`` of the backends that offer it; a vendor's own lives in ``backends/<name>/``
and registers when that backend's module is imported. It must pass tests/test_weight_transport.py.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from portrl.errors import UserError

if TYPE_CHECKING:
    from portrl.device.backend import Backend

SYNC_MODES = ("full", "bucketed", "delta")
Meta = Tuple[str, Tuple[int, ...], str]  # name, shape, dtype name ("bfloat16")


@dataclass
class SyncStats:
    """One sync seen from one side: tensors and buckets that travelled, their payload bytes, the seconds from the
    header to the last bucket, the mode, the policy version, and the largest staging buffer allocated for it
    (``buffer_bytes``: the extra memory the transport needed beyond the weights)."""

    tensors: int
    buckets: int
    bytes: int
    seconds: float = 0.0
    mode: str = "bucketed"
    version: int = 0
    buffer_bytes: int = 0


@dataclass
class SyncHeader:
    """What a sync announces before its buckets: the policy version, the mode, the travelling tensors' metadata
    in order and the buckets (indices into ``meta``); ``extra``: what a transport adds (e.g. a segment name)."""

    version: int
    mode: str
    meta: List[Meta]
    buckets: List[List[int]]
    extra: Dict[str, object] = field(default_factory=dict)


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_buckets(meta: Sequence[Meta], bucket_bytes: int) -> List[List[int]]:
    """Indices of ``meta`` grouped into buckets: consecutive tensors of one dtype while the bucket stays within
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight_sync_bucket_mb must be > 0, got {bucket_bytes} bytes")
    buckets: List[List[int]] = []
    cur: List[int] = []
    cur_bytes, cur_dtype = 0, None
    for i, (_, shape, dtype) in enumerate(meta):
        nbytes = numel(shape) * element_size(dtype)
        if cur and (dtype != cur_dtype or cur_bytes + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return buckets


def plan_sync(meta: Sequence[Meta], mode: str, bucket_bytes: int) -> List[List[int]]:
    """The buckets of one sync: ``full`` one per dtype (in order of first appearance), else :func:`plan_buckets`."""
    if mode not in SYNC_MODES:
        raise ValueError(f"weight sync mode {mode!r} is not one of {', '.join(SYNC_MODES)}")
    if mode != "full":
        return plan_buckets(meta, bucket_bytes)
    by_dtype: Dict[str, List[int]] = {}
    for i, (_, _, dtype) in enumerate(meta):
        by_dtype.setdefault(dtype, []).append(i)
    return list(by_dtype.values())


def bucket_cap(meta: Sequence[Meta], bucket_bytes: int) -> int:
    """The most extra memory one side of a ``bucketed`` sync of ``meta`` allocates: one bucket, or the largest
    tensor when that is bigger (it travels alone)."""
    return max([bucket_bytes] + [numel(s) * element_size(d) for _, s, d in meta])


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (any dtype, any shape, 0-d included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(sent: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes equal ``sent`` (a host uint8 copy), compared as the widest integers that divide them
    (``equal`` on int64 words runs 5-14x faster than byte by byte)."""
    raw = raw_bytes(t).cpu()
    if raw.numel() != sent.numel():
        return False
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            return torch.equal(sent.view(dtype), raw.view(dtype))
    return torch.equal(sent, raw)


class DeltaTracker:
    """The sender's record for ``delta``: a host copy of each tensor's bytes as last sent."""

    def __init__(self) -> None:
        self._sent: Dict[str, Tuple[Tuple[int, ...], str, torch.Tensor]] = {}

    def changed(self, items: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        """The items whose name is new or whose shape, dtype or bytes differ from the last :meth:`commit`."""
        out = []
        for name, t in items:
            old = self._sent.get(name)
            if old is None or old[0] != tuple(t.shape) or old[1] != str(t.dtype) or not _same_bytes(old[2], t):
                out.append((name, t))
        return out

    def commit(self, items: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Record ``items`` as sent (call once the sync completed)."""
        for name, t in items:
            raw, old = raw_bytes(t), self._sent.get(name)
            if old is not None and old[2].numel() == raw.numel():
                old[2].copy_(raw)  # in place: no new host memory to fault in
                self._sent[name] = (tuple(t.shape), str(t.dtype), old[2])
            else:
                self._sent[name] = (tuple(t.shape), str(t.dtype), raw.to("cpu", copy=True))


def _take(source: Iterator[Tuple[str, torch.Tensor]], want: Meta) -> torch.Tensor:
    """The next tensor of a sync's stream, which must be the one its metadata ``want`` announced."""
    got = next(source, None)
    if got is None:
        raise ValueError(f"weight sync: the tensors ended before {want[0]!r}, which the metadata announced")
    name, t = got
    have = (name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
    if have != tuple(want):
        raise ValueError(f"weight sync: got tensor {have} where the metadata announced {tuple(want)}")
    return t.detach()


class TransportSender(ABC):
    """Group rank 0 of a transport. Subclasses implement ``_send_header``, ``_send_bucket`` and ``_end``."""

    def __init__(self, mode: str, bucket_mb: float):
        if mode not in SYNC_MODES:
            raise ValueError(f"weight sync mode {mode!r} is not one of {', '.join(SYNC_MODES)}")
        self.mode, self.bucket_bytes = mode, int(bucket_mb * 1024 * 1024)
        self._delta = DeltaTracker() if mode == "delta" else None

    def send(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int,
             meta: Optional[Sequence[Meta]] = None) -> SyncStats:
        """Send full tensors to every receiver as policy ``version``; returns once every bucket is out (the
        receivers may still be loading the last). See the module docstring for the modes.

        ``meta``: the tensors' ``(name, shape, dtype name)`` in the order ``named_tensors`` yields them, known
        before any is made. In ``bucketed`` mode the header is then planned from it and the tensors are taken
        from the iterable bucket by bucket: a sharded model's tensors are gathered as they are sent, so this
        side holds at most one bucket of them besides its buffer. The iterable is drained to its end, so the
        other ranks of a collective gather finish theirs. Without ``meta`` (and in ``full`` and ``delta``, which
        need every tensor before the header) all tensors are taken first."""
        started = time.perf_counter()
        streamed = meta is not None and self.mode == "bucketed"
        if meta is not None and streamed:
            meta, source, items = [(n, tuple(s), d) for n, s, d in meta], iter(named_tensors), []
        else:
            items = [(n, t.detach()) for n, t in named_tensors]
            if self._delta is not None:
                items = self._delta.changed(items)
            meta = [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in items]
            source = iter(())
        header = SyncHeader(int(version), self.mode, list(meta), plan_sync(meta, self.mode, self.bucket_bytes))
        self._send_header(header)
        total = largest = 0
        for k, idx in enumerate(header.buckets):  # bucketed: consecutive indices in order, so a stream fits
            tensors = [_take(source, meta[i]) if streamed else items[i][1] for i in idx]
            total += sum(numel(meta[i][1]) * element_size(meta[i][2]) for i in idx)
            largest = max(largest, self._send_bucket(k, tensors))
            del tensors
        extra = next(source, None)
        if extra is not None:
            raise ValueError(f"weight sync: tensor {extra[0]!r} came after the {len(meta)} its metadata announced")
        self._end(header)
        if self._delta is not None:
            self._delta.commit(items)
        return SyncStats(len(meta), len(header.buckets), total, time.perf_counter() - started, self.mode,
                         int(version), largest)

    @abstractmethod
    def _send_header(self, header: SyncHeader) -> None:
        """Announce the sync to every receiver (may add to ``header.extra`` first)."""

    @abstractmethod
    def _send_bucket(self, index: int, tensors: List[torch.Tensor]) -> int:
        """Send bucket ``index`` (tensors of one dtype, in order); returns the bytes of the buffer it allocated."""

    def _end(self, header: SyncHeader) -> None:
        """After the last bucket (default: nothing)."""

    def close(self) -> None:
        """Release what the transport holds (default: nothing)."""


class TransportReceiver(ABC):
    """Group rank >= 1 of a transport. Subclasses implement ``_recv_header`` and ``_recv_bucket``."""

    def __init__(self) -> None:
        self.last_stats: Optional[SyncStats] = None
        self.last_version: Optional[int] = None

    def receive(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Wait for the next sync and yield its ``(name, tensor)`` pairs bucket by bucket; ``last_stats`` and
        ``last_version`` are set when the stream is drained (drain it: the sender waits for every receiver)."""
        header = self._recv_header()
        started = time.perf_counter()
        total = largest = 0
        for k, idx in enumerate(header.buckets):
            dtype = header.meta[idx[0]][2]
            count = sum(numel(header.meta[i][1]) for i in idx)
            flat = self._recv_bucket(k, dtype, count)
            size = flat.numel() * flat.element_size()
            total, largest = total + size, max(largest, size)
            offset = 0
            for i in idx:
                name, shape, _ = header.meta[i]
                n = numel(shape)
                yield name, flat[offset:offset + n].view(shape)
                offset += n
            del flat  # before the next bucket arrives: one bucket at a time once the caller dropped its tensors
        self._end(header)
        self.last_stats = SyncStats(len(header.meta), len(header.buckets), total, time.perf_counter() - started,
                                    header.mode, header.version, largest)
        self.last_version = header.version

    @abstractmethod
    def _recv_header(self) -> SyncHeader:
        """Block until the sender announces a sync; its header."""

    @abstractmethod
    def _recv_bucket(self, index: int, dtype: str, count: int) -> torch.Tensor:
        """Bucket ``index``: a new flat tensor of ``count`` elements of ``dtype`` that nothing else uses."""

    def _end(self, header: SyncHeader) -> None:
        """After the last bucket (default: nothing)."""

    def close(self) -> None:
        """Release what the transport holds (default: nothing)."""


@dataclass(frozen=True)
class TransportSpec:
    """A registered transport: ``module`` holds classes ``sender`` (constructed ``(backend, addr, port,
    world_size, bucket_mb, mode=, timeout_s=)``) and ``receiver`` (``(backend, addr, port, rank, world_size,
    timeout_s=)``); ``same_node_only``: every member must be on one node."""

    name: str
    module: str
    sender: str
    receiver: str
    same_node_only: bool
    summary: str


_TRANSPORTS: Dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec) -> TransportSpec:
    """Register ``spec`` under its name (an equal record again is a no-op; another under a taken name is an error)."""
    old = _TRANSPORTS.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"weight transport {spec.name!r} is already registered ({old.module})")
    _TRANSPORTS[spec.name] = spec
    return spec


def transport_names() -> Tuple[str, ...]:
    return tuple(_TRANSPORTS)


def transport_spec(name: str) -> TransportSpec:
    if name not in _TRANSPORTS:
        raise ValueError(f"weight transport {name!r} is not registered; registered: {', '.join(_TRANSPORTS)}")
    return _TRANSPORTS[name]


def choose_transport(backend: Backend, requested: str, same_node: bool) -> TransportSpec:
    """The transport of a run: ``requested`` (``rollout.weight_transport``) when ``backend`` offers it, or for
    ``auto`` the backend's first that fits (``same_node``: sender and receivers share one node)."""
    offered = [_TRANSPORTS[n] for n in backend.weight_transports if n in _TRANSPORTS]
    if requested == "auto":
        fits = [s for s in offered if same_node or not s.same_node_only]
        if not fits:
            raise UserError(f"backend {backend.name!r} offers no weight transport across nodes "
                            f"({', '.join(backend.weight_transports)}); place the rollout workers on the trainer's node")
        return fits[0]
    spec = next((s for s in offered if s.name == requested), None)
    if spec is None:
        raise UserError(f"rollout.weight_transport={requested!r} is not offered by backend {backend.name!r}; "
                        f"it offers: auto, {', '.join(backend.weight_transports)}")
    if spec.same_node_only and not same_node:
        raise UserError(f"rollout.weight_transport={requested!r} needs the trainer and the rollout workers on one "
                        "node, and they are on several; use rollout.weight_transport=auto")
    return spec


def make_sender(spec: TransportSpec, backend: Backend, addr: str, port: int, world_size: int, bucket_mb: float,
                mode: str, timeout_s: float = 600.0) -> TransportSender:
    cls = getattr(importlib.import_module(spec.module), spec.sender)
    return cls(backend, addr, port, world_size, bucket_mb, mode=mode, timeout_s=timeout_s)


def make_receiver(spec: TransportSpec, backend: Backend, addr: str, port: int, rank: int, world_size: int,
                  timeout_s: float = 600.0) -> TransportReceiver:
    if rank < 1:
        raise ValueError(f"weight transport {spec.name}: a receiver's rank must be >= 1 (0 is the sender), got {rank}")
    cls = getattr(importlib.import_module(spec.module), spec.receiver)
    return cls(backend, addr, port, rank, world_size, timeout_s=timeout_s)


def sync_metrics(stats: Mapping[str, Any]) -> Dict[str, float]:
    """A sync's sender stats (``SyncStats`` as a dict) as step metrics."""
    return {f"perf/weight_sync_{key}": float(stats[field_name])
            for key, field_name in (("s", "seconds"), ("bytes", "bytes"), ("buckets", "buckets"), ("tensors", "tensors"))}


register_transport(TransportSpec("broadcast", "portrl.workers.weight_sync", "WeightSender", "WeightReceiver", False,
                                 "a broadcast in a process group of the backend's collective (backend.dist_backend)"))
register_transport(TransportSpec("shared_memory", "portrl.workers.weight_shm", "ShmSender", "ShmReceiver", True,
                                 "a /dev/shm segment the sender writes and the receivers copy from; one node"))
