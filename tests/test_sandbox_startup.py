"""The code sandbox's start-up check (portrl/trainer/sandbox_check.py) and ``sandbox.allow_unisolated``.

A run whose code reward or python tool runs programs locally starts one one-line program through the sandbox in
the preflight, before any model loads; it stops with one line (exit code 2) where the sandbox cannot start a
program or the platform refuses its isolation, unless ``sandbox.allow_unisolated=true`` accepts what is missing:
then the run goes on and every validation line says UNISOLATED. The refusals of the real ``portrl`` on a platform
made to refuse the sandbox (a seccomp filter, tests/_sandbox_faults.py) are rows of tests/test_cli_errors.py; the
run that goes on without isolation is here (``test_an_unisolated_run_says_so_on_every_validation_line``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _sandbox_faults import command_under, seccomp_available
from portrl.agent.tools import Tool
from portrl.agent.tools.builtin_python import PythonTool
from portrl.config import compose
from portrl.rewards.sandbox import SandboxError
from portrl.trainer import sandbox_check
from portrl.trainer.sandbox_check import SandboxUnusable, check_sandbox, sandbox_users, unisolated_note

ROWS = [([], "apps", "{}", {}), ([], "arith", "3", {}), ([], "leetcode", "{}", {})]


def _cfg(*overrides):
    return compose(overrides=list(overrides))


def test_who_needs_the_sandbox():
    assert sandbox_users(_cfg(), ROWS) == ["the code reward (data_source apps, leetcode)"]
    assert sandbox_users(_cfg(), ROWS[1:2]) == []
    for elsewhere in ("reward.code.sandbox_fusion_url=http://sandbox:8080", "reward.custom.path=my_reward.py",
                      "reward.model_path=/models/rm"):
        assert sandbox_users(_cfg(elsewhere), ROWS) == [], elsewhere
    tools = {"python": PythonTool(), "calculator": Tool()}
    assert sandbox_users(_cfg("reward.code.sandbox_fusion_url=http://sandbox:8080"), ROWS, tools) == [
        "the python tool (rollout.multi_turn.tool_config_path)"]


def test_nothing_is_run_when_nothing_needs_the_sandbox(monkeypatch):
    import portrl.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "run_program", lambda *a, **k: pytest.fail("the sandbox was started"))
    check_sandbox(_cfg(), [])
    assert unisolated_note() is None


def test_the_check_runs_one_program_with_the_runs_settings(monkeypatch):
    import portrl.rewards.sandbox as sandbox

    real, seen = sandbox.run_program, []

    def counted(source, stdin="", limits=sandbox.SandboxLimits()):
        seen.append(limits)
        return real(source, stdin, limits)

    monkeypatch.setattr(sandbox, "run_program", counted)
    check_sandbox(_cfg("sandbox.packages=[numpy,json]"), ["the code reward (data_source apps)"])
    assert len(seen) == 1 and seen[0].packages == ("numpy", "json") and seen[0].allow_unisolated is False
    if not real(sandbox_check.PROBE_SOURCE, "", seen[0]).missing:  # isolated here
        assert unisolated_note() is None


def test_a_sandbox_that_cannot_start_is_one_line(monkeypatch):
    import portrl.rewards.sandbox as sandbox

    def cannot(source, stdin="", limits=None):
        raise SandboxError("the sandbox could not start the program: OSError: [Errno 22] cannot bind /opt/py")

    monkeypatch.setattr(sandbox, "run_program", cannot)
    with pytest.raises(SandboxUnusable) as caught:
        check_sandbox(_cfg(), ["the python tool (rollout.multi_turn.tool_config_path)"])
    assert str(caught.value) == (
        "the code sandbox cannot start a program here, and the python tool (rollout.multi_turn.tool_config_path) "
        "needs it: the sandbox could not start the program: OSError: [Errno 22] cannot bind /opt/py; fix that "
        "(docs/code-rl.md, 'The start-up check' says what each cause needs)")


def test_a_package_that_is_not_installed_is_named():
    with pytest.raises(SandboxUnusable, match=r"^sandbox.packages has portrl_no_such_pkg, which is not installed in "
                                              r"this interpreter \(.*\) or cannot be bound into the sandbox .*; "
                                              r"install it there, or drop it from sandbox.packages \(needed by the "
                                              r"code reward"):
        check_sandbox(_cfg("sandbox.packages=[numpy,portrl_no_such_pkg]"), ["the code reward (data_source apps)"])


def test_every_validation_line_says_unisolated(monkeypatch, caplog):
    import torch

    from portrl.trainer import validation
    from portrl.workers.batch import Batch

    class Gen:
        def concat(self, method, chunk, sampling, **extra):
            return Batch({"responses": torch.ones(len(chunk), 2, dtype=torch.long),
                          "response_mask": torch.ones(len(chunk), 2)}, meta={"data_source": ["apps"] * len(chunk)})

    class Reward:
        def compute_reward(self, b):
            return Batch({"acc": torch.tensor([1.0, 0.0]), "seq_scores": torch.tensor([1.0, 0.5])})

    cfg = _cfg("data.val_batch_size=2")
    prompts = Batch({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    monkeypatch.setattr(validation, "response_lengths", lambda b: torch.tensor([2, 2]))
    monkeypatch.setattr(sandbox_check, "_note", None)
    with caplog.at_level(logging.WARNING, logger="portrl.trainer.validation"):
        validation.validate(cfg, Gen(), Reward(), prompts, 3)
    assert "UNISOLATED" not in caplog.text
    monkeypatch.setattr(sandbox_check, "_note", "UNISOLATED (no network namespace: Operation not permitted)")
    with caplog.at_level(logging.WARNING, logger="portrl.trainer.validation"):
        for step in (0, 2):
            validation.validate(cfg, Gen(), Reward(), prompts, step)
    lines = [r.getMessage() for r in caplog.records if "UNISOLATED" in r.getMessage()]
    assert lines == [f"validation at step {step}: val/acc/mean=0.5 val/score/mean=0.75 (the code sandbox runs "
                     "UNISOLATED (no network namespace: Operation not permitted); sandbox.allow_unisolated=true)"
                     for step in (0, 2)]


def test_the_python_tool_takes_the_runs_sandbox_settings():
    from portrl.agent.rollout import configure_sandbox

    py = PythonTool(timeout_s=3.0)
    assert py.limits.allow_unisolated is False and py.limits.packages == ("numpy",)
    configure_sandbox({"python": py, "other": Tool()}, OmegaConf.create({"allow_unisolated": True,
                                                                          "packages": ["numpy", "json"]}))
    assert py.limits.allow_unisolated is True and py.limits.packages == ("numpy", "json")
    assert py.limits.timeout_s == 3.0


def test_the_code_reward_gets_the_runs_sandbox_settings():
    from portrl.trainer.reward_scoring import _code_kwargs

    cfg = _cfg("sandbox.allow_unisolated=true", "sandbox.packages=[numpy,sympy]")
    code = _code_kwargs(cfg.reward.code, cfg.sandbox)["code"]
    assert code["allow_unisolated"] is True and code["packages"] == ("numpy", "sympy")
    assert _code_kwargs(None, cfg.sandbox) == {}


def test_an_unisolated_run_says_so_on_every_validation_line(tmp_path):
    """Real: `portrl train data=code` where namespaces are refused (a seccomp filter, as Docker's default profile),
    with sandbox.allow_unisolated=true: the run trains and each validation (before training, after the step) logs
    UNISOLATED with what is missing."""
    if not seccomp_available():
        pytest.skip("no seccomp here to refuse the namespaces with")
    from portrl.data.preprocess import preprocess

    files = preprocess("code", tmp_path / "code")
    run = tmp_path / "run"
    argv = [str(Path(sys.executable).parent / "portrl"), "--log-level", "WARNING", "train", "data=code",
            f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=16", "trainer.total_steps=1",
            "trainer.test_freq=1", "trainer.val_before_train=true", "trainer.progress_bar=false",
            "trainer.plot=false", "trainer.export_hf=false", "device.num_threads=1", "sandbox.allow_unisolated=true",
            f"trainer.output_dir={run}"]
    env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command_under("namespaces", argv), capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "validation at step" in line]
    assert len(lines) == 2, done.stderr[-3000:]
    for line, step in zip(lines, (0, 1)):
        assert f"validation at step {step}: val/acc/mean=" in line and "the code sandbox runs UNISOLATED (" in line
        assert "no network namespace" in line and "sandbox.allow_unisolated=true" in line
    assert "the code sandbox runs UNISOLATED" in done.stderr.split("validation at step 0")[0]  # said at start-up
    assert (run / "metrics.jsonl").is_file()
