"""Run a function on ``world`` CPU processes joined in one gloo process group and collect each rank's result:
what the tests that compare a sharded computation with one rank share (tests/test_ops_logprobs_tp.py,
tests/test_tensor_parallel_vl.py).

``work(rank, world, *args)`` must be a module-level function (it travels to the processes by name); its result is
sent back through ``torch.save``. A rank's failure is an AssertionError with that rank's traceback.
"""

from __future__ import annotations

import io
import traceback
from typing import Any, Callable, Dict, Sequence

import torch
import torch.distributed as dist

from portrl.device import get_backend
from portrl.workers.parallel import find_free_port, init_distributed

ADDR = "127.0.0.1"


def _member(rank: int, world: int, port: int, work: Callable[..., Any], args: tuple, queue) -> None:
    try:
        torch.set_num_threads(1)
        init_distributed(get_backend("cpu"), rank, world, ADDR, port, timeout_s=120)
        buf = io.BytesIO()
        torch.save(work(rank, world, *args), buf)
        queue.put((rank, buf.getvalue(), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(work: Callable[..., Any], world: int, args: Sequence[Any] = (), *, start_method: str = "spawn",
              timeout_s: float = 180) -> Dict[int, Any]:
    """``{rank: work(rank, world, *args)}`` of ``world`` processes started with ``start_method``."""
    ctx: Any = torch.multiprocessing.get_context(start_method)
    queue = ctx.Queue()
    port = find_free_port(ADDR)
    procs = [ctx.Process(target=_member, args=(r, world, port, work, tuple(args), queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, payload, error = queue.get(timeout=timeout_s)
            assert error is None, f"rank {rank} of {world} failed:\n{error}"
            results[rank] = torch.load(io.BytesIO(payload))
        return results
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
