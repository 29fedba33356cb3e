"""The machine-ceiling formulas of benchmarks/_ceilings.py (used by benchmarks/vs_trl.py --configs qwen2.5-0.5b):
weight bytes per decode step, matmul parameters, the update's token counts against portrl's own shared-prompt
layout, the FLOP rule, the two micro-benchmarks' arithmetic, and the decode probe on a real tiny model."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from portrl.models import load_causal_lm, write_tiny_model
from portrl.models.prefix_sharing import plan_shared_prompts
from portrl.rollout import fast_decode, hf_engine
from portrl.rollout.hf_engine import HFEngine
from portrl.rollout.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _ceilings  # noqa: E402
import _common  # noqa: E402

QWEN25_05B_PARAMS = 494_032_768  # Qwen2.5-0.5B-Instruct's published parameter count (tied embeddings)


def _meta(**fields) -> torch.nn.Module:
    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**fields))


def test_qwen25_05b_weight_bytes_and_matmul_params():
    model = _meta(**_common.QWEN25_05B_CONFIG)
    assert sum(p.numel() for p in model.parameters()) == QWEN25_05B_PARAMS
    # tied: the 151936 x 896 table is read once per step, by the head
    assert _ceilings.weight_bytes_per_decode_step(model) == 4 * QWEN25_05B_PARAMS
    h, kv, ff, layers = 896, 2 * 64, 4864, 24
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ff  # q/k/v, o, gate/up/down weights (biases are 1-D)
    assert _ceilings.matmul_params(model) == {"body": layers * per_layer, "head": 151936 * h}


def test_untied_embedding_is_not_read_by_a_decode_step():
    model = _meta(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    everything = sum(p.numel() for p in model.parameters())
    assert _ceilings.weight_bytes_per_decode_step(model) == 4 * (everything - 1000 * 64)


def test_update_tokens_match_portrls_shared_prompt_layout():
    # 2 prompts (3 and 5 tokens) x 2 samples, responses of 4, 1, 3, 2 tokens; verl layout: left-padded prompt,
    # right-padded response
    P, T, pad = 5, 4, 0
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    responses = [[31, 32, 33, 34], [41], [51, 52, 53], [61, 62]]
    ids = torch.full((4, P + T), pad)
    mask = torch.zeros(4, P + T, dtype=torch.long)
    for r, resp in enumerate(responses):
        prompt = prompts[r // 2]
        ids[r, P - len(prompt):P] = torch.tensor(prompt)
        ids[r, P:P + len(resp)] = torch.tensor(resp)
        mask[r, P - len(prompt):P + len(resp)] = 1
    layout = plan_shared_prompts(ids, mask, T)
    prompt_tokens = 2 * (3 + 5)  # summed over the rows
    response_tokens = sum(map(len, responses))
    tokens = _ceilings.update_tokens(2, 4, prompt_tokens, response_tokens)
    assert tokens == {"body": layout.flat_ids.numel(), "head": layout.score_rows.numel()} == {"body": 14, "head": 10}
    assert _ceilings.update_tokens(2, 4, prompt_tokens, response_tokens, share_prompts=False)["body"] == 22


def test_update_flops_rule():
    params, tokens = {"body": 1000, "head": 50}, {"body": 40, "head": 30}
    assert _ceilings.update_flops(params, tokens, checkpointing=False) == 6 * 1000 * 40 + 6 * 50 * 30
    # gradient checkpointing runs the layers' forward once more: 4/3 of their share, none of the head's
    assert _ceilings.update_flops(params, tokens, checkpointing=True) == 8 * 1000 * 40 + 6 * 50 * 30
    # a replayed rollout forward: the layers' matmuls run in backward only, checkpointing or not
    for ckpt in (False, True):
        assert _ceilings.update_flops(params, tokens, ckpt, replayed=True) == 4 * 1000 * 40 + 6 * 50 * 30
    assert _ceilings.achieved_bandwidth(100, 8, 2.0) == 400.0
    assert math.isnan(_ceilings.achieved_bandwidth(100, 8, 0.0))


def test_micro_benchmarks_report_their_own_arithmetic():
    read = _ceilings.memory_read_bandwidth(1 << 20, repeats=2)
    assert read["bytes"] == 1 << 20 and read["seconds"] > 0
    assert read["bytes_per_s"] == read["bytes"] / read["seconds"]
    mm = _ceilings.matmul_flops(n=64, repeats=2)
    assert mm["flops_per_s"] == 2 * 64 ** 3 / mm["seconds"]
    size = _ceilings.read_tensor_bytes()
    assert _ceilings.READ_MIN_BYTES <= size <= _ceilings.READ_MAX_BYTES
    assert _ceilings.last_level_cache_bytes() >= 0


def test_decode_probe_counts_the_steps_of_a_generate_call_and_unwraps(tmp_path):
    model = load_causal_lm(str(write_tiny_model(tmp_path / "m", hidden_size=32, intermediate_size=64)))
    engine = HFEngine(model=model)
    assert engine.can_record_forward()  # the fast path, which the probe times
    originals = (fast_decode.FastDecoder.forward, hf_engine.decode_chunk)
    with _ceilings.DecodeProbe() as probe:
        out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=0))
        got = probe.take()
    assert (fast_decode.FastDecoder.forward, hf_engine.decode_chunk) == originals
    longest = max(len(r) for r in out.response_ids)
    # one prefill, then one forward per token fed back: the last sampled token is never fed back
    assert got["calls"] == 1 and got["steps"] == longest - 1
    assert got["prefill_s"] > 0 and got["decode_s"] >= got["decode_forward_s"] > 0 and got["start_s"] > 0
    unfinished = [sum(len(r) > t + 1 for r in out.response_ids) for t in range(longest - 1)]
    assert got["row_steps"] >= sum(unfinished) and got["row_steps"] <= 4 * got["steps"]  # 4 rows, fewer as they end
    assert probe.take()["calls"] == 0


def test_decode_roofline_is_the_lower_of_memory_and_compute():
    """R rows do 2R FLOPs per 4-byte weight: 16 rows on a 144 GFLOP/s machine cannot read more than 18 GB/s."""
    assert _ceilings.decode_roofline(29e9, 144e9, 16) == pytest.approx(18e9)
    assert _ceilings.decode_roofline(29e9, 400e9, 16) == 29e9
    assert _ceilings.decode_roofline(29e9, 144e9, 0) == 29e9
