"""SPIN (``algorithm=spin``): online DPO whose reference becomes the current policy every ``trainer.ref_update_freq``
steps (portrl/trainer/reference_update.py), and checkpoints that hold the reference of their own step
(portrl/trainer/run_checkpoints.py). Tiny model, real ``portrl train`` runs, a reward that tells samples apart."""

import json
from pathlib import Path

import pytest
import torch

from portrl.cli import main
from portrl.config import compose
from portrl.config.presets import ConfigError
from portrl.trainer.checkpoint_io import load_state

# tests/test_cli_commands.py SMALL: the tiny model and batch shape
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.val_before_train=false",
         "model.sft_warm_start=false", "trainer.export_hf=false", "trainer.plot=false", "trainer.loggers=[jsonl]"]
# a score that differs between most samples, so that (almost) every pair carries a preference and the policy moves
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 7) / 7.0
'''
VOLATILE = ("timing_s/", "perf/", "memory/")  # measurements of the machine, not of the run


def _train(tmp_path, out, *over):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    argv = ["--log-level", "WARNING", "train", "algorithm=spin", *SMALL, "actor.optim.lr=1e-2",
            f"reward.custom.path={reward}", f"trainer.output_dir={out}", *over]
    assert main(argv) == 0


def _metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_spin_preset_has_the_recipe_defaults():
    cfg = compose(algorithm="spin")
    assert cfg.algorithm.objective == "dpo" and cfg.algorithm.dpo_beta == 0.1
    assert cfg.algorithm.dpo_loss_type == "sigmoid" and cfg.algorithm.dpo_label_smoothing == 0.0
    assert cfg.trainer.ref_update_freq == 1 and cfg.ref.enable and not cfg.actor.use_kl_loss
    assert cfg.rollout.n % 2 == 0
    assert compose(algorithm="online_dpo").trainer.ref_update_freq == 0  # the pinned reference


@pytest.mark.parametrize("over, message", [
    (["trainer.ref_update_freq=-1"], "trainer.ref_update_freq=-1 must be >= 1 (refresh the reference every k steps)"),
    (["algorithm=online_dpo", "algorithm.dpo_reference_free=true", "ref.enable=null", "trainer.ref_update_freq=2"],
     "trainer.ref_update_freq=2 refreshes the reference policy, but this run has none"),
    (["algorithm=spin", "ref.enable=false", "algorithm.dpo_reference_free=true"], "set ref.enable=true"),
])
def test_bad_ref_update_freq_is_one_line(over, message, capsys):
    with pytest.raises(ConfigError, match="ref_update_freq"):
        compose(overrides=over)
    assert main(["--log-level", "WARNING", "train", *over]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_reference_moves_at_the_update_steps_only(tmp_path, monkeypatch):
    """ref_update_freq=2 over 3 steps: step 1 trains against the starting policy, step 2 first copies the policy
    after step 1 into the reference (so its DPO margins start at 0), step 3 keeps that reference."""
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    _train(tmp_path, out, "trainer.total_steps=3", "trainer.ref_update_freq=2", "trainer.save_freq=1",
           "trainer.max_ckpt_to_keep=3")
    ckpt = out / "checkpoints"
    policy = {s: load_state(ckpt / f"global_step_{s}", "actor")["model"] for s in (1, 2, 3)}
    ref = {s: load_state(ckpt / f"global_step_{s}", "ref") for s in (1, 2, 3)}
    assert not (ckpt / "reference").exists()  # a moving reference lives in each checkpoint, not once per run
    assert not _same(ref[1], policy[1])  # step 1 trained the policy away from the starting reference
    assert _same(ref[2], policy[1])  # the update at step 2: the policy after step 1
    assert _same(ref[3], ref[2]) and not _same(ref[3], policy[2])  # nothing moves it between updates
    m = _metrics(out)
    assert ["timing_s/ref_update" in m[s] for s in (1, 2, 3)] == [False, True, False]
    # the DPO margin beta * ((pi_c - pi_r) - (ref_c - ref_r)) on the step's own samples, before its optimizer step:
    # 0 where the reference is the policy that sampled them (the start, and right after the update)
    assert abs(m[1]["dpo/margin"]) < 1e-5 and abs(m[2]["dpo/margin"]) < 1e-5
    assert abs(m[3]["dpo/margin"]) > 1e-4
    assert all(m[s]["actor/dpo_valid_pairs"] > 0 and m[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))


def test_resume_restores_the_reference_of_its_step(tmp_path, monkeypatch):
    """ref_update_freq=2, save_freq=1: a run stopped after step 2, resumed, stopped after step 3 and resumed to step 5
    logs the metrics of an uninterrupted 5-step run. The stop after step 2 is the one that needs the checkpoint's
    reference (step 3 trains against the policy after step 1, which only checkpoint 2 holds); at step 4 the
    reference is the policy again."""
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    common = ("trainer.ref_update_freq=2", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
              "actor.optim.scheduler=constant")  # a schedule over total_steps would change with the extension
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _train(tmp_path, whole, "trainer.total_steps=5", *common)
    for total in (2, 3, 5):
        _train(tmp_path, parts, f"trainer.total_steps={total}", *common)
    want, got = _metrics(whole), _metrics(parts)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for step in want:
        a = {k: v for k, v in want[step].items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in got[step].items() if not k.startswith(VOLATILE)}
        assert a == b, f"step {step} differs after resume"
    assert abs(want[3]["dpo/margin"]) > 1e-4  # step 3 really trained against an older reference
