"""vLLM's request loop, run by portrl itself for a ``generate`` that an interrupt may end early (partial rollout).

``LLM.generate`` adds its requests with ``output_kind=FINAL_ONLY`` and steps the engine until every request has
finished: it cannot stop early, and vLLM's offline engine reports nothing for a request aborted by
``abort_request``. :func:`run_interruptible` therefore drives the offline engine ``LLM.llm_engine`` through its
documented API (vLLM 0.11 - 0.32): ``add_request(request_id, prompt, params)``, ``step()``,
``has_unfinished_requests()``, ``abort_request(request_ids)``. Requests are added with ``output_kind=CUMULATIVE``:
every step reports each running sample's tokens and log-probs so far, and the loop keeps the latest report of every
sample. The event is checked after every step that reported tokens (so that one call always samples something);
once it is set the loop stops and aborts the requests not finished. A sample keeps exactly the tokens vLLM had
reported; a token being sampled in that moment is dropped with its request.

Prompts are rendered by ``LLM._preprocess_cmpl_one`` where the LLM has it (vLLM 0.32: what ``LLM.generate`` itself
does with a prompt; ``add_request`` deprecates raw prompts there); without it the prompt dict goes to
``add_request``. The request ids (``portrl-<call>-<prompt>``) cannot collide with ``LLM.generate``'s numeric ones;
``n`` > 1 fans out into vLLM's child requests as in ``LLM.generate`` (the same seeds: ``seed + sample index``), so
that a call never interrupted samples what ``LLM.generate`` would.
"""

from __future__ import annotations

import itertools
import threading
from types import ModuleType
from typing import Any, Sequence

_calls = itertools.count()


def run_interruptible(vllm: ModuleType, llm: Any, requests: Sequence[Any], sampling: Any,
                      event: threading.Event) -> list[list[Any | None]]:
    """Generate ``requests`` (vLLM prompts, :func:`translate.to_vllm_prompts`) with ``sampling`` (its ``n`` samples
    each) until all finished or ``event`` is set. Per prompt (in order), per sample index, the latest cumulative
    ``CompletionOutput`` (None: the sample had not reported a token); samples without a finish reason were aborted."""
    engine = llm.llm_engine
    sampling.output_kind = vllm.sampling_params.RequestOutputKind.CUMULATIVE
    render = getattr(llm, "_preprocess_cmpl_one", None)
    call = next(_calls)
    request_ids = [f"portrl-{call}-{i}" for i in range(len(requests))]
    latest: dict[str, list[Any | None]] = {rid: [None] * int(sampling.n) for rid in request_ids}
    added: list[str] = []
    try:
        for rid, request in zip(request_ids, requests):
            engine.add_request(rid, render(request) if render is not None else request, sampling)
            added.append(rid)
        sampled = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                samples = latest.get(out.request_id)
                if samples is None:  # a late report of a request aborted by an earlier call
                    continue
                for comp in out.outputs:
                    samples[comp.index] = comp
                    sampled = True
            if sampled and event.is_set():
                break
    finally:
        unfinished = [rid for rid in added if any(c is None or c.finish_reason is None for c in latest[rid])]
        if unfinished:
            engine.abort_request(unfinished)
    return [latest[rid] for rid in request_ids]
