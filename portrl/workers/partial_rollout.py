"""Version-tagged generation on a separated rollout worker: staged weights and partial rollout.

A *policy version* is the trainer step whose update produced the weights (0: the starting policy). The trainer
sends each version to the rollout workers with the weight transport (portrl/workers/weight_sync.py).

* :class:`StagedWeights`: in the asynchronous modes a listener thread of the rollout worker receives every version
  while the worker generates and stages it here; the worker loads the newest staged version into its engine
  between generations (:meth:`StagedWeights.apply`), never during one. ``arrived`` is set while a version newer
  than the engine's waits.
* :func:`generate_versioned`: one generation request. It first waits for ``min_version`` (the version the trainer
  had sent when it asked) and loads what is staged. With ``partial``, an engine that is ``interruptible`` watches
  ``arrived``: new weights stop the generations in flight after the token being sampled; each row keeps its tokens
  and per-token log-probs, the worker loads the new weights and continues the row from prompt + tokens so far
  (token ids in, token ids out: nothing is decoded and re-encoded), until every row stopped or reached
  ``max_new_tokens``. Rows stopped with prefixes of different lengths (an engine's requests still queued, or
  chunks decoded one after another) continue in one call per length. Every response token records the version that produced it (``rollout_versions``, (B, T)).
  A continuation samples with seed ``seed + 7919 * k`` for its k-th segment.

The staged copy costs one extra copy of the weights in the rollout worker's memory.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from portrl.rollout import FINISH_ABORT, SamplingParams

Named = List[Tuple[str, torch.Tensor]]


class StagedWeights:
    """The newest policy version received by a rollout worker and not yet in its engine (thread-safe)."""

    def __init__(self, version: int = 0):
        self.version = version  # the engine's version
        self.arrived = threading.Event()  # set while a newer version is staged
        self._cond = threading.Condition()
        self._staged: Optional[Tuple[int, Named]] = None
        self.error: Optional[BaseException] = None  # the listener thread's failure, raised by the next wait_for

    def stage(self, version: int, named: Named) -> None:
        """Keep ``named`` as version ``version`` (a newer staged version replaces an older one)."""
        with self._cond:
            if self._staged is None or version >= self._staged[0]:
                self._staged = (version, named)
            self.arrived.set()
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.error = exc
            self._cond.notify_all()

    def wait_for(self, min_version: int, timeout_s: Optional[float] = 600.0) -> None:
        """Block until version ``min_version`` (or newer) is in the engine or staged."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.error is not None or self.version >= min_version
                                     or (self._staged is not None and self._staged[0] >= min_version), timeout_s)
            if self.error is not None:
                raise RuntimeError(f"the weight listener of this rollout worker failed: {self.error}") from self.error
            if not ok:
                raise TimeoutError(f"policy version {min_version} did not reach this rollout worker in {timeout_s} s "
                                   f"(it has version {self.version})")

    def apply(self, load: Callable[[Named], None]) -> int:
        """Load the staged version with ``load`` (the engine's update_weights) if there is one; the engine's
        version after it."""
        with self._cond:
            staged, self._staged = self._staged, None
            self.arrived.clear()
        if staged is not None:
            load(staged[1])
            self.version = staged[0]
        return self.version


def _generate(engine: Any, prompts: Sequence[Sequence[int]], params: SamplingParams,
              images: Optional[Sequence[Any]]) -> Any:
    if images is not None:
        return engine.generate([list(p) for p in prompts], params, multi_modal=list(images))
    return engine.generate([list(p) for p in prompts], params)


def generate_versioned(engine: Any, staged: StagedWeights, prompt_ids: Sequence[Sequence[int]],
                       params: SamplingParams, images: Optional[Sequence[Any]] = None, partial: bool = False,
                       min_version: int = 0) -> Tuple[List[List[int]], List[List[float]], List[str], List[List[int]]]:
    """``(response_ids, logprobs, finish_reasons, versions)`` per row (prompt-major, ``params.n`` per prompt); see
    the module docstring. ``images``: per prompt the engine's ``multi_modal`` entry, or None for text prompts."""
    staged.wait_for(min_version)
    load = engine.update_weights
    version = staged.apply(load)
    watch = partial and engine.capabilities.interruptible
    if watch:
        engine.set_interrupt(staged.arrived)
    try:
        out = _generate(engine, prompt_ids, params, images)
        ids, lps, reasons = list(out.response_ids), list(out.logprobs), list(out.finish_reasons)
        versions = [[version] * len(r) for r in ids]
        segment = 0
        while watch and FINISH_ABORT in reasons:
            version = staged.apply(load)
            segment += 1
            seed = None if params.seed is None else params.seed + 7919 * segment
            stopped = [r for r, why in enumerate(reasons) if why == FINISH_ABORT]
            # rows stopped by one interrupt have one length; an engine that decodes in chunks stops each chunk's
            # rows at another length: each length continues with its own token budget
            for done in sorted({len(ids[r]) for r in stopped}):
                rows = [r for r in stopped if len(ids[r]) == done]
                more = replace(params, n=1, max_new_tokens=params.max_new_tokens - done, seed=seed)
                cont = _generate(engine, [list(prompt_ids[r // params.n]) + ids[r] for r in rows], more,
                                 None if images is None else [images[r // params.n] for r in rows])
                for r, new_ids, new_lps, why in zip(rows, cont.response_ids, cont.logprobs, cont.finish_reasons):
                    ids[r] = ids[r] + list(new_ids)
                    lps[r] = lps[r] + list(new_lps)
                    versions[r] = versions[r] + [version] * len(new_ids)
                    reasons[r] = why
    finally:
        if watch:
            engine.set_interrupt(None)
    return ids, lps, reasons, versions


def versions_tensor(versions: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """The per-token versions as a (B, width) long tensor, right-padded with 0 (the response mask says which
    entries are tokens)."""
    out = torch.zeros(len(versions), width, dtype=torch.long)
    for r, v in enumerate(versions):
        if v:
            out[r, :len(v)] = torch.as_tensor(v, dtype=torch.long)
    return out


def staleness_metrics(versions: torch.Tensor, response_mask: torch.Tensor, policy_version: int) -> Dict[str, float]:
    """``async/staleness_{min,mean,max}``: over the response tokens, how many versions each lags ``policy_version``
    (the version the update starts from); ``async/oldest_version``. ``versions``: (B, T) per-token versions."""
    mask = response_mask.bool()
    lag = (policy_version - versions)[mask].float()
    if lag.numel() == 0:
        return {}
    return {"async/staleness_min": float(lag.min()), "async/staleness_mean": float(lag.mean()),
            "async/staleness_max": float(lag.max()), "async/oldest_version": float(versions[mask].min())}
