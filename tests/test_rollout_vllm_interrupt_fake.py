"""The vllm engine's interruptible generate (backends/vllm/request_loop.py) against a stand-in of vLLM's offline
engine (``LLM.llm_engine``: ``add_request`` / ``step`` / ``has_unfinished_requests`` / ``abort_request``, cumulative
outputs, ``n`` fanned out into child samples, at most ``max_running`` samples per step as vLLM's scheduler limits
them), and partial rollout on it (portrl/workers/partial_rollout.py): rows stopped at different lengths (samples
still queued have none) continue under the new weights. The real engine: tests/test_partial_rollout_vllm.py."""

from __future__ import annotations

import threading
import types

import pytest
from test_partial_rollout import ArriveOnCheck
from test_rollout_vllm_fake import Backend, CompletionOutput, FakeLLM, Logprob, RequestOutput, fake_vllm  # noqa: F401

from portrl.rollout import FINISH_ABORT, FINISH_LENGTH, SamplingParams, make_engine
from portrl.workers.partial_rollout import StagedWeights, generate_versioned

CUMULATIVE = "cumulative"


def token(version: int, prompt_len: int, pos: int) -> int:
    """The fake model's token at position ``pos`` (context length ``prompt_len + pos``) under weights ``version``."""
    return 1000 * version + prompt_len + pos


class FakeLLMEngine:
    """vLLM's offline engine: each step gives one token to each of the first ``max_running`` unfinished samples
    (in the order added) and reports their cumulative outputs; aborted requests are dropped silently."""

    def __init__(self, max_running: int):
        self.max_running, self.version = max_running, 0
        self.samples: list[dict] = []  # {rid, index, prompt, max_tokens, tokens, logprobs, reason}
        self.aborted: list[list[str]] = []
        self.kinds: list[str] = []

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and all(s["rid"] != request_id for s in self.samples)
        self.kinds.append(params.output_kind)
        for j in range(params.n):
            self.samples.append(dict(rid=request_id, index=j, prompt=list(prompt["prompt_token_ids"]),
                                     max_tokens=params.max_tokens, tokens=[], logprobs=[], reason=None))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return any(s["reason"] is None for s in self.samples)

    def step(self):
        outs = []
        for s in [s for s in self.samples if s["reason"] is None][: self.max_running]:
            tok = token(self.version, len(s["prompt"]), len(s["tokens"]))
            s["tokens"].append(tok)
            s["logprobs"].append({tok: Logprob(-0.1 * len(s["tokens"]) - self.version)})
            if len(s["tokens"]) == s["max_tokens"]:
                s["reason"] = "length"
            outs.append(RequestOutput(s["rid"], s["prompt"], [CompletionOutput(s["index"], s["tokens"], s["logprobs"],
                                                                               s["reason"])]))
        return outs

    def abort_request(self, request_ids):
        self.aborted.append(list(request_ids))
        self.samples = [s for s in self.samples if s["rid"] not in request_ids]


class CheckCounter(threading.Event):
    """An event that is set at its ``after``-th ``is_set()`` check (the loop checks once per step)."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.checks = after, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks == self.after:
            self.set()
        return super().is_set()


@pytest.fixture
def engine(fake_vllm):  # noqa: F811
    fake_vllm.sampling_params = types.SimpleNamespace(RequestOutputKind=types.SimpleNamespace(CUMULATIVE=CUMULATIVE))
    eng = make_engine("vllm", model_path="/m", tokenizer=None, backend=Backend())
    FakeLLM.instances[-1].llm_engine = FakeLLMEngine(max_running=4)
    return eng


def test_a_set_event_aborts_the_unfinished_samples_with_what_they_have(engine):
    core = engine.llm.llm_engine
    engine.set_interrupt(CheckCounter(after=2))
    out = engine.generate([[1, 2], [3], [4, 5, 6]], SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(9,)))
    assert core.kinds == [CUMULATIVE] * 3 and not engine.llm.calls  # the request loop, not LLM.generate
    # 4 samples ran 2 steps; prompt 2's samples were still queued
    assert out.response_ids == [[2, 3], [2, 3], [1, 2], [1, 2], [], []]
    assert out.logprobs[0] == pytest.approx([-0.1, -0.2]) and out.logprobs[4] == []
    assert out.finish_reasons == [FINISH_ABORT] * 6
    assert len(core.aborted) == 1 and len(core.aborted[0]) == 3 and not core.has_unfinished_requests()

    engine.set_interrupt(threading.Event())  # never set: the loop runs every sample to its end
    done = engine.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=3))
    assert done.response_ids == [[2, 3, 4]] * 2 + [[1, 2, 3]] * 2 and done.finish_reasons == [FINISH_LENGTH] * 4
    assert len(core.aborted) == 1  # nothing left to abort
    engine.set_interrupt(None)


def test_partial_rollout_continues_rows_of_different_lengths_under_new_weights(engine):
    core = engine.llm.llm_engine
    loaded = []

    def load(named):  # the engine's update_weights: the stand-in's weights are a version number
        loaded.append(named)
        core.version = 1

    engine.update_weights = load
    staged = StagedWeights(version=0)
    staged.arrived = ArriveOnCheck(staged, after=2, version=1, named=[("w", None)])
    prompts = [[1, 2], [3], [4, 5, 6]]
    ids, lps, reasons, versions = generate_versioned(engine, staged, prompts, SamplingParams(n=2, max_new_tokens=5),
                                                     partial=True)
    assert staged.version == 1 and loaded == [[("w", None)]]
    assert reasons == [FINISH_LENGTH] * 6 and all(len(r) == 5 for r in ids)
    for r, row in enumerate(ids):
        p = len(prompts[r // 2])
        kept = 2 if r < 4 else 0  # 2 tokens under version 0 before the stop; the queued samples had none
        assert versions[r] == [0] * kept + [1] * (5 - kept)
        assert row == [token(0, p, k) for k in range(kept)] + [token(1, p, k) for k in range(kept, 5)]
        assert len(lps[r]) == 5 and lps[r][:kept] == pytest.approx([-0.1 * (k + 1) for k in range(kept)])
    assert not core.has_unfinished_requests()
