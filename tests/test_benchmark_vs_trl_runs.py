"""benchmarks/vs_trl.py's portrl side runs (it drives RLTrainer.train_step without train(): an attribute that
only train() made stopped it for 14 hours unnoticed). The smallest workload, one step, no TRL (the bench extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_portrl_side_of_vs_trl_runs_a_step(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--configs", "small", "--sides", "portrl",
           "--steps", "1", "--warmup", "0", "--max-new", "8", "--prompts", "2", "--samples", "2", "--ceilings", "off"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("CPU: ")  # the host line: model, flags, kernel variant
    row = next(line for line in done.stdout.splitlines() if line.startswith("portrl "))
    assert float(row.split()[1]) > 0  # s/step of the timed step
