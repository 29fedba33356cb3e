"""Weight-sync time per transport and mode between processes of one node (the CPU backend's order).

    python benchmarks/weight_transport.py [--mb 512] [--receivers 1] [--bucket-mb 64] [--repeat 3] [--changed 0.1]

A sender and ``--receivers`` receivers (spawned processes, as the separated placement's trainer rank 0 and
rollout workers) sync a policy of about ``--mb`` MiB of bfloat16 tensors (a 64 MiB embedding and 4 MiB
matrices), each receiver copying every tensor into its own copy of the weights (what an engine's
``update_weights`` does). For each transport the CPU backend offers and each mode, ``--repeat`` syncs after one
warm-up; ``delta`` changes ``--changed`` of the tensors before each. Prints the best and median seconds of the
sender's ``send`` (which returns once every receiver has its last bucket), the payload in GB/s and the largest
staging buffer per side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from portrl.device import get_backend  # noqa: E402
from portrl.workers.parallel import find_free_port  # noqa: E402
from portrl.device.weight_transport import SYNC_MODES, make_receiver, make_sender, transport_spec  # noqa: E402

ADDR = "127.0.0.1"


def policy(mb: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {"embed": torch.randn(32768, 1024, generator=g).bfloat16()}  # 64 MiB
    for i in range(max(0, (mb - 64) // 4)):
        out[f"layers.{i}.w"] = torch.randn(1024, 2048, generator=g).bfloat16()  # 4 MiB
    return out


def _member(rank: int, world: int, args, ports: dict, queue) -> None:
    backend = get_backend("cpu")
    backend.configure_allocator()  # as every portrl worker process (setup_process): freed memory is kept
    torch.set_num_threads(1)
    results = {}
    for (transport, mode), port in ports.items():
        spec = transport_spec(transport)
        w = policy(args.mb)
        if rank == 0:
            sender = make_sender(spec, backend, ADDR, port, world, args.bucket_mb, mode)
            times, stats = [], None
            for i in range(args.repeat + 1):
                if mode == "delta" and i > 0:
                    for name in list(w)[:max(1, int(len(w) * args.changed))]:
                        w[name] = w[name] + 1
                started = time.perf_counter()
                stats = sender.send(w.items(), i)
                times.append(time.perf_counter() - started)
            sender.close()
            results[transport, mode] = {"times": times[1:], "stats": stats}
        else:
            receiver = make_receiver(spec, backend, ADDR, port, rank, world)
            for _ in range(args.repeat + 1):
                for name, t in receiver.receive():
                    w[name].copy_(t)
                    del t
            results[transport, mode] = {"buffer": receiver.last_stats.buffer_bytes if receiver.last_stats else 0}
            receiver.close()
    queue.put((rank, results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--modes", default=",".join(SYNC_MODES))
    p.add_argument("--changed", type=float, default=0.1, help="share of the tensors delta mode changes per sync")
    args = p.parse_args()
    world = 1 + args.receivers
    ports = {(t, m): find_free_port(ADDR) for t in get_backend("cpu").weight_transports
             for m in args.modes.split(",")}
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, args, ports, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    print(f"{args.mb} MiB bfloat16, {args.receivers} receiver(s), {args.bucket_mb} MiB buckets, "
          f"{args.repeat} syncs each (best / median s)")
    for key in ports:
        sent = results[0][key]
        stats, times = sent["stats"], sent["times"]
        print(f"  {key[0]:>13} {key[1]:>8}: {min(times):7.3f} / {statistics.median(times):7.3f} s  "
              f"{stats.bytes / min(times) / 1e9:6.2f} GB/s  {stats.bytes / 2**20:7.1f} MiB in {stats.buckets:3d} "
              f"buckets  buffer: sender {stats.buffer_bytes / 2**20:.0f} MiB, receiver "
              f"{results[1][key]['buffer'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
