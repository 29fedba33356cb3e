"""Test-session settings that must be in place before torch is imported."""

import os

# No vendor plugin may autoload into torch on a CPU test machine.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Spinning OpenMP threads slow CPU training by up to 10x when the cores are shared (portrl/process_env.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests never write into the user's cache.
os.environ.setdefault("PORTRL_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"portrl-test-cache-{os.getuid()}"))
# Native kernels (backends/cpu/native_build.py) are built once for the session, not once per test that moves
# PORTRL_CACHE to its own folder.
os.environ.setdefault("PORTRL_KERNEL_CACHE", os.path.join(os.environ["PORTRL_CACHE"], "kernels"))
