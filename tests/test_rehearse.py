"""``portrl rehearse`` (portrl/trainer/rehearsal.py): a cluster run's meshes rehearsed as CPU processes over gloo.
The shrunk model keeps the real one's family, heads, key/value heads and tied head and splits over every tensor
parallel size; the rehearsal's batch is the smallest every data-parallel size divides; bad input is one line, exit
2, before anything starts; 8 ranks (TP2 x SP2 x FSDP2 for an h100 preset run) rehearse on this 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from portrl.config import compose
from portrl.trainer.rehearsal import rehearsal_config, shrunk_model

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

#: Qwen2.5-7B-Instruct's config.json, the parts a mesh reads (no weights: the rehearsal needs none)
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
             "num_hidden_layers": 28, "vocab_size": 152064, "tie_word_embeddings": False}


@pytest.fixture
def qwen7b(tmp_path):
    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_7B))
    return folder


def test_the_shrunk_model_keeps_heads_and_splits_over_the_mesh(qwen7b, tmp_path):
    cfg = compose(device=None, preset="h100", config_file=None,
                  overrides=[f"model.path={qwen7b}", "trainer.num_workers=16", "actor.tensor_parallel_size=4",
                             "actor.sequence_parallel_size=2"])
    out = shrunk_model(cfg, tmp_path / "shrunk")
    c = AutoConfig.from_pretrained(out)
    assert (c.model_type, c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == ("qwen2", 28, 4, False)
    assert c.num_hidden_layers == 2 and c.hidden_size == 28 * 8
    assert c.vocab_size % 4 == 0 and c.intermediate_size % 4 == 0
    run = rehearsal_config(cfg, out, tmp_path / "run")
    # 16 ranks over tp 4 x sp 2: 2 data-parallel ranks, so the batch is 2 prompts; the rest is the CPU's
    assert (run.device.name, run.rollout.engine, run.data.train_batch_size, run.actor.ppo_mini_batch_size) == \
        ("cpu", "hf", 2, 2)
    assert (run.trainer.num_workers, run.actor.tensor_parallel_size, run.actor.sequence_parallel_size) == (16, 4, 2)


def _rehearse(*args, timeout=600):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    code = "import sys; from portrl.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "rehearse", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--preset", "h100", "actor.tensor_parallel_size=2"], "needs the cluster's trainer.num_workers"),
    (["--preset", "h100", "trainer.num_workers=8", "actor.tensor_parallel_size=3"], "actor.tensor_parallel_size=3"),
])
def test_bad_input_is_one_line_before_anything_starts(args, message, qwen7b):
    r = _rehearse(*args, f"model.path={qwen7b}", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert message in last, last


@pytest.mark.slow  # 8 Ray workers (TP2 x SP2 x FSDP2) run a step, validation, a checkpoint and the export (90-150 s)
def test_eight_ranks_rehearse_an_h100_run(qwen7b, tmp_path):
    r = _rehearse("--preset", "h100", f"model.path={qwen7b}", "trainer.num_workers=8",
                  "actor.tensor_parallel_size=2", "actor.sequence_parallel_size=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rehearsal passed: 8 ranks (dp_replicate x dp_shard x sp x tp: actor 1x2x2x2)" in r.stdout, r.stdout
