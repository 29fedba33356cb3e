"""SIGINT and SIGTERM sent to a real `portrl train` mid-run: it finishes the step, saves a checkpoint, exits 130 /
143 with one line naming the checkpoint (no traceback), keeps the finished steps in metrics.jsonl, and the same
command resumes from that checkpoint and finishes. A second signal stops at once. Plus the worker time-limit rule."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from portrl.errors import UserError
from portrl.trainer.interrupts import FIRST_STEP_FACTOR, STEP_FACTOR, StopSignals, stop_signals, worker_timeout
from portrl.trainer.tracking import read_metrics

SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false", "trainer.plot=false",
         "trainer.export_hf=false", "trainer.test_freq=0", "trainer.loggers=[jsonl]"]

# a reward that takes a while, so that a signal lands mid-run (the tiny model's steps take ~10 ms otherwise)
SLOW_REWARD = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep({delay})
        return float(solution_str.strip() == str(ground_truth).strip())
""")


_LAUNCHED: list = []


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # the tiny model is built once for the module


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    yield
    while _LAUNCHED:  # a test that failed half-way: end its run and everything in the run's session
        proc = _LAUNCHED.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()


def _launch(tmp_path, cache, out, delay, *extra):
    reward = tmp_path / f"slow_reward_{delay}.py"
    reward.write_text(SLOW_REWARD.format(delay=delay))
    argv = [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())", "--log-level",
            "WARNING", "train", *SMALL, f"trainer.output_dir={out}", f"reward.custom.path={reward}", *extra]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_WAIT_POLICY="PASSIVE", PORTRL_CACHE=str(cache))
    # a session of its own: the signal goes to the whole process group, as a Ctrl-C in a terminal does
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _LAUNCHED.append(proc)
    return proc


def _steps(out):
    """The steps logged so far; the line the run is writing may be torn (read_metrics skips it)."""
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [record["step"] for record in read_metrics(path)]


def _wait_for_step(proc, out, step=1, timeout=120):
    deadline = time.time() + timeout
    while max(_steps(out), default=-1) < step:
        assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, "no step logged in time"
        time.sleep(0.05)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_cleanly_and_the_same_command_resumes(tmp_path, cache, signum, code):
    out = tmp_path / "run"
    extra = ("trainer.total_steps=24", "trainer.save_freq=0")  # the only checkpoint is the interrupt's
    proc = _launch(tmp_path, cache, out, 0.02, *extra)
    _wait_for_step(proc, out)
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    last = lines[-1]
    assert last.startswith(f"portrl: stopped by {signal.Signals(signum).name} after step "), err
    done = int(last.split("after step ")[1].split()[0])
    ckpt = out / "checkpoints" / f"global_step_{done}"
    assert str(ckpt) in last and "trainer.resume=auto" in last
    assert (ckpt / "manifest.json").is_file()
    assert _steps(out) == list(range(0, done + 1))  # validation (step 0) and every finished step, no more
    assert done < 24

    again = _launch(tmp_path, cache, out, 0.02, *extra)
    text, err2 = again.communicate(timeout=180)
    assert again.returncode == 0, err2[-3000:]
    assert f"resumed from       {ckpt}" in text
    assert _steps(out) == list(range(0, 25))


def test_second_signal_stops_at_once(tmp_path, cache):
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.5, "trainer.total_steps=20", "trainer.save_freq=0")  # 4 s a step
    _wait_for_step(proc, out, step=0)  # validation logged: the first step is running
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 3.0  # not after the step (4 s of rewards)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-2].startswith("portrl: SIGINT received: finishing step 1, then saving a checkpoint and stopping")
    assert lines[-1] == ("portrl: stopped at once by a second SIGTERM during step 1 of 20; no checkpoint was "
                         "written: rerun the same command to start again")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("global_step_*"))
    assert _steps(out) == [0]


def test_handlers_are_restored_and_nested_blocks_share_one_state():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_signals() as outer:
        assert signal.getsignal(signal.SIGINT) == outer._handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does to SIGTERM
        with stop_signals() as inner:
            assert inner is outer and signal.getsignal(signal.SIGTERM) == outer._handle
        os.kill(os.getpid(), signal.SIGTERM)  # first signal: only the flag
        deadline = time.time() + 5
        while not outer.requested and time.time() < deadline:
            time.sleep(0.01)
        assert outer.requested and outer.exit_code == 143 and outer.name == "SIGTERM"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert StopSignals().exit_code == 1  # nothing asked


def test_first_signal_while_the_run_starts_stops_at_once():
    code = textwrap.dedent("""
        import time
        from portrl.trainer.interrupts import stop_signals
        with stop_signals() as stop:
            stop.at_once, stop.abort_message = True, lambda name: f"stopped by {name} while starting"
            stop.on_abort = [lambda: print("hook ran", flush=True)]
            print("ready", flush=True)
            time.sleep(20)
        print("not reached")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _LAUNCHED.append(proc)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)  # not after the 20 s the block sleeps
    assert proc.returncode == 143 and out == "hook ran\n" and err == "stopped by SIGTERM while starting\n", (out, err)


def _ray_processes(driver):
    """The processes of the run's local Ray (and its watchdog): everything below the driver."""
    return pytest.importorskip("psutil").Process(driver.pid).children(recursive=True)


def _gone_within(procs, seconds):
    """Seconds until none of ``procs`` runs (a zombie counts as gone); fails past ``seconds``."""
    psutil = pytest.importorskip("psutil")
    t0 = time.time()
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return time.time() - t0
        assert time.time() - t0 < seconds, f"left running after {seconds}s: {[(p.pid, p.name()) for p in alive]}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("when, signum", [("raylet", signal.SIGINT), ("sft step ", signal.SIGINT),
                                          ("ray::WorkerHost", signal.SIGTERM)])
def test_signal_while_ray_starts_or_the_warm_start_runs(tmp_path, cache, when, signum):
    """A first Ctrl-C in a 2-worker run while Ray starts (its raylet is up) or while the workers run the SFT warm
    start stops the run within seconds (before, it waited for the workers and the whole warm start: 20-72 s):
    exit 130, one line, no traceback, and every process of the run's Ray gone. A SIGTERM once the workers' processes
    are up is ours too, not ray.init's (which exited 15 without a word). Slow: Ray's start on 2 shared cores (~15 s)."""
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.05, "trainer.total_steps=20", "trainer.num_workers=2",
                   "model.sft_steps=1000")  # a warm start of ~70 s, logged every 100 steps
    deadline = time.time() + 180
    if when != "sft step ":
        while not any(when in c.name() for c in _ray_processes(proc) if c.is_running()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, f"no {when} process in time"
            time.sleep(0.05)
    else:
        for line in proc.stdout:  # the workers' lines reach the driver's stdout
            if when in line:
                break
    procs = {p.pid: p for p in _ray_processes(proc)}
    os.killpg(proc.pid, signum)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < 90:  # what Ray starts until the driver ends counts too
        try:
            procs.update({p.pid: p for p in _ray_processes(proc) if p.pid not in procs})
        except pytest.importorskip("psutil").NoSuchProcess:  # the driver just ended
            break
        time.sleep(0.05)
    took = time.time() - t0
    _, err = proc.communicate(timeout=90)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"portrl: stopped by {name} before step 1 of 20; no checkpoint was "
                                            "written: rerun the same command to start again"), err[-3000:]
    assert took < 10, f"stopped {took:.1f}s after the signal"
    gone = took + _gone_within(list(procs.values()), 10)
    print(f"\n{name} at {when!r}: stopped after {took:.1f}s, every Ray process gone after {gone:.1f}s")
    assert not any((out / "checkpoints").glob("global_step_*"))


@pytest.mark.slow
def test_driver_killed_alone_takes_its_ray_with_it(tmp_path, cache):
    """kill -9 of the driver alone (not its process group) once step 1 is logged: every process of its local Ray
    (raylet, GCS, agents, workers) and the watchdog are gone within 10 s (the agents lived ~60 s before).
    Slow: a 2-worker Ray run to step 1 (~40 s on 2 shared cores)."""
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.05, "trainer.total_steps=30", "trainer.num_workers=2")
    _wait_for_step(proc, out, timeout=180)
    procs = _ray_processes(proc)
    names = " ".join(p.name() for p in procs)
    assert "raylet" in names and "ray::WorkerHost" in names and "Agent" in names, names
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    took = _gone_within(procs, 10)
    print(f"\nkill -9 of the driver alone: its {len(procs)} Ray processes gone after {took:.1f}s")


def test_worker_time_limit_rule():
    assert worker_timeout(None, 10.0) is None and worker_timeout(0, 10.0) is None
    assert worker_timeout(300, None) == FIRST_STEP_FACTOR * 300  # nothing measured yet
    assert worker_timeout(300, 2.0) == 300  # fast steps: the base limit
    assert worker_timeout(300, 100.0) == STEP_FACTOR * 100.0  # slow steps stretch it
    with pytest.raises(UserError, match="trainer.worker_timeout_s=-1"):
        worker_timeout(-1, None)


@pytest.mark.slow
def test_ctrl_c_on_a_two_worker_ray_run(tmp_path, cache):
    """Ctrl-C reaches the whole process group; Ray's workers leave it to the driver: no stack dump from Ray, exit
    130, the checkpoint named, and every Ray process gone."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.05, "trainer.total_steps=30", "trainer.num_workers=2")
    _wait_for_step(proc, out, timeout=180)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("WorkerHost" in " ".join(c.cmdline()) or "default_worker" in " ".join(c.cmdline())
               for c in children if c.is_running())
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Stack" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("portrl: stopped by SIGINT after step ") and "checkpoints/global_step_" in last, err
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.slow
def test_frozen_ray_worker_stops_the_run_naming_it(tmp_path, cache):
    """SIGSTOP to one worker of a 2-worker run: within trainer.worker_timeout_s the run ends with an error naming
    that worker (pid, stopped) and the last good checkpoint."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.05, "trainer.total_steps=30", "trainer.num_workers=2",
                   "trainer.save_freq=1", "trainer.worker_timeout_s=4")
    _wait_for_step(proc, out, step=2, timeout=180)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
               if c.is_running() and c.name().startswith("ray::WorkerHost")]
    assert len(workers) == 2, [c.name() for c in workers]
    frozen = workers[1]
    frozen.suspend()  # SIGSTOP
    t0 = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if frozen.is_running():
            frozen.resume()
    waited = time.time() - t0
    assert proc.returncode not in (0, None), err[-3000:]
    line = [x for x in err.splitlines() if "stopped answering" in x][-1]
    assert f"pid {frozen.pid}) stopped answering: its process is stopped" in line, line
    limit = re.search(r"no result from `\w+` within (\d+)s \(trainer.worker_timeout_s", line)
    assert limit, line
    # max(4 s, 5 x the slowest step): 4 s unless the shared machine made a step take over 0.8 s
    assert 4 <= int(limit.group(1)) and int(limit.group(1)) - 1 <= waited < int(limit.group(1)) + 15, (waited, line)
    assert "resume from the last good checkpoint" in line and "checkpoints/global_step_" in line, line


def test_signal_before_the_first_step_writes_nothing(tmp_path, cache):
    out = tmp_path / "run"
    # validation before training scores 8 rows at 0.5 s each: the signal lands in it
    proc = _launch(tmp_path, cache, out, 0.5, "trainer.total_steps=20")
    for line in proc.stdout:
        if "sft step 4/4" in line:  # the warm start is done; validation starts
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("portrl: stopped by SIGINT before step 1 of 20; no checkpoint was written: "
                                            "rerun the same command to start again")
    assert not any((out / "checkpoints").glob("global_step_*"))


@pytest.mark.slow
def test_second_ctrl_c_on_a_ray_run_leaves_no_process(tmp_path, cache):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = _launch(tmp_path, cache, out, 0.3, "trainer.total_steps=30", "trainer.num_workers=2")  # 2.4 s a step
    _wait_for_step(proc, out, timeout=180)
    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 5.0
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("portrl: stopped at once by a second SIGINT during step "), err
    # Ray's own processes, its workers and the raylet's agents are stopped, not left behind
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.parametrize("override, phrase", [
    ("trainer.worker_timeout_s=-1", "trainer.worker_timeout_s=-1.0 must be > 0 (seconds), or 0 / null (no limit)"),
    ("reward.timeout_s=-2", "reward.timeout_s=-2.0 must be > 0 (seconds per batch), or 0 / null (no limit)"),
    ("reward.on_timeout=skip", "reward.on_timeout='skip' is not one of 'error', 'zero'"),
    ("trainer.save_on_interrupt=maybe", "trainer.save_on_interrupt"),
])
def test_bad_interrupt_and_timeout_settings(override, phrase, capsys):
    from portrl.cli import main

    assert main(["--log-level", "WARNING", "train", override]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err, err


def test_ctrl_c_in_another_command_is_one_line(tmp_path, cache):
    """Commands without handling of their own (here `portrl sft`) end on Ctrl-C with one line and exit 130."""
    argv = [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())", "--log-level",
            "WARNING", "sft", *SMALL[:5], "--steps", "3000", "--batch-size", "4", "--output", str(tmp_path / "sft")]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_WAIT_POLICY="PASSIVE", PORTRL_CACHE=str(cache))
    # 3000 steps: the first progress line comes at step 300, and the run goes on ~10x longer than that after it (with
    # 1000 steps a loaded CI host once let the whole run finish before the signal); Ctrl-C's default action, as a
    # shell gives a foreground command, whatever this test process inherited
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _LAUNCHED.append(proc)
    for line in proc.stdout:
        if "sft step" in line:  # training
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "portrl sft: stopped by SIGINT before it finished"
    assert not list(tmp_path.iterdir())  # nothing half-written
