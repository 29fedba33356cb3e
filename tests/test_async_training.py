"""The asynchronous modes end to end on the CPU (trainer.mode; portrl/trainer/rollout_pipeline.py): a separated Ray
rollout worker generates while the actor trains.

* ``async_training.max_staleness=0`` is the synchronous run: the same metrics at every step and bitwise the same
  weights;
* ``one_step_off`` trains step k on tokens of version k-2 (staleness exactly 1 after the first step), and
  ``async`` with partial rollout never lags more than ``max_staleness``; every prompt batch of the stream is
  trained on once, in order;
* a run SIGKILLed after a checkpoint and relaunched trains every prompt batch exactly once across the two.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402

VOLATILE = ("timing_s/", "perf/", "memory/", "async/")  # measurements of the machine, and the async-only keys


def _overrides(model, out, **extra):
    o = {"device.name": "cpu", "device.num_threads": 1, "model.path": model, "trainer.output_dir": str(out),
         "rollout.placement": "separated", "rollout.num_rollout_workers": 1, "rollout.weight_sync_bucket_mb": 1,
         "data.arith.num_train": 48, "data.arith.num_test": 8, "data.train_batch_size": 4,
         "data.max_response_length": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 1e-2,
         "actor.entropy_coeff": 0.01,  # the weights change every step even where no reward is earned
         "trainer.total_steps": 4, "trainer.test_freq": 2, "trainer.seed": 2, "trainer.progress_bar": False,
         "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": False, "trainer.save_final": False}
    o.update(extra)
    return o


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _fit(overrides):
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    cfg = default_config()
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    init_ray(cfg, get_backend("cpu"), num_cpus=3)
    trainer = RLTrainer(settle_config(cfg))
    try:
        trainer.fit()
        return _metrics(overrides["trainer.output_dir"]), trainer.actor.full_weights()
    finally:
        trainer.rollout.shutdown()
        trainer.actor.shutdown()


def _trained_batches(rows):
    """The prompt batch indices each step trained on, in step order."""
    return [list(range(int(r["data/gen_batch_first"]), int(r["data/gen_batch_last"]) + 1))
            for r in sorted(rows, key=lambda r: r["step"]) if r["step"] > 0]


@pytest.mark.slow  # four separated Ray runs (~20 s each)
def test_async_modes_on_a_separated_rollout_worker(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    sync_rows, sync_w = _fit(_overrides(tiny_model, tmp_path / "sync"))
    zero_rows, zero_w = _fit(_overrides(tiny_model, tmp_path / "zero", **{
        "trainer.mode": "async", "async_training.max_staleness": 0}))
    assert len(zero_rows) == len(sync_rows) == 5
    for want, got in zip(sync_rows, zero_rows):  # sample for sample the synchronous run
        assert {k: v for k, v in got.items() if not k.startswith(VOLATILE)} == \
            {k: v for k, v in want.items() if not k.startswith(VOLATILE)}
        assert got.get("async/staleness_max", 0) == 0
    assert sync_rows[-1]["actor/grad_norm"] > 0
    assert set(zero_w) == set(sync_w) and all(torch.equal(zero_w[k], sync_w[k]) for k in sync_w)

    off_rows, _ = _fit(_overrides(tiny_model, tmp_path / "off", **{"trainer.mode": "one_step_off",
                                                                    "trainer.profile.steps": [3]}))
    # a profiled step: the driver's trace and, each from its own Ray process, the actor's and the rollout worker's
    traces = tmp_path / "off" / "profile" / "step_3"
    assert sorted(p.name for p in traces.iterdir()) == ["actor_rank0.json", "driver.json", "rollout_rank0.json"]
    for name in ("actor_rank0.json", "rollout_rank0.json"):  # the update and the generation each ran
        assert any(e.get("name", "").startswith("aten::") for e in json.loads((traces / name).read_text())["traceEvents"])
    steps = [r for r in off_rows if r["step"] > 0]
    assert [(r["async/staleness_min"], r["async/staleness_max"]) for r in steps] == [(0, 0)] + [(1, 1)] * 3
    assert _trained_batches(off_rows) == [[0], [1], [2], [3]]

    two_rows, _ = _fit(_overrides(tiny_model, tmp_path / "two", **{
        "trainer.mode": "async", "async_training.max_staleness": 2, "data.max_response_length": 16}))
    steps = [r for r in two_rows if r["step"] > 0]
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in steps)
    assert max(r["async/staleness_max"] for r in steps) >= 1  # the rollout did run ahead
    assert _trained_batches(two_rows) == [[0], [1], [2], [3]]
    assert "val/acc/mean" in two_rows[-1]


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


@pytest.mark.slow  # a separated run killed and relaunched (~60 s)
def test_sigkill_and_resume_train_every_prompt_batch_once(tiny_model, tmp_path):
    out = tmp_path / "run"
    over = _overrides(tiny_model, out, **{"trainer.mode": "async", "async_training.max_staleness": 2,
                                          "trainer.total_steps": 8, "trainer.save_freq": 2, "trainer.test_freq": 0,
                                          "data.shuffle": True})
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_WAIT_POLICY="PASSIVE",
               PORTRL_CACHE=str(tmp_path / "cache"))
    log = tmp_path / "killed.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(over)], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    ckpt = out / "checkpoints" / "global_step_4"
    deadline = time.time() + 240
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it was killed:\n{log.read_text(errors='replace')[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray workers, requests in flight included
    proc.wait()
    r = subprocess.run([sys.executable, str(script), json.dumps(over)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "global_step_" in json.loads(r.stdout.strip().splitlines()[-1])["resumed_from"]
    rows = _metrics(out)
    assert [x["step"] for x in rows if x["step"] > 0] == list(range(1, 9))
    # 48 rows / 4 per batch: 12 batches an epoch; 8 steps train batches 0..7, each once, across the kill
    assert sum(_trained_batches(rows), []) == list(range(8))


@pytest.mark.slow  # two separated async runs (~25 s each)
def test_async_with_dynamic_sampling_and_with_a_critic(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    # DAPO's dynamic sampling: the overlong penalty makes rewards differ within groups; a step may take several
    # generation batches, each from the requests in flight, still within the bound and each batch once
    dapo, _ = _fit(_overrides(tiny_model, tmp_path / "dapo", **{
        "trainer.mode": "async", "async_training.max_staleness": 1, "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "seq_reward", "reward.overlong_buffer.enable": True,
        "reward.overlong_buffer.len": 4, "data.max_response_length": 6, "trainer.test_freq": 0}))
    steps = [r for r in dapo if r["step"] > 0]
    assert all(r["async/staleness_max"] <= 1 for r in steps if "async/staleness_max" in r)
    used = sum(_trained_batches(dapo), [])
    assert used == list(range(len(used))) and sum(r["train/num_gen_batches"] for r in steps) == len(used)
    # PPO: the critic trains on the same stale batches (values from the current critic, GAE)
    ppo, _ = _fit(_overrides(tiny_model, tmp_path / "ppo", **{
        "trainer.mode": "async", "async_training.max_staleness": 1, "algorithm.adv_estimator": "gae",
        "trainer.total_steps": 3, "trainer.test_freq": 0}))
    steps = [r for r in ppo if r["step"] > 0]
    assert [r["async/staleness_max"] for r in steps] == [0, 1, 1]
    assert all(r["critic/vf_loss"] == r["critic/vf_loss"] for r in steps)  # finite, present


@pytest.mark.slow  # a separated async run whose rollout worker is killed at step 2 (~20 s)
def test_a_rollout_worker_that_dies_with_requests_in_flight_is_named(tiny_model, tmp_path, monkeypatch):
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer
    from portrl.trainer.rollout_pipeline import RolloutPipeline
    from portrl.workers.group import WorkerDiedError

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = default_config()
    for k, v in _overrides(tiny_model, tmp_path / "run", **{"trainer.mode": "async",
                                                             "async_training.max_staleness": 2}).items():
        OmegaConf.update(cfg, k, v)
    init_ray(cfg, get_backend("cpu"), num_cpus=3)
    trainer = RLTrainer(settle_config(cfg))
    pid = trainer.rollout.info[0]["pid"]
    take = RolloutPipeline.take

    def take_after_a_crash(self, step, version, extra=None):  # the real take, once the worker is gone at step 2
        if step == 2:
            os.kill(pid, signal.SIGKILL)
        return take(self, step, version, extra)

    monkeypatch.setattr(RolloutPipeline, "take", take_after_a_crash)
    try:
        with pytest.raises(WorkerDiedError) as err:
            trainer.fit()
        assert f"rollout rank 0 on node 127.0.0.1 (node id" in str(err.value) and f"pid {pid}" in str(err.value)
        assert len(_metrics(tmp_path / "run")) == 2  # validation before training and step 1
    finally:
        trainer.shutdown_workers()
