"""A run whose folder fills up or turns read-only mid-run stops with one line naming the cause and the last good
checkpoint (exit 1, no traceback), that checkpoint stays intact, and the same command continues from it once the
fault is gone (portrl.trainer.storage_faults). The end-to-end test runs a real `portrl train` on a small tmpfs that
it fills, or remounts read-only, after the first checkpoint (root only: it mounts)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from portrl.trainer.checkpoint import verify
from portrl.trainer.storage_faults import storage_error, storage_stopped_message

SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false", "trainer.plot=false",
         "trainer.export_hf=false", "trainer.test_freq=0", "trainer.loggers=[jsonl]", "trainer.total_steps=3",
         "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1"]
# ~1 s a step: time to act on the folder between the first checkpoint and the next write
SLOW_REWARD = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.12)
        return float(solution_str.strip() == str(ground_truth).strip())
""")


class _RayTaskError(Exception):
    """Shaped like Ray's task error: the worker's exception is its ``cause``."""

    def __init__(self, cause):
        super().__init__("task failed")
        self.cause = cause


def test_storage_error_finds_the_os_error_behind_an_exception():
    full = OSError(errno.ENOSPC, "No space left on device", "/run/x")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("save failed") from exc
    except RuntimeError as wrapped:
        assert storage_error(wrapped) is full
    assert storage_error(_RayTaskError(OSError(errno.EROFS, "Read-only file system"))).errno == errno.EROFS
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")  # safetensors
    assert storage_error(rust).errno == errno.ENOSPC
    assert storage_error(OSError(errno.ENOENT, "No such file")) is None  # not a storage fault
    assert storage_error(ValueError("x")) is None


def test_the_message_names_the_cause_and_the_checkpoint():
    err = OSError(errno.ENOSPC, "No space left on device", "/r/checkpoints/.tmp_global_step_2_9/actor.pt")
    line = storage_stopped_message(err, 2, 5, Path("/r/checkpoints/global_step_1"))
    assert line.startswith("the run stopped after step 2 of 5: cannot write /r/checkpoints/.tmp_global_step_2_9/")
    assert "the disk is full" in line and "/r/checkpoints/global_step_1 (intact)" in line and "\n" not in line
    assert "no checkpoint was written yet" in storage_stopped_message(err, 0, 5, None)


def _can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/.portrl-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        probe.rmdir()


@pytest.fixture
def small_disk(tmp_path):
    if not _can_mount():
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _train(tmp_path, out, cache, reward):
    argv = [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())", "--log-level",
            "WARNING", "train", *SMALL, f"trainer.output_dir={out}", f"reward.custom.path={reward}"]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_WAIT_POLICY="PASSIVE", PORTRL_CACHE=str(cache))
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_a_full_or_read_only_folder_stops_with_one_line_and_the_run_continues(fault, small_disk, tmp_path):
    """Slow (~40 s): two real runs of the tiny model (the fault, then the resume)."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    out, cache = small_disk / "run", tmp_path / "cache"
    proc = _train(tmp_path, out, cache, reward)
    try:
        first = out / "checkpoints" / "global_step_1"
        deadline = time.time() + 240
        while not (first / "manifest.json").is_file():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        ckpts = out / "checkpoints"
        if fault == "disk_full":
            _fill(small_disk)
        else:  # the checkpoints folder alone (metrics.jsonl is open for writing: the whole disk would be busy)
            subprocess.run(["mount", "--bind", str(ckpts), str(ckpts)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(ckpts)], check=True)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    cause = "the disk is full" if fault == "disk_full" else "the file system is read-only"
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and cause in lines[0] and f"{first} (intact)" in lines[0], err[-3000:]
    assert verify(first) is None
    if fault == "disk_full":
        (small_disk / "filler").unlink()
    else:
        subprocess.run(["umount", str(out / "checkpoints")], check=True)
    again = _train(tmp_path, out, cache, reward)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert verify(out / "checkpoints" / "global_step_3") is None
