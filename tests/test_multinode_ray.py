"""Beyond one machine (docs/backends/index.md, "Several nodes"): a Ray cluster of two nodes built with `ray start` as on real nodes,
here two raylets on this machine with one CPU each, and `portrl train` joining it (trainer.ray_address,
trainer.nnodes=2): its two FSDP2 workers land one on each node (one CPU per bundle cannot fit both on one), train,
write a checkpoint (a shard from each node), and a second command resumes from it on the same cluster.

Each `ray start --block` runs in a process session of its own and is ended by the test (SIGTERM stops that node's
processes), never by `ray stop`, which would end every Ray on the machine, a parallel test's too. The cluster uses
Ray's token authentication, as a cluster of real nodes should (the same page): a token of the test's own, given to both
nodes and to `portrl train` by RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH.
"""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    from portrl.workers.parallel import find_free_port  # below the ephemeral range, as portrl's own rendezvous

    return find_free_port()


def _ray_env(tmp_path):
    token = tmp_path / "auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    # a local Ray an earlier test of this process started set Ray's single-machine switch here (portrl.workers.
    # ray_env._loopback_only), which would refuse the second node: real nodes do not have it
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.setdefault("RAY_gcs_server_port_wait_time_s", "120")  # a loaded CI host: as portrl's own local start
    return env


def _start_node(args, tmp_path, name):
    log = open(tmp_path / f"{name}.log", "w")
    env = _ray_env(tmp_path)
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_nodes(address, count, env, timeout_s=240):
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(len([n for n in ray.nodes() if n['Alive']]))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # a probe that hangs (a loaded machine: CI once saw 60 s) is tried again until the deadline
            out = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                                 timeout=max(10.0, deadline - time.monotonic()), env=env)
        except subprocess.TimeoutExpired:
            continue
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise AssertionError(f"the cluster at {address} did not reach {count} nodes in {timeout_s}s")


@pytest.fixture
def two_node_cluster(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    nodes = [_start_node(["--head", f"--port={port}", "--include-dashboard=false"], tmp_path, "head")]
    try:
        time.sleep(3)
        nodes.append(_start_node([f"--address={address}"], tmp_path, "worker"))
        _wait_for_nodes(address, 2, _ray_env(tmp_path))
        yield address
    finally:
        for proc in reversed(nodes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in nodes:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _train(address, out, steps, tmp_path):
    args = [sys.executable, "-m", "portrl", "train", "--device", "cpu", "model=tiny", "data=arith",
            f"trainer.ray_address={address}", "trainer.nnodes=2", "trainer.num_workers=2", "actor.strategy=fsdp",
            "model.sft_warm_start=false", "data.arith.num_train=32", "data.arith.num_test=8",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=5",
            f"trainer.total_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.plot=false",
            "trainer.export_hf=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}"]
    env = {**_ray_env(tmp_path), "PORTRL_CACHE": str(tmp_path / "cache"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.slow  # a two-node Ray cluster starts (~15 s) and two runs join it (~30 s each)
def test_two_fsdp_workers_on_two_nodes_train_checkpoint_and_resume(two_node_cluster, tmp_path):
    out = tmp_path / "run"
    log = _train(two_node_cluster, out, 2, tmp_path)
    placed = re.search(r"worker group ActorRolloutWorker: 2 workers on (\d) node\(s\): (.*)", log)
    assert placed and placed.group(1) == "2", log[-2000:]  # one worker on each node
    shards = sorted(p.name for p in (out / "checkpoints" / "global_step_2" / "actor").iterdir())
    assert "rank_0.safetensors" in shards and "rank_1.safetensors" in shards  # FSDP2: a shard from each node

    log = _train(two_node_cluster, out, 3, tmp_path)
    assert "resum" in log.lower() and "global_step_2" in log
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # step 3 only was trained by the second command, after the checkpoint of step 2
