"""Every command's bad inputs: one line on stderr, exit code 2, no traceback, stopped before any model loads.

The table runs in-process through ``portrl.cli.main`` (a model load there fails the test: see ``no_heavy_work``);
a few rows run again as real ``portrl`` subprocesses to prove the exit code and the missing traceback end to end.
Argument strings use ``{name}`` placeholders for the files the ``inputs`` fixture writes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _bad_inputs import write_bad_inputs
from _cli_error_cases import CASES
from portrl.cli import main

Q = ["device.num_threads=1", "trainer.progress_bar=false"]  # every train / sft / eval row: quiet, one thread

SUBPROCESS_IDS = ["device-npu-flag", "ground-truth-nan", "reward-import-raises", "ckpt-not-a-ckpt", "plot-missing",
                  "sft-output-not-empty", "oc-env-override",
                  "lr-zero", "unknown-command"]
TRAINING_COMMANDS = ("train", "sft", "eval")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files the table's placeholders name (one tiny model dir, parquet variants, reward files, YAML)."""
    return write_bad_inputs(tmp_path_factory.mktemp("bad_inputs"))


@pytest.fixture
def no_heavy_work(monkeypatch, tmp_path):
    """Any model load, worker start or training step in a table row fails the test (it must stop before)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started: a model load was reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))  # the tiny model would be written here
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    monkeypatch.delenv("PORTRL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def _argv(argv: list[str], files: dict[str, str]) -> list[str]:
    out = [a.format(**files) for a in argv]
    if out and out[0] in TRAINING_COMMANDS:
        out += Q
    return ["--log-level", "WARNING", *out]


def _run_in_process(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code)


@pytest.mark.parametrize("case_id, argv, phrase, env", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(case_id, argv, phrase, env, inputs, no_heavy_work, monkeypatch, capsys):
    if case_id == "logger-not-installed" and importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = _run_in_process(_argv(argv, inputs))
    err = capsys.readouterr().err
    assert rc == 2, f"exit code {rc}, stderr: {err}"
    assert "Traceback" not in err
    assert phrase.format(**inputs) in err
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    if "usage:" in err:  # argparse: its usage, then one "error:" line
        assert lines[-1].startswith("portrl") and ": error: " in lines[-1], err
    else:
        assert len(lines) == 1 and lines[0].startswith(f"portrl {argv[0]}: error: "), err


def test_table_covers_every_command():
    commands = {c[1][2] if c[1][0] == "--log-level" else c[1][0] for c in CASES}
    assert {"train", "sft", "eval", "preprocess", "parity", "plot", "config", "doctor", "devices"} <= commands
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case_id", SUBPROCESS_IDS)
def test_bad_input_end_to_end(case_id, inputs, tmp_path):
    """The real ``portrl`` executable: exit code 2, one line, no traceback."""
    _, argv, phrase, env = next(c for c in CASES if c[0] == case_id)
    bin_dir = Path(sys.executable).parent
    full_env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache"), **env}
    full_env.pop("PORTRL_DEBUG", None)
    proc = subprocess.run([str(bin_dir / "portrl"), *_argv(argv, inputs)[2:]], capture_output=True, text=True,
                          env=full_env, cwd=tmp_path, timeout=120)  # the default log level: INFO
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert phrase.format(**inputs) in proc.stderr
    if "usage:" not in proc.stderr:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_debug_shows_the_traceback(inputs, no_heavy_work, monkeypatch, capsys):
    assert _run_in_process(["--debug", "train", "actor.optim.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "portrl train: error: " in err
    monkeypatch.setenv("PORTRL_DEBUG", "1")
    assert _run_in_process(["train", "actor.optim.lr=0"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_version(capsys):
    import portrl

    assert _run_in_process(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"portrl {portrl.__version__}"


def test_internal_error_keeps_its_traceback(monkeypatch):
    """An exception that is not a UserError is an internal error: main lets it propagate."""
    import portrl.cli.devices as devices

    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(devices, "run", boom)
    with pytest.raises(KeyError):
        main(["devices"])


def test_run_stopped_exit_code(monkeypatch, capsys):
    import portrl.cli.devices as devices
    from portrl.errors import RunStopped

    def stop(args):
        raise RunStopped("stopped by SIGTERM at step 3; resume with the same command", 143)

    monkeypatch.setattr(devices, "run", stop)
    assert main(["devices"]) == 143
    assert capsys.readouterr().err.strip() == "stopped by SIGTERM at step 3; resume with the same command"


@pytest.mark.parametrize("overrides", [
    ["actor.optim.lr=0", "actor.optim.freeze=true"],  # 0 only with an explicit freeze
    ["rollout.temperature=0", "rollout.top_k=5", "rollout.top_p=1"],  # greedy; top-k on
    ["trainer.save_freq=0", "trainer.test_freq=0"],  # the documented "off"
    ["actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28"],  # DAPO's clip-higher
    ["device.env.NCCL_DEBUG=INFO", "device.env.CUBLAS_WORKSPACE_CONFIG=:4096:8", "device.env.OMP_NUM_THREADS=2"],
])
def test_valid_edges_are_accepted(overrides):
    from portrl.config import compose

    compose(overrides=overrides)


@pytest.mark.parametrize("preset", ["cpu", "a100", "h100", "h200", "mi300x", "mi325x", "ascend-910b", "ascend-910c"])
def test_every_device_preset_env_is_accepted(preset):
    """The shipped presets' device.env (TASK_QUEUE_ENABLE is declared by the npu backend) pass the allow-list."""
    from portrl.config import compose

    compose(preset=preset)


def test_workers_need_ray(monkeypatch):
    import portrl.config.checks as checks_mod  # imports module_available by name: patch it where it is used
    from portrl.config import ConfigError, compose

    real = checks_mod.module_available
    monkeypatch.setattr(checks_mod, "module_available", lambda m: False if m == "ray" else real(m))
    with pytest.raises(ConfigError, match="trainer.num_workers=2 .*ray is not installed"):
        compose(overrides=["trainer.num_workers=2"])
    compose(overrides=["trainer.num_workers=1"])


def test_install_commands_are_pinned_to_a_compatibility_row_and_spelled_as_the_readme():
    """What `portrl devices` tells a user to run installs one known row and appears verbatim in the docs."""
    from portrl.backends.cuda.backend import TORCH_CUDA_INSTALL, CUDABackend
    from portrl.backends.npu.backend import NPU_INSTALL
    from portrl.backends.rocm.backend import TORCH_ROCM_INSTALL, ROCmBackend

    docs = Path(__file__).resolve().parents[1] / "docs"
    readme = "".join(p.read_text() for p in sorted(docs.rglob("*.md")))
    for message, torch_pin in ((TORCH_CUDA_INSTALL, CUDABackend.compat_rows[0].pins["torch"]),
                               (TORCH_ROCM_INSTALL, "2.9.0"), (NPU_INSTALL, "2.10.0")):
        command = message.split(": ", 1)[1]
        assert f'pip install "torch=={torch_pin}" --index-url https://download.pytorch.org/whl/' in command
        for part in command.split(" && "):
            assert part in readme, part
    assert any(r.pins.get("torch") == "2.9.0" and r.pins.get("ROCm") == "6.4" for r in ROCmBackend.compat_rows)


def test_optional_packages_are_checked_before_the_model_loads(inputs, no_heavy_work, monkeypatch, capsys):
    """LoRA without peft and a logger whose package is missing stop in the preflight (faked as missing here)."""
    import portrl.trainer.preflight as preflight_mod

    real = preflight_mod.module_available
    monkeypatch.setattr(preflight_mod, "module_available", lambda m: False if m in ("peft", "wandb") else real(m))
    assert _run_in_process(_argv(["train", "actor.lora_rank=8"], inputs)) == 2
    assert "actor.lora_rank=8 trains LoRA adapters with peft, which is not installed" in capsys.readouterr().err
    assert _run_in_process(_argv(["train", "trainer.loggers=[wandb]"], inputs)) == 2
    assert 'pip install "wandb>=0.18"' in capsys.readouterr().err


def test_a_dead_worker_is_one_line_with_the_checkpoint(monkeypatch, capsys):
    """A worker that died or stopped answering is not the user's input (exit 1, not 2), but the user still gets
    one line naming the worker and where to resume, not a traceback; --debug adds the traceback."""
    import portrl.cli.train as train
    from portrl.workers.ray_calls import WorkerDiedError

    def died(args):
        raise WorkerDiedError("actor rank 1 (node 127.0.0.1, pid 4242)", RuntimeError("killed\nby the OOM killer"),
                              checkpoint="outputs/run/checkpoints/global_step_3")

    monkeypatch.setattr(train, "run", died)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("portrl train: error: worker actor rank 1 (node 127.0.0.1, pid 4242) died")
    assert "resume from the last good checkpoint outputs/run/checkpoints/global_step_3" in err
    assert main(["--debug", "train"]) == 1 and "Traceback" in capsys.readouterr().err


def test_lora_targets_that_are_no_layer_of_the_model_stop_in_the_preflight(inputs, no_heavy_work, tmp_path, capsys):
    """A misspelt actor.lora_target_modules is one line naming the model's linear layers, before any model loads
    (the model is built from its config.json on the meta device)."""
    from portrl.models import write_tiny_model

    model = write_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    capsys.readouterr()  # the writer's progress bar
    argv = ["train", f"model.path={model}", "actor.lora_rank=4", "actor.lora_target_modules=[qproj,v_proj]"]
    assert _run_in_process(_argv(argv, inputs)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "actor.lora_target_modules ['qproj'] are not modules of Qwen2ForCausalLM" in err[0]
    assert "q_proj" in err[0] and "all-linear" in err[0]


# (id, platform fault (tests/_sandbox_faults.py), argv, key phrase): the real `portrl` on a platform that refuses the
# code sandbox, made with a seccomp filter on its process; the start-up check stops it before any model loads
SANDBOX_FAULT_CASES = [
    ("sandbox-isolation-refused", "namespaces",
     ["train", "data=code", "data.train_files=[{code_train}]", "data.val_files=[{code_test}]"],
     "sandbox.allow_unisolated=true"),
    ("sandbox-cannot-start", "setrlimit",
     ["train", "data=code", "data.train_files=[{code_train}]", "data.val_files=[{code_test}]"],
     "the code sandbox cannot start a program here, and the code reward (data_source "),
    ("sandbox-isolation-refused-python-tool", "namespaces",
     ["train", "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/python.yaml"],
     "(needed by the python tool (rollout.multi_turn.tool_config_path))"),
]


@pytest.mark.parametrize("case_id, fault, argv, phrase", SANDBOX_FAULT_CASES, ids=[c[0] for c in SANDBOX_FAULT_CASES])
def test_a_platform_that_refuses_the_sandbox_stops_the_run_at_start_up(case_id, fault, argv, phrase, inputs,
                                                                        tmp_path):
    """Exit code 2, one line, no traceback, before any model loads (no tiny model in the cache, no run folder)."""
    from _sandbox_faults import command_under, seccomp_available

    if not seccomp_available():
        pytest.skip("no seccomp here to refuse the sandbox with")
    portrl = str(Path(sys.executable).parent / "portrl")
    out = tmp_path / "run"
    env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache")}
    env.pop("PORTRL_DEBUG", None)
    full = [portrl, *_argv(argv, inputs)[2:], f"trainer.output_dir={out}"]
    proc = subprocess.run(command_under(fault, full), capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " WARNING " not in line]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("portrl train: error: "), proc.stderr
    assert phrase.format(**inputs) in lines[0], lines[0]
    assert not out.exists() and not list((tmp_path / "cache").rglob("*.safetensors"))  # no model was written
