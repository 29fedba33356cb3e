"""The environment portrl sets before torch loads (portrl/process_env.py): defaults, the user's values winning,
the CLI applying them, and torch's CPU allocator really taking huge pages from the variable."""

import os
import subprocess
import sys

import pytest

from portrl import process_env
from portrl.backends.cpu.backend import transparent_hugepage_mode
from portrl.cli import main


def test_defaults_fill_only_what_the_user_left_unset():
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    process_env.apply_defaults(env)
    assert env == {"THP_MEM_ALLOC_ENABLE": "0", "GOMP_SPINCOUNT": "1000"}
    assert process_env.current({"GOMP_SPINCOUNT": "50"}) == {"GOMP_SPINCOUNT": "50", "THP_MEM_ALLOC_ENABLE": "1"}


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_a_wait_policy_the_user_set_decides_alone(policy):
    """libgomp takes GOMP_SPINCOUNT over OMP_WAIT_POLICY, so a policy the user set gets no spin count beside it,
    and workers get the user's policy."""
    env = {"OMP_WAIT_POLICY": policy}
    process_env.apply_defaults(env)
    assert env == {"OMP_WAIT_POLICY": policy, "THP_MEM_ALLOC_ENABLE": "1"}
    assert process_env.current(env) == env


def test_cli_applies_the_defaults_before_any_command(monkeypatch, capsys):
    for name in process_env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(process_env, "_applied", set())  # what this test's main() records stays with it
    assert main([]) == 0  # no command: the help
    assert {name: os.environ[name] for name in process_env.DEFAULTS} == process_env.DEFAULTS
    assert "OMP_WAIT_POLICY" not in os.environ


_SPIN_SECONDS = """
import time, torch
torch.set_num_threads(2)
x = torch.randn(256, 256)
time.sleep(0.2)  # the pool exists (first matmul below), then: how much CPU do idle threads burn after a region?
torch.mm(x, x)
c0, t0 = time.process_time(), time.perf_counter()
for _ in range(200):
    torch.mm(x, x)
    time.sleep(0.002)  # a pause between parallel regions, as a decode step's Python has
print(time.process_time() - c0, time.perf_counter() - t0)
"""


def _cpu_over_wall(extra: dict) -> float:
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2", **extra}
    out = subprocess.run([sys.executable, "-c", _SPIN_SECONDS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cpu, wall = map(float, out.stdout.split())
    return cpu / wall


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores for a second OpenMP thread")
def test_the_spin_count_is_the_one_torchs_openmp_reads():
    """The name and value portrl sets reach torch's OpenMP runtime: between parallel regions 2 ms apart, libgomp's
    default spin keeps the second thread busy through most of each pause; with portrl's 1000 spins it sleeps."""
    default = _cpu_over_wall({})
    portrl = _cpu_over_wall(process_env.missing({}))
    assert portrl < 0.6 * default, (portrl, default)
_HUGE_KIB = """
import torch
x = torch.ones(48 << 20)  # 192 MiB, written: faulted in
with open("/proc/self/smaps_rollup") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")))
"""


def _anon_huge_kib(thp_alloc: str) -> int:
    env = {"THP_MEM_ALLOC_ENABLE": thp_alloc, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _HUGE_KIB], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(transparent_hugepage_mode() not in ("always", "madvise"),
                    reason="this kernel gives no transparent huge pages")
def test_the_variable_puts_large_torch_tensors_on_huge_pages():
    """The name torch reads is the one portrl sets: with it a 192 MiB tensor sits on 2 MiB pages; without it (in
    the kernel's ``madvise`` mode) it does not."""
    on = _anon_huge_kib(process_env.DEFAULTS["THP_MEM_ALLOC_ENABLE"])
    assert on >= 160 << 10
    if transparent_hugepage_mode() == "madvise":
        assert _anon_huge_kib("0") < 32 << 10
