"""The ``shared_memory`` weight transport: one node, a /dev/shm segment and a TCP-store handshake.

The contract and the modes are :mod:`portrl.device.weight_transport`. The sender (group rank 0) owns one
segment, sized for the sync's largest bucket (it grows, never shrinks: a new segment replaces a smaller one).
One sync, numbered ``s`` on every member (each receiver drains every sync, so the numbers agree):

1. the sender stores the header (version, mode, metadata, buckets, the segment's path and size) as key ``h<s>``;
   each receiver waits for it, maps the segment if it is new, and sets ``h<s>/<rank>``;
2. for bucket ``k`` the sender first waits until every receiver has set ``b<s>.<k-1>/<rank>`` (it copied the
   previous bucket out), then writes bucket ``k`` into the segment and sets ``b<s>.<k>``; a receiver waits for
   that key, copies the bucket into a new tensor of its own, sets its ``b<s>.<k>/<rank>`` and yields. So a
   receiver never reads a bucket being written and the sender never overwrites one not yet copied, and the
   receiver's engine loads bucket ``k`` while the sender writes ``k+1``;
3. the sender waits for the header's and the last bucket's keys of every receiver, deletes the sync's keys and,
   once every receiver has mapped a new segment, unlinks its path (the mappings stay; nothing is left in
   /dev/shm if a process dies later).

Extra memory: the segment on the sender (its ``buffer_bytes``: one bucket in ``bucketed`` mode) and one bucket
at a time on each receiver, as with the broadcast. The store is served by the sender on the address the link
gives (the trainer's node).
"""

from __future__ import annotations

import base64
import mmap
import os
import pickle
import uuid
import weakref
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch.distributed import PrefixStore

from portrl.device.weight_transport import (SyncHeader, TransportReceiver, TransportSender, element_size, numel,
                                            raw_bytes)
from portrl.workers.weight_sync import rendezvous_store

if TYPE_CHECKING:
    from portrl.device.backend import Backend

SHM_DIR = "/dev/shm"


def _shm_dir() -> str:
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"the shared_memory weight transport needs {SHM_DIR} (Linux shared memory); "
                           "use rollout.weight_transport=broadcast")
    return SHM_DIR


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reserve(fd: int, path: str, size: int) -> None:
    """Give the new segment ``size`` bytes of the shared-memory filesystem now: a write past what a small
    /dev/shm holds (a container's default is 64 MiB) would kill the process with SIGBUS instead."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError as exc:
        stat = os.statvfs(os.path.dirname(path))
        raise RuntimeError(f"weight sync: cannot reserve a {size / 2**20:.0f} MiB segment in {SHM_DIR} "
                           f"({stat.f_bavail * stat.f_frsize / 2**20:.0f} MiB free: {exc.strerror}); give the "
                           "machine or container more shared memory (docker --shm-size), lower "
                           "rollout.weight_sync_bucket_mb, or use rollout.weight_transport=broadcast") from exc


class _Mapping:
    """A segment file mapped read-write, with a flat uint8 tensor over it."""

    def __init__(self, path: str, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                _reserve(fd, path, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.view: Optional[torch.Tensor] = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        self.view = None  # the tensor exports the map's buffer: drop it first
        try:
            self.map.close()
        except BufferError:  # a slice of the view is still alive somewhere: the GC unmaps it later
            pass


def _bucket_bytes(header: SyncHeader) -> int:
    return max([0] + [sum(numel(header.meta[i][1]) * element_size(header.meta[i][2]) for i in idx)
                      for idx in header.buckets])


class ShmSender(TransportSender):
    """The ``shared_memory`` transport's sender (group rank 0): see the module docstring."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, world_size: int, bucket_mb: float,
                 mode: str = "bucketed", timeout_s: float = 600.0):
        super().__init__(mode, bucket_mb)
        self.dir, self.receivers = _shm_dir(), list(range(1, world_size))
        self.store = PrefixStore("portrl_weight_shm", rendezvous_store(master_addr, master_port, 0, world_size,
                                                                       timeout_s))
        self.seg: Optional[_Mapping] = None
        self._fresh = False  # the segment's path is still linked (until every receiver mapped it)
        self._seq = 0
        self._finalizer: Optional[weakref.finalize] = None

    def _send_header(self, header: SyncHeader) -> None:
        self._seq += 1
        need = _bucket_bytes(header)
        if need and (self.seg is None or self.seg.size < need):
            self._new_segment(need)
        header.extra["segment"] = (self.seg.path, self.seg.size) if self.seg is not None else None
        self.store.set(f"h{self._seq}", base64.b64encode(pickle.dumps(header)).decode("ascii"))

    def _new_segment(self, size: int) -> None:
        if self.seg is not None:
            self.seg.close()
        path = os.path.join(self.dir, f"portrl_weights_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        self.seg, self._fresh = _Mapping(path, size, create=True), True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _unlink, path)  # an exit before the receivers mapped it

    def _acks(self, key: str) -> List[str]:
        return [f"{key}/{r}" for r in self.receivers]

    def _send_bucket(self, index: int, tensors: List[torch.Tensor]) -> int:
        if index > 0:
            self._done(f"b{self._seq}.{index - 1}")
        assert self.seg is not None and self.seg.view is not None  # _send_header sized it for every bucket
        offset = 0
        for t in tensors:
            raw = raw_bytes(t)
            self.seg.view[offset:offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        self.store.set(f"b{self._seq}.{index}", "1")
        return self.seg.size

    def _done(self, key: str) -> None:
        """Wait until every receiver set ``key``'s acknowledgement, then delete ``key`` and them."""
        acks = self._acks(key)
        self.store.wait(acks)
        for k in [key, *acks]:
            self.store.delete_key(k)

    def _end(self, header: SyncHeader) -> None:
        if header.buckets:
            self._done(f"b{self._seq}.{len(header.buckets) - 1}")
        self._done(f"h{self._seq}")
        if self._fresh and self.seg is not None:  # every receiver has mapped it
            _unlink(self.seg.path)
            self._fresh = False

    def close(self) -> None:
        if self.seg is not None:
            _unlink(self.seg.path)
            self.seg.close()
            self.seg = None


class ShmReceiver(TransportReceiver):
    """The ``shared_memory`` transport's receiver (group rank ``rank`` >= 1): yields CPU tensors of its own."""

    def __init__(self, backend: Backend, master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 600.0):
        if rank < 1:
            raise ValueError(f"ShmReceiver: rank must be >= 1 (0 is the sender), got {rank}")
        super().__init__()
        self.rank = rank
        self.store = PrefixStore("portrl_weight_shm", rendezvous_store(master_addr, master_port, rank, world_size,
                                                                       timeout_s))
        self.seg: Optional[_Mapping] = None
        self._seq = 0

    def _recv_header(self) -> SyncHeader:
        self._seq += 1
        key = f"h{self._seq}"
        self.store.wait([key])
        header: SyncHeader = pickle.loads(base64.b64decode(self.store.get(key)))
        segment: Optional[Tuple[str, int]] = header.extra.get("segment")  # type: ignore[assignment]  # set by ShmSender
        if segment is not None and (self.seg is None or self.seg.path != segment[0]):
            if self.seg is not None:
                self.seg.close()
            self.seg = _Mapping(segment[0], int(segment[1]), create=False)
        self.store.set(f"{key}/{self.rank}", "1")
        return header

    def _recv_bucket(self, index: int, dtype: str, count: int) -> torch.Tensor:
        key = f"b{self._seq}.{index}"
        self.store.wait([key])
        assert self.seg is not None and self.seg.view is not None  # the header named a segment for its buckets
        out = torch.empty(count * element_size(dtype), dtype=torch.uint8)
        out.copy_(self.seg.view[:out.numel()])
        self.store.set(f"{key}/{self.rank}", "1")
        return out.view(getattr(torch, dtype))

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            self.seg = None
