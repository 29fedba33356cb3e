"""actor.max_tokens_per_micro_batch=null on the cpu preset becomes a token budget sized by the model
(portrl.trainer.data_fit.fit_token_budget): 3072 tokens for Qwen2.5-0.5B's architecture (config only, nothing
allocated), nothing for the tiny model, a value the user set (null included) kept; the budget caps the
micro-batches of the update and of the log-prob passes."""

import torch

from portrl.config import compose
from portrl.trainer.data_fit import fit_token_budget, token_budget
from portrl.workers.batch import build_rollout_batch
from portrl.workers.training import split_micro_batches


def _qwen(tmp_path):
    from transformers import Qwen2Config

    path = tmp_path / "qwen2.5-0.5b"
    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(path)
    return str(path)


def test_cpu_preset_sizes_the_budget_by_the_model(tmp_path, caplog):
    from portrl.models import write_tiny_model

    qwen, tiny = _qwen(tmp_path), str(write_tiny_model(tmp_path / "tiny"))
    cfg = compose(preset="cpu", overrides=[f"model.path={qwen}"])
    assert cfg.actor.max_tokens_per_micro_batch is None and cfg.actor.ppo_micro_batch_size_per_device == 64
    with caplog.at_level("INFO"):
        fit_token_budget(cfg)
    assert cfg.actor.max_tokens_per_micro_batch == token_budget(896, 24, 4864) == 3072
    assert "actor.max_tokens_per_micro_batch=null -> 3072" in caplog.text
    small = compose(preset="cpu", overrides=[f"model.path={tiny}"])
    fit_token_budget(small)
    assert small.actor.max_tokens_per_micro_batch is None  # the tiny model: rows alone, as before
    for value in ("null", "8192"):
        mine = compose(preset="cpu", overrides=[f"model.path={qwen}", f"actor.max_tokens_per_micro_batch={value}"])
        fit_token_budget(mine)
        assert mine.actor.max_tokens_per_micro_batch == (None if value == "null" else 8192)


def test_budget_cuts_micro_batches_by_tokens():
    """16 rows of 40 tokens: 64 rows per micro-batch alone is one micro-batch; a 256-token budget makes 3."""
    b = build_rollout_batch([[5] * 20] * 4, [[6] * 20] * 16, n=4)
    assert len(split_micro_batches(b, 64)) == 1
    micro = split_micro_batches(b, 64, 256)
    assert [len(m) for m in micro] == [6, 6, 4]
    assert all(int(m["attention_mask"].sum()) <= 256 for m in micro)
    assert torch.equal(torch.cat([m["input_ids"] for m in micro]), b["input_ids"])


def test_with_shared_prompts_a_repeated_prompt_counts_once_per_micro_batch():
    """The forward runs each distinct prompt of a micro-batch once (model.share_prompts), so the budget counts a
    row whose prompt is the previous row's by its response alone; each micro-batch pays its first prompt again."""
    prompts = [[5] * 20, [7] * 20, [8] * 20, [9] * 20]
    b = build_rollout_batch(prompts, [[6] * 20] * 16, n=4)  # 4 prompts x 4 samples, 20 + 20 tokens each
    micro = split_micro_batches(b, 64, 256, shared_prompts=True)
    # a group costs 20 + 4 x 20 = 100 tokens: two groups and the third's first row (40) fit, its second would make
    # 260; the next micro-batch pays that group's prompt again (40 + 2 x 20) before the last group (100)
    assert [len(m) for m in micro] == [9, 7]
    assert len(split_micro_batches(b, 64, 400, shared_prompts=True)) == 1  # 400 tokens run; 640 without sharing
    assert len(split_micro_batches(b, 64, 400)) == 2
    assert torch.equal(torch.cat([m["input_ids"] for m in micro]), b["input_ids"])
