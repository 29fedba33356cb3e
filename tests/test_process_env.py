"""The environment portrl sets before torch loads (portrl/process_env.py): defaults, the user's values winning,
the CLI applying them, and torch's CPU allocator really taking huge pages from the variable."""

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
