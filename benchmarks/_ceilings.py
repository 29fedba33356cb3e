"""What the machine allows: the decode's and the update's ceilings, measured on this process's torch threads.

A GRPO step on a CPU has two halves with different limits (benchmarks/vs_trl.py prints both):

* **decode** is memory-bound: each one-token decode step runs every weight matrix once for the whole batch
  of rows, so it reads :func:`weight_bytes_per_decode_step` bytes (every parameter, except that an untied
  input-embedding table is only gathered row by row and does not count; a tied one counts once, for the
  head). Achieved bandwidth = ``bytes_per_step * decode_steps / decode_seconds``
  (:func:`achieved_bandwidth`). The KV cache's reads are left out (a few percent at 128 new tokens), so
  the figure is a lower bound of the traffic. Ceiling: :func:`memory_read_bandwidth`, the best of a few
  ``torch.sum`` calls over a float32 tensor several times the last-level cache. With R rows per step the
  linears also do ``2 R`` FLOPs per float32 weight (4 bytes), so a machine whose FLOP peak is below
  ``read x R / 2`` cannot read at full bandwidth: the roofline ``min(read, matmul_flops x 2 / R)``
  (:func:`decode_roofline`, R the mean rows per decode step) is printed beside it.
* **the update** is compute-bound: its matmul FLOPs are :func:`update_flops`, the ``6 x params x tokens``
  rule (2 per parameter and token forward, 4 backward) applied separately to the decoder layers and the
  LM head, plus one more forward of the layers (``x 4/3`` on their part) under gradient checkpointing,
  which recomputes each checkpointed layer in backward (the head is not checkpointed); when the update
  replays the rollout's recorded forward (portrl/models/forward_tape.py) the layers run only their backward
  matmuls, ``4 x params x tokens``. Attention's
  ``q k^T`` / ``p v`` products and the elementwise work are left out. Ceiling: :func:`matmul_flops`, the best
  of a few ``n x n @ n x n`` float32 matmuls (``2 n^3`` FLOPs each).

Percentages are achieved / ceiling; both ceilings run on ``torch.get_num_threads()`` threads, which the
caller sets to the threads its workload ran on. :class:`DecodeProbe` times portrl's decode (prefill, steps)
by wrapping the hf engine's fast path (the two ceilings' functions live in backends/cpu/ceilings.py, where the
cpu backend measures its peak with them); :class:`ReplayProbe` tells which updates replayed the rollout's forward;
:func:`report` and :func:`print_report` turn a benchmark side's pooled steps and ceilings into the figures above.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from portrl.backends.cpu.ceilings import (READ_MAX_BYTES, READ_MIN_BYTES, last_level_cache_bytes,  # noqa: F401
                                          matmul_flops, memory_read_bandwidth, read_tensor_bytes)
from portrl.models import forward_tape
from portrl.rollout import fast_decode, hf_engine


def matmul_params(model: torch.nn.Module) -> dict:
    """Matmul parameter counts of a Hugging Face causal LM: ``body`` (the 2-D weights inside the decoder
    layers, ``model.model.layers``), ``head`` (``lm_head.weight``)."""
    body = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    return {"body": body, "head": model.lm_head.weight.numel()}


def weight_bytes_per_decode_step(model: torch.nn.Module) -> int:
    """Bytes of weights one one-token decode step reads: every parameter (each tensor once, so a tied
    embedding/head table counts once), less the input-embedding table when it is not tied to the head
    (a decode step only gathers its batch's rows of it)."""
    params = {id(p): p for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    if embed is not model.lm_head.weight:
        params.pop(id(embed), None)
    return sum(p.numel() * p.element_size() for p in params.values())


def meta_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model of a local HF directory built on the meta device (shapes only, no memory, no weights read)."""
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def update_tokens(prompts: int, rows: int, prompt_tokens: float, response_tokens: float,
                  share_prompts: bool = True) -> dict:
    """Tokens the update's packed forward runs: ``body`` through the decoder layers, ``head`` through the LM head.

    portrl's shared-prompt layout (portrl/models/prefix_sharing.py) runs each distinct prompt once and each
    response without its last token (only a label): ``body = prompt_tokens_distinct + response_tokens - rows``;
    without sharing, every row's prompt runs: ``body = prompt_tokens + response_tokens - rows``. Log-probs
    need the head only at the positions whose label is a response token: ``head = response_tokens``.
    ``prompt_tokens`` is summed over the ``rows`` (each prompt counted once per sample); ``prompts`` distinct
    prompts, each repeated ``rows / prompts`` times.
    """
    body_prompt = prompt_tokens * prompts / rows if share_prompts else prompt_tokens
    return {"body": body_prompt + response_tokens - rows, "head": float(response_tokens)}


def update_flops(params: dict, tokens: dict, checkpointing: bool, replayed: bool = False) -> float:
    """Matmul FLOPs of one update pass: ``2 (3 + r) N_body T_body + 6 N_head T_head`` with ``r = 1`` under
    gradient checkpointing (the layers' forward runs again in backward), else 0: the ``6 N T`` rule, with
    ``x 4/3`` on the checkpointed layers. ``replayed``: the update replayed the rollout's recorded forward
    (portrl/models/forward_tape.py), so the layers run no forward matmul in either pass and their part is the
    backward's ``4 N_body T_body``."""
    r = 1 if checkpointing else 0
    body = 4.0 * params["body"] * tokens["body"] if replayed else 2.0 * (3 + r) * params["body"] * tokens["body"]
    return body + 6.0 * params["head"] * tokens["head"]


def decode_roofline(read_bytes_per_s: float, matmul_flops_per_s: float, mean_rows: float) -> float:
    """Weight bytes per second a decode of ``mean_rows`` rows can reach: ``min(read, flops / (2 R / 4 bytes))``."""
    return min(read_bytes_per_s, matmul_flops_per_s * 2.0 / mean_rows) if mean_rows > 0 else read_bytes_per_s


def achieved_bandwidth(bytes_per_step: int, steps: int, seconds: float) -> float:
    """Bytes per second the decode read: ``bytes_per_step * steps / seconds``."""
    return bytes_per_step * steps / seconds if seconds > 0 else float("nan")


class DecodeProbe:
    """Times the hf engine's fast decode path per generate call, by wrapping (benchmark instrumentation only)
    ``FastDecoder.start`` (fusing / packing the weights, allocating the cache), ``FastDecoder.forward`` (the
    first call of a chunk is the prefill, each later one a one-token decode step) and the engine's
    ``decode_chunk``. Per call: ``start_s``, ``prefill_s``, ``steps``, ``row_steps`` (rows summed over the
    steps), ``decode_forward_s`` (the steps' forwards) and ``decode_s`` (from the prefill's end to the call's
    end: the steps with their sampling and bookkeeping). A model off the fast path leaves no calls. The wrappers stay in place (for every engine of
    the process) until :meth:`close`; ``with DecodeProbe() as probe:`` closes it at the block's end."""

    def __init__(self):
        self.calls: list = []
        self._cur: dict = {}
        cls, probe = fast_decode.FastDecoder, self
        start, forward, chunk = cls.start, cls.forward, hf_engine.decode_chunk
        self._originals = (start, forward, chunk)

        def timed_start(dec, *a, **k):
            t0 = time.perf_counter()
            out = start(dec, *a, **k)
            probe._cur["start_s"] += time.perf_counter() - t0
            return out

        def timed_forward(dec, *a, **k):
            t0 = time.perf_counter()
            out = forward(dec, *a, **k)
            t1 = time.perf_counter()
            cur = probe._cur
            if cur["prefill_end"] is None:
                cur["prefill_s"], cur["prefill_end"] = t1 - t0, t1
            else:
                cur["steps"] += 1
                cur["row_steps"] += a[0].shape[0]  # ids: (rows, 1)
                cur["decode_forward_s"] += t1 - t0
            return out

        def timed_chunk(*a, **k):
            probe._cur = dict(start_s=0.0, prefill_s=0.0, steps=0, row_steps=0, decode_forward_s=0.0,
                              prefill_end=None)
            out = chunk(*a, **k)
            cur = probe._cur
            end = cur.pop("prefill_end")
            cur["decode_s"] = time.perf_counter() - end if end is not None else 0.0
            probe.calls.append(cur)
            return out

        cls.start, cls.forward, hf_engine.decode_chunk = timed_start, timed_forward, timed_chunk

    def close(self) -> None:
        """Put the unwrapped methods back."""
        cls = fast_decode.FastDecoder
        cls.start, cls.forward, hf_engine.decode_chunk = self._originals

    def __enter__(self) -> "DecodeProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take(self) -> dict:
        """The sums over the calls since the last take (one generate call per step here)."""
        keys = ("start_s", "prefill_s", "steps", "row_steps", "decode_forward_s", "decode_s")
        out = {k: sum(c[k] for c in self.calls) for k in keys}
        out["calls"] = len(self.calls)
        self.calls = []
        return out


class ReplayProbe:
    """Counts the update's replays of a recorded rollout forward (``portrl.models.forward_tape.replay_hidden_states``
    calls, benchmark instrumentation only): :meth:`take` is True when one ran since the last take. The wrapper stays
    in place until :meth:`close` (``with ReplayProbe() as probe:``)."""

    def __init__(self):
        self.count = 0
        self._original = forward_tape.replay_hidden_states

        def counted(*a, **k):
            self.count += 1
            return self._original(*a, **k)

        forward_tape.replay_hidden_states = counted

    def take(self) -> bool:
        replayed, self.count = self.count > 0, 0
        return replayed

    def close(self) -> None:
        forward_tape.replay_hidden_states = self._original

    def __enter__(self) -> "ReplayProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report(res: dict, model_dir: str) -> dict:
    """Achieved decode bandwidth and update FLOP/s of portrl's pooled timed steps, and their share of the
    machine's ceilings (the formulas: benchmarks/_ceilings.py). Empty when the run measured no ceilings."""
    if "ceilings" not in res:
        return {}
    model = meta_model(model_dir)
    step_bytes = weight_bytes_per_decode_step(model)
    params = matmul_params(model)
    dec = res["decode"]
    steps, dec_s = sum(d["steps"] for d in dec), sum(d["decode_s"] for d in dec)
    bw = achieved_bandwidth(step_bytes, steps, dec_s)
    fwd_bw = achieved_bandwidth(step_bytes, steps, sum(d["decode_forward_s"] for d in dec))
    up = res["update"]
    flops = sum(update_flops(params, u, res.get("checkpointing", False), u.get("replayed", False)) for u in up)
    up_s = sum(u["seconds"] for u in up)
    read, mm = res["ceilings"]["read"]["bytes_per_s"], res["ceilings"]["matmul"]["flops_per_s"]
    mean_rows = sum(d.get("row_steps", 0) for d in dec) / steps if steps else 0.0
    roof = decode_roofline(read, mm, mean_rows)
    return {
        "weight_bytes_per_step": step_bytes, "decode_steps": steps, "decode_s": dec_s,
        "start_s": sum(d["start_s"] for d in dec), "prefill_s": sum(d["prefill_s"] for d in dec),
        "decode_bw": bw, "decode_forward_bw": fwd_bw, "read_bw": read, "decode_pct": 100 * bw / read,
        "mean_rows": mean_rows, "roofline_bw": roof, "roofline_pct": 100 * bw / roof,
        "params": params, "update_tokens": (sum(u["body"] for u in up), sum(u["head"] for u in up)),
        "update_flops": flops, "update_s": up_s, "update_flops_per_s": flops / up_s if up_s > 0 else float("nan"),
        "matmul_flops_per_s": mm, "update_pct": 100 * flops / up_s / mm if up_s > 0 else float("nan"),
        "checkpointing": res.get("checkpointing", False), "replayed": [bool(u.get("replayed")) for u in up],
        "read_bytes": res["ceilings"]["read"]["bytes"],
        "matmul_n": res["ceilings"]["matmul"]["n"],
    }


def print_report(name: str, c: dict, threads: int) -> None:
    """Print :func:`report` (nothing when it is empty); the last line is machine-readable."""
    if not c:
        return
    print(f"{name}: what the machine allows ({threads} threads, measured in portrl's process after its steps; "
          f"formulas: benchmarks/_ceilings.py)")
    if c["decode_steps"]:
        print(f"  decode: {c['weight_bytes_per_step'] / 1e9:.3f} GB of weights per step x {c['decode_steps']} steps / "
              f"{c['decode_s']:.2f} s = {c['decode_bw'] / 1e9:.1f} GB/s (forwards alone {c['decode_forward_bw'] / 1e9:.1f} "
              f"GB/s; plus prefill {c['prefill_s']:.2f} s, weight fusing/packing {c['start_s']:.2f} s) vs memory read "
              f"{c['read_bw'] / 1e9:.1f} GB/s (sum over {c['read_bytes'] / 2**30:.2f} GiB) = {c['decode_pct']:.0f} % "
              f"(goal >= 60 %)")
        print(f"          at {c['mean_rows']:.1f} rows per step the linears do {c['mean_rows'] / 2:.1f} FLOP per weight "
              f"byte: roofline min(read, matmul FLOP/s x 2 / rows) = {c['roofline_bw'] / 1e9:.1f} GB/s, achieved "
              f"{c['roofline_pct']:.0f} % of it")
    else:
        print("  decode: n/a (the model decoded off the fast path, so no decode steps were timed)")
    rule = "2*(3+1)*N_body*T_body + 6*N_head*T_head (gradient checkpointing)" if c["checkpointing"] else \
        "6*N_body*T_body + 6*N_head*T_head"
    if any(c["replayed"]):
        rule = (f"4*N_body*T_body + 6*N_head*T_head (the rollout's forward replayed in {sum(c['replayed'])} of "
                f"{len(c['replayed'])} updates; the others {rule})")
    print(f"  update: {rule}, N_body {c['params']['body'] / 1e6:.1f}M, N_head {c['params']['head'] / 1e6:.1f}M, "
          f"T_body {c['update_tokens'][0]:.0f}, T_head {c['update_tokens'][1]:.0f} -> {c['update_flops'] / 1e12:.2f} "
          f"TFLOP / {c['update_s']:.2f} s = {c['update_flops_per_s'] / 1e9:.0f} GFLOP/s vs {c['matmul_n']}^3 matmul "
          f"{c['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s = {c['update_pct']:.0f} % (goal >= 70 %)")
    print(f"{name}: decode_bandwidth_pct={c['decode_pct']:.1f} update_flops_pct={c['update_pct']:.1f}")
