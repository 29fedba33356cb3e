"""Ulysses sequence parallelism on the CPU: peak activation memory and step time per rank of one long packed
sequence at SP=1, 2 and 4 (issue 60, item 8).

    python benchmarks/sequence_parallel.py [--tokens 16384] [--prompt 512] [--sp 1 2 4] [--checkpointing on]
                                           [--hidden 256] [--layers 4] [--heads 8] [--kv-heads 2] [--steps 2]

A small Qwen2 (portrl.models.write_tiny_model: by default hidden 256, 4 layers, 8 heads over 2 key/value heads,
the 128-token arith vocabulary, random float32 weights) scores one packed sequence of ``--tokens`` tokens
(``--prompt`` prompt tokens, the rest response): forward + backward of the response log-probs
(portrl.models.compute_logprobs through portrl.workers.parallel.ForwardModule), with the decoder layers'
gradient checkpointing on and/or off (``--checkpointing on|off|both``; load_causal_lm). Each SP size runs in its
own spawned processes, one torch thread each: SP=1 is one process with the plain model (no process group); SP=s
is ``s`` processes over gloo with ``wrap_model(..., mesh=build_mesh("cpu", MeshShape.of(s, sp=s), rank))``, so
FSDP2 shards the model state over the same ranks and the decoder runs Ulysses attention on ``tokens / s`` tokens
per rank (portrl.models.sequence_parallel).

Measured per rank (the table shows the largest over the ranks):

* peak activation memory: the peak bytes of live tensors during a step above those live before it, counted by
  the CPU backend's counting allocator (``Backend.configure_allocator`` / ``memory_stats()["peak_allocated"]``,
  backends/cpu/heap.py: every tensor allocation; what a GPU's ``max_memory_allocated`` is). The first step's
  gradients stay allocated (accumulated, never freed), so later steps count activations, recomputed
  activations, FSDP2's gathered parameters and communication buffers, not the gradients. As a cross-check, the
  process's resident growth during the first step (VmHWM after the step minus VmRSS before it, the high-water
  mark reset by writing 5 to /proc/self/clear_refs): it includes the gradients, allocator slack and pages the
  heap keeps, and is 0 where clear_refs cannot be written;
* step time: the median over ``--steps`` steps after the first;
* the sequence-parallel collectives: seconds inside portrl.models.sequence_parallel's all-to-all (attention's
  head/token exchange, forward and backward) and the token gather / its reduce-scatter, timed by wrapping them in
  the rank process, and their share of the step. A collective's time includes waiting for the slowest rank, so on
  a CPU with fewer cores than ranks it also holds the ranks' skew.

Also checked: the response log-probs of every SP size against SP=1 (max absolute difference) and the gradient norm
after the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

GOALS = {2: 0.6, 4: 0.35}  # issue 60: peak activation memory per rank against SP=1


def _reset_hwm() -> bool:
    """Reset this process's resident high-water mark to its resident size now (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _CollectiveTimer:
    """Seconds spent in sequence_parallel's collectives, by wrapping the module globals its autograd functions
    call (so forward and backward are both timed)."""

    NAMES = {"_all_to_all": "all_to_all", "_all_gather_single": "gather", "_reduce_scatter_single": "gather"}

    def __init__(self):
        from portrl.models import sequence_parallel as sp

        self.seconds = {"all_to_all": 0.0, "gather": 0.0}
        for name, kind in self.NAMES.items():
            setattr(sp, name, self._timed(getattr(sp, name), kind))

    def _timed(self, fn, kind: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[kind] += time.perf_counter() - start
            return out

        return wrapper

    def take(self) -> dict:
        out, self.seconds = self.seconds, {"all_to_all": 0.0, "gather": 0.0}
        return out


def _batch(tokens: int, prompt: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row of ``tokens`` random ids (no padding) and fixed per-token loss weights of its response."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, tokens), generator=g)
    weights = torch.randn(1, tokens - prompt, generator=g) / (tokens - prompt)
    return ids, torch.ones_like(ids), weights


def _build(model_dir: str, sp: int, rank: int, checkpointing: bool):
    from portrl.device.mesh_shape import MeshShape
    from portrl.device.registry import get_backend
    from portrl.models import compute_logprobs
    from portrl.models.loader import load_causal_lm
    from portrl.workers.mesh import build_mesh
    from portrl.workers.parallel import ForwardModule, wrap_model

    backend = get_backend("cpu")
    model = load_causal_lm(model_dir, "float32", backend=backend, gradient_checkpointing=checkpointing)
    model.train()
    module: torch.nn.Module = ForwardModule(model, compute_logprobs)
    if sp > 1:
        pm = build_mesh("cpu", MeshShape.of(sp, sp=sp), rank)
        module = wrap_model(module, "fsdp", backend, device=torch.device("cpu"), mesh=pm)
    return backend, model, module


def _measure(backend, model, module, opts: dict, timer: _CollectiveTimer) -> dict:
    """The first step (memory, resident growth, gradient norm, log-probs), then ``steps`` timed ones."""
    from portrl.workers.parallel import clip_grad_norm

    ids, mask, weights = _batch(opts["tokens"], opts["prompt"], opts["vocab"])
    response = opts["tokens"] - opts["prompt"]

    def step():
        logp, _ = module(ids, mask, response)
        (logp * weights).sum().backward()
        return logp.detach()

    out: dict = {"peak_mb": [], "step_s": [], "all_to_all_s": [], "gather_s": []}
    for i in range(opts["steps"] + 1):
        live = backend.memory_stats().get("allocated")
        backend.reset_peak_memory()
        if i == 0:
            reset = _reset_hwm()
            rss = _common.status_kb("VmRSS")
        start = time.perf_counter()
        logp = step()
        seconds = time.perf_counter() - start
        stats = backend.memory_stats()
        comm = timer.take()
        if i == 0:
            out["resident_growth_mb"] = (_common.status_kb("VmHWM") - rss) / 1024 if reset else 0.0
            out["grad_norm"] = clip_grad_norm(model.parameters(), 0.0)
            out["logp"] = logp[0].tolist()
            continue
        out["step_s"].append(seconds)
        if live is not None:
            out["peak_mb"].append((stats["peak_allocated"] - live) / 2**20)
        out["all_to_all_s"].append(comm["all_to_all"])
        out["gather_s"].append(comm["gather"])
    return out


def _rank(rank: int, sp: int, checkpointing: bool, opts: dict, model_dir: str, port: int, out_dir: str) -> None:
    """One rank (a spawned process): build, measure, write ``<out_dir>/rank<r>.json``."""
    torch.set_num_threads(opts["threads"])
    from portrl.device.registry import get_backend
    from portrl.workers.parallel import init_distributed

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank otherwise
    get_backend("cpu").configure_allocator()  # before the model: every tensor counted
    timer = _CollectiveTimer()
    if sp > 1:
        init_distributed(get_backend("cpu"), rank, sp, "127.0.0.1", port, timeout_s=1800)
    backend, model, module = _build(model_dir, sp, rank, checkpointing)
    result = _measure(backend, model, module, opts, timer)
    if rank:
        result.pop("logp")
    tmp = Path(out_dir) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(Path(out_dir) / f"rank{rank}.json")
    if sp > 1:
        torch.distributed.destroy_process_group()


def _run(sp: int, checkpointing: bool, opts: dict, model_dir: str, work: Path) -> list[dict]:
    from portrl.workers.parallel import find_free_port

    out = work / f"sp{sp}_{'ckpt' if checkpointing else 'nockpt'}"
    out.mkdir()
    torch_mp.start_processes(_rank, args=(sp, checkpointing, opts, model_dir, find_free_port(), str(out)),
                             nprocs=sp, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(sp)]


def _summary(ranks: list[dict]) -> dict:
    """The largest peak over the ranks; rank 0's median step and collective seconds."""
    r0 = ranks[0]
    step = statistics.median(r0["step_s"])
    comm = statistics.median(a + g for a, g in zip(r0["all_to_all_s"], r0["gather_s"]))
    peaks = [max(r["peak_mb"]) if r["peak_mb"] else float("nan") for r in ranks]
    return {"peak_mb": max(peaks), "resident_mb": max(r["resident_growth_mb"] for r in ranks), "step_s": step,
            "comm_s": comm, "a2a_s": statistics.median(r0["all_to_all_s"]), "grad_norm": r0["grad_norm"],
            "logp": r0["logp"]}


def _report(mode: str, rows: dict[int, dict]) -> list[str]:
    """The table of one checkpointing mode, ratios against SP=1; returns the goal verdict lines."""
    base = rows.get(1)
    print(f"\ngradient checkpointing {mode}:")
    print(f"{'SP':>3} {'peak MiB/rank':>14} {'x SP=1':>7} {'goal':>7} {'resident MiB':>13} {'step s':>8} "
          f"{'x SP=1':>7} {'SP comm s':>10} {'(a2a)':>7} {'comm %':>7} {'|dlogp|':>9} {'grad norm':>10}")
    verdicts = []
    for sp, s in rows.items():
        mem = s["peak_mb"] / base["peak_mb"] if base else float("nan")
        step = s["step_s"] / base["step_s"] if base else float("nan")
        goal = GOALS.get(sp)
        dlogp = max(abs(a - b) for a, b in zip(s["logp"], base["logp"])) if base else float("nan")
        print(f"{sp:>3} {s['peak_mb']:>14.1f} {mem:>7.3f} {'<= ' + str(goal) if goal else '':>7} "
              f"{s['resident_mb']:>13.1f} {s['step_s']:>8.2f} {step:>7.2f} {s['comm_s']:>10.2f} {s['a2a_s']:>7.2f} "
              f"{100 * s['comm_s'] / s['step_s']:>6.1f}% {dlogp:>9.1e} {s['grad_norm']:>10.5f}")
        if goal and base:
            verdicts.append(f"checkpointing {mode}, SP={sp}: peak {mem:.3f}x SP=1, goal <= {goal}: "
                            f"{'met' if mem <= goal else 'NOT met'}")
    return verdicts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the packed sequence (prompt + response)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (the rest is the response)")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel sizes (1: one process)")
    p.add_argument("--checkpointing", choices=("on", "off", "both"), default="on")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = p.parse_args(argv)
    if not 0 < a.prompt < a.tokens or any(a.tokens % s for s in a.sp) or a.steps < 1:
        p.error(f"need 0 < --prompt < --tokens, every --sp dividing --tokens ({a.tokens}) and --steps >= 1")
    from portrl.models import write_tiny_model

    info = _common.host_info()
    print(_common.host_line(info))
    print(f"cores usable: {len(os.sched_getaffinity(0))} | torch {torch.__version__} | {a.threads} torch thread(s) "
          f"per rank | load average {os.getloadavg()[0]:.1f}")
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.checkpointing]
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="portrl-bench-sp-") as tmp:
        work = Path(tmp)
        model_dir = write_tiny_model(work / "model", hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                                     num_kv_heads=a.kv_heads, max_position_embeddings=max(2048, a.tokens), seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        opts = {"tokens": a.tokens, "prompt": a.prompt, "vocab": vocab, "steps": a.steps, "threads": a.threads}
        print(f"model: hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} KV heads, vocabulary "
              f"{vocab}, float32; one packed sequence of {a.tokens} tokens ({a.prompt} prompt + "
              f"{a.tokens - a.prompt} response), forward + backward of the response log-probs, "
              f"median of {a.steps} step(s) after the first")
        for ckpt in modes:
            rows = {}
            for sp in a.sp:
                t0 = time.perf_counter()
                rows[sp] = _summary(_run(sp, ckpt, opts, str(model_dir), work))
                print(f"  SP={sp} checkpointing {'on' if ckpt else 'off'}: {time.perf_counter() - t0:.0f} s",
                      flush=True)
            verdicts += _report("on" if ckpt else "off", rows)
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
