"""Test-session settings that must be in place before torch is imported, and the inputs the whole session shares.

The suite runs in parallel processes (pytest-xdist, README "Tests"); each worker imports this file first.
"""

import os
import sys

import pytest

# No vendor plugin may autoload into torch on a CPU test machine.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Spinning OpenMP threads slow CPU training by up to 10x when the cores are shared (portrl/process_env.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests never write into the user's cache. One cache per xdist worker ("gw0", ...): two processes that write the
# same cached tiny model at once rename it away under each other's reader (portrl.user_files.replace_dir).
_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"portrl-test-cache-{os.getuid()}")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ.setdefault("PORTRL_CACHE", f"{_CACHE}-{_WORKER}" if _WORKER else _CACHE)
# Native kernels (backends/cpu/native_build.py) are built once for the session, not once per test that moves
# PORTRL_CACHE to its own folder; all workers share them (a build is written under a temporary name and renamed).
os.environ.setdefault("PORTRL_KERNEL_CACHE", os.path.join(_CACHE, "kernels"))


@pytest.fixture(scope="module", autouse=True)
def _ray_ends_with_its_file():
    """A local Ray a test file started ends with the file. portrl's init_ray keeps a Ray that runs, so a later file
    in the same xdist process would otherwise run on a cluster sized for another file (CI: a PRIME run found 3
    CPUs where it starts 4, and its PRM could not reserve its 2)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# The tiny model most tests use: 1 layer, hidden size 32, 2 heads (1 kv head), initializer range 0.2.
TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64, "seed": 0,
        "initializer_range": 0.2}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of the tiny model TINY (the ``arith`` tokenizer), written once per session and shared by every
    test that asks for it: read-only, a test that changes it copies it first."""
    from portrl.models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", **TINY))

