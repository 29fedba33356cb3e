"""The environment portrl sets before torch loads (portrl/process_env.py): defaults, the user's values winning,
the CLI applying them, and torch's CPU allocator really taking huge pages from the variable."""

import platform
import subprocess
import sys

import pytest

from portrl import process_env
from portrl.backends.cpu.backend import transparent_hugepage_mode
from portrl.cli import main


def test_defaults_fill_only_what_the_user_left_unset():
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    process_env.apply_defaults(env)
    assert env == {"THP_MEM_ALLOC_ENABLE": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    assert process_env.current({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE",
                                                                  "THP_MEM_ALLOC_ENABLE": "1"}


def test_cli_applies_the_defaults_before_any_command(monkeypatch, capsys):
    for name in process_env.DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert main([]) == 0  # no command: the help
    import os

    assert {name: os.environ[name] for name in process_env.DEFAULTS} == process_env.DEFAULTS


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


_RSS_AFTER_FREE = """
import sys
from portrl import process_env
applied = process_env.keep_freed_memory()
import torch

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10

before = rss_mib()
x = torch.ones(64 << 20)  # 256 MiB, written
del x
print(applied, rss_mib() - before)
"""


def _applied_and_kept_mib(opt_out: bool) -> tuple:
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin", "THP_MEM_ALLOC_ENABLE": "0"}
    if opt_out:
        env[process_env.KEEP_FREED_MEMORY_VAR] = "0"
    out = subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, kept = out.stdout.split()[-2:]
    return applied == "True", int(kept)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_keeps_a_freed_tensor_resident_and_can_be_turned_off():
    """With it, a freed 256 MiB tensor stays in the process (the next one reuses its pages); opted out, glibc gives
    it back to the kernel at once (it was its own mapping)."""
    assert _applied_and_kept_mib(opt_out=False) == (True, pytest.approx(256, abs=32))
    applied, kept = _applied_and_kept_mib(opt_out=True)
    assert not applied and kept < 32


def test_setup_process_keeps_freed_memory_for_the_cpu_backend(monkeypatch):
    from portrl.config.schema import default_config
    from portrl.device import get_backend
    from portrl.workers import setup

    calls = []
    monkeypatch.setattr(setup.process_env, "keep_freed_memory", lambda: calls.append(1) or True)
    setup.setup_process(default_config(), get_backend("cpu"))
    assert calls == [1]
