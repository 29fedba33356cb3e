"""Per-step metrics from a trained batch (verl's names) and timing.

Data metrics: ``critic/score/{mean,max,min}`` (sequence score from the reward), ``critic/rewards/*``
(after KL in the reward), ``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*`` and
``critic/vf_explained_var`` (when a critic runs; the values are the critic's before this step's update,
so it is measured on data the critic has not trained on; left out when every response scored the
same), ``critic/acc/mean`` and per data source ``critic/score/<src>``, ``critic/acc/<src>``,
``response_length/{mean,max,min,clip_ratio}``, ``prompt_length/{mean,max,min}``. As verl's, a response's length is
all its valid tokens (portrl.workers.batch.response_lengths): in a multi-turn rollout the tool / environment tokens
between the model's turns count, as they count against ``data.max_response_length`` (``clip_ratio``: the share of
responses that reached it); a multi-turn batch (meta ``num_turns``) adds ``response_length/model_mean``, the tokens
the model wrote. Advantages, returns and values are over the model's tokens (``response_mask``). Throughput:
``perf/tokens_per_s`` (prompt + response tokens of the step / step time),
``perf/gen_tokens_per_s`` (response tokens / generation time). Per phase: ``timing_s/<phase>`` and, when the
workers run in the trainer's process, ``memory/peak_gib/<phase>`` (:class:`Timer`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch

from portrl.algo import explained_variance
from portrl.agent.trajectory import META_NUM_TURNS
from portrl.progress import activity
from portrl.workers.batch import Batch, response_lengths


def _stats(prefix: str, values: torch.Tensor) -> Dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def data_metrics(batch: Batch, max_response_length: int) -> Dict[str, float]:
    t = batch.tensors
    mask = t["response_mask"].bool()
    resp_len = response_lengths(batch).float()
    P = t["prompts"].shape[1]
    prompt_len = t["attention_mask"][:, :P].sum(-1).float()
    out: Dict[str, float] = {}
    out.update(_stats("critic/score", t["token_level_scores"].sum(-1)))
    rewards = t.get("token_level_rewards", t["token_level_scores"])
    out.update(_stats("critic/rewards", rewards.sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in t:
            out.update(_stats(name, t[key][mask]))
    if "values" in t and "returns" in t:
        ev = float(explained_variance(t["returns"], t["values"], mask))
        if math.isfinite(ev):
            out["critic/vf_explained_var"] = ev
    if "acc" in t:
        out["critic/acc/mean"] = float(t["acc"].float().mean())
    sources = batch.meta.get("data_source")
    if sources is not None and len(set(sources)) > 0:
        score = t["token_level_scores"].sum(-1)
        groups: Dict[str, list] = {}
        for i, s in enumerate(sources):
            groups.setdefault(str(s), []).append(i)
        for s, idx in groups.items():
            ix = torch.tensor(idx)
            out[f"critic/score/{s}"] = float(score[ix].mean())
            if "acc" in t:
                out[f"critic/acc/{s}"] = float(t["acc"][ix].float().mean())
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    if META_NUM_TURNS in batch.meta:
        out["response_length/model_mean"] = float(mask.sum(-1).float().mean())
    out.update(_stats("prompt_length", prompt_len))
    return out


class Timer:
    """Collects ``timing_s/<name>`` durations: ``with timer("gen"): ...``; phases may nest.

    With ``memory`` (a Backend whose work runs in this process), also ``memory/peak_gib/<name>``: the highest
    ``memory_stats()["peak_allocated"]`` seen during the phase (the device's tensor memory; on the CPU the bytes
    of live tensors), the peak restarted at each phase's start (``reset_peak_memory``) and folded into every
    enclosing phase, so an outer phase's peak includes its inner ones; and where the backend reports the
    process's resident high-water mark (``peak_resident``: the CPU), ``memory/peak_resident_gib``: the highest
    resident size of the process so far (what the operating system saw it hold, memory it kept included).

    With ``ranges`` (a Backend; a profiled step, portrl.trainer.profiling), each phase is also a
    ``torch.profiler.record_function("portrl/<name>")`` range of the step's trace and a range of the vendor's range
    API (:meth:`Backend.range_push`: NVTX, roctx, mstx), for the system profilers.
    """

    def __init__(self, memory: Any = None, ranges: Any = None) -> None:
        self.times: Dict[str, float] = {}
        self.peaks: Dict[str, int] = {}
        self.resident_peak: int | None = None
        self._memory = memory
        self._ranges = ranges
        self._open: List[str] = []

    def _fold_peak(self) -> None:
        stats = self._memory.memory_stats()
        peak = stats.get("peak_allocated")
        if peak is not None:
            for name in self._open:
                self.peaks[name] = max(self.peaks.get(name, 0), int(peak))
        if stats.get("peak_resident") is not None:
            self.resident_peak = max(self.resident_peak or 0, int(stats["peak_resident"]))

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._memory is not None:
            self._fold_peak()  # what the enclosing phases reached so far, before the restart
            self._memory.reset_peak_memory()
        self._open.append(name)
        t0 = time.perf_counter()
        try:
            with activity(name):  # the console shows the phase while it runs (portrl.progress)
                if self._ranges is None:
                    yield
                else:
                    self._ranges.range_push(f"portrl/{name}")
                    try:
                        with torch.profiler.record_function(f"portrl/{name}"):
                            yield
                    finally:
                        self._ranges.range_pop()
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if self._memory is not None:
                self._fold_peak()
            self._open.pop()

    def metrics(self) -> Dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        out.update({f"memory/peak_gib/{k}": v / 2**30 for k, v in self.peaks.items()})
        if self.resident_peak is not None:
            out["memory/peak_resident_gib"] = self.resident_peak / 2**30
        return out
