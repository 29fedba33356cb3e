"""Faults and reproducibility of the RL loop on CPU (subprocesses, tiny model, fixed seeds):
a run SIGKILLed after a checkpoint resumes and logs the same metrics as an uninterrupted run;
two deterministic runs with one seed log bitwise-identical metrics."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    from omegaconf import OmegaConf
    from portrl.config.options_schema import default_config
    from portrl.trainer import run_training

    cfg = default_config()
    for k, v in json.loads(sys.argv[1]).items():
        OmegaConf.update(cfg, k, v)
    print(json.dumps({k: v for k, v in run_training(cfg).items() if isinstance(v, (int, float, str))}))
""")

VOLATILE = ("timing_s/", "perf/", "memory/")  # measurements of the machine, not of the run


def _overrides(model, out, **extra):
    o = {
        "device.name": "cpu", "device.num_threads": 1, "model.path": model, "trainer.output_dir": str(out),
        "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4, "data.max_response_length": 5,
        "rollout.n": 4, "actor.ppo_mini_batch_size": 2, "actor.ppo_epochs": 1, "actor.optim.lr": 1e-3,
        "actor.use_kl_loss": True, "trainer.total_steps": 6, "trainer.save_freq": 2, "trainer.test_freq": 3,
        "trainer.progress_bar": False, "trainer.loggers": ["jsonl"], "trainer.export_hf": False,
        "trainer.plot": False, "trainer.seed": 3,
    }
    o.update(extra)
    return o


def _env(tmp_path):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_WAIT_POLICY="PASSIVE",
               PORTRL_CACHE=str(tmp_path / "cache"))
    return env


def _run(tmp_path, overrides, timeout=240):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), json.dumps(overrides)], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def _kill_at_checkpoint_then_resume(tmp_path, overrides, steps):
    """Run ``overrides`` uninterrupted, then again SIGKILLed once its first checkpoint exists and relaunched; both
    logs must hold the same metrics at every step (timings and memory aside)."""
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    _run(tmp_path, dict(overrides, **{"trainer.output_dir": str(ref_out)}))
    script = tmp_path / "run.py"
    killed = dict(overrides, **{"trainer.output_dir": str(out)})
    log = tmp_path / "killed.log"  # a file, not a pipe: nobody reads the output while the run goes on
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(killed)], env=_env(tmp_path),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    ckpt = out / "checkpoints" / "global_step_2"
    deadline = time.time() + 240
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, (f"the run ended before it could be killed (exit code {proc.returncode}); "
                                 f"its output ends with:\n{log.read_text(errors='replace')[-3000:]}")
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray workers, as a crash of the machine would
    proc.wait()
    summary = _run(tmp_path, killed)
    assert "resumed_from" in summary and "global_step_" in summary["resumed_from"]
    ref, got = _metrics(ref_out), _metrics(out)
    assert sorted(got) == sorted(ref) == list(range(0, steps + 1))
    for step in ref:
        assert got[step] == ref[step], f"step {step} differs after resume"
    return ref


@pytest.mark.slow
def test_sigkill_then_resume_logs_the_same_metrics(tiny_model, tmp_path):
    over = _overrides(tiny_model, tmp_path / "unused", **{"actor.entropy_coeff": 0.01})  # weights really change
    ref = _kill_at_checkpoint_then_resume(tmp_path, over, 6)
    assert all(ref[s]["actor/grad_norm"] > 0 for s in range(1, 7))


@pytest.mark.slow
def test_sigkill_then_resume_with_two_ray_workers_and_shuffle(tiny_model, tmp_path):
    """Data-parallel state: the checkpoint holds rank 0's state (the actor's update count, which seeds the
    mini-batch shuffle, was summed over the ranks by the metrics reduction, so the resumed run diverged)."""
    over = _overrides(tiny_model, tmp_path / "unused", **{
        "trainer.num_workers": 2, "actor.shuffle": True, "trainer.total_steps": 4, "trainer.test_freq": 2,
        "actor.ppo_micro_batch_size_per_device": 4, "actor.entropy_coeff": 0.01})
    ref = _kill_at_checkpoint_then_resume(tmp_path, over, 4)
    assert all(ref[s]["actor/grad_norm"] > 0 for s in (1, 2, 3, 4))


def test_deterministic_runs_are_bitwise_identical(tiny_model, tmp_path):
    a = _overrides(tiny_model, tmp_path / "a", **{"trainer.deterministic": True, "trainer.total_steps": 3,
                                                   "trainer.save_freq": 0, "trainer.save_final": False,
                                                   "actor.entropy_coeff": 0.01})
    b = dict(a, **{"trainer.output_dir": str(tmp_path / "b")})
    _run(tmp_path, a)
    _run(tmp_path, b)
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert ma == mb and len(ma) == 4
    assert all(ma[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))  # the weights really changed
