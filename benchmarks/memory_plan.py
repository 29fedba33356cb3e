"""The memory plan against what runs measure: each phase's predicted and measured peak, side by side (issue 61).

    python benchmarks/memory_plan.py [--configs tiny,med,...] [--keep DIR]
    python benchmarks/memory_plan.py --levers     # each offload lever's predicted effect at Qwen2.5-7B's shape

Each configuration runs ``portrl train`` for 2 steps in a process of its own (the built-in tiny model, or the
medium one: hidden 512, 4 layers, 8 heads, 2 KV heads, MLP 1536; arith, no SFT warm start); the second step's
``memory/plan_gib/<phase>`` (the plan at the step's own sizes: portrl/plan) and ``memory/peak_gib/<phase>``
(measured: the CPU's tensor count, backends/cpu/heap.py) are printed with their ratio, per phase (``logp``: the
reference's log-prob pass). Needs a C++ compiler (the tensor count).

``--levers`` runs nothing: the plan of Qwen2.5-7B's shape (config.json only) on 8 H100s with a reference, 512 + 2048
tokens a row and 16384-token micro-batches, each phase's predicted GiB per device without a lever and with each
(portrl/workers/offload.py). On the CPU the host is the device and no lever lowers anything; the device check's
``grpo-offload`` part measures their effect on an accelerator.
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

MEDIUM = ["model.tiny.hidden_size=512", "model.tiny.num_layers=4", "model.tiny.num_heads=8",
          "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=1536"]
CONFIGS = {
    "tiny": [],
    "tiny_n8_r64": ["rollout.n=8", "data.max_response_length=64"],
    "tiny_b32": ["data.train_batch_size=32", "actor.ppo_mini_batch_size=32"],
    "tiny_noreplay": ["model.reuse_rollout_forward=false"],
    "tiny_gc": ["model.gradient_checkpointing=true"],
    "tiny_kl": ["actor.use_kl_loss=true"],
    "tiny_gae": ["algorithm=ppo"],
    "med": MEDIUM,
    "med_r64": [*MEDIUM, "data.max_response_length=64"],
    "med_gc_kl": [*MEDIUM, "model.gradient_checkpointing=true", "actor.use_kl_loss=true"],
    "med_noreplay": [*MEDIUM, "model.reuse_rollout_forward=false"],
}
PHASES = ("gen", "ref", "old_log_prob", "values", "update_actor", "update_critic")


def measure(name: str, work: Path) -> dict:
    run = work / name
    cmd = [sys.executable, "-m", "portrl", "train", "trainer.total_steps=2", "model.sft_warm_start=false",
           f"trainer.output_dir={run}", "trainer.val_before_train=false", "trainer.test_freq=0", *CONFIGS[name]]
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "memory/peak_gib/step" in r][-1]


QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
LEVER_RUN = ["trainer.num_workers=8", "actor.use_kl_loss=true", "model.gradient_checkpointing=true",
             "data.max_prompt_length=512", "data.max_response_length=2048", "actor.max_tokens_per_micro_batch=16384"]
LEVERS = {"none": [], "optimizer": ["actor.offload.optimizer=true"], "params": ["actor.offload.params=true"],
          "reference": ["ref.param_offload=true"], "activations": ["actor.offload.activations=true"],
          "all four": ["actor.offload.optimizer=true", "actor.offload.params=true", "ref.param_offload=true",
                       "actor.offload.activations=true"]}


def levers_table() -> None:
    """Each lever's predicted peaks per phase (GiB per device), side by side."""
    from portrl.config.composition import compose
    from portrl.plan.run_plan import Device, plan_run
    from portrl.plan.shape import shape_of_raw

    shape = shape_of_raw(QWEN25_7B, "Qwen2.5-7B")
    print("Qwen2.5-7B's shape, 8 x H100 (80 GiB), bfloat16, FSDP over 8, a reference; GiB per device")
    print(f"{'lever':12s} {'gen':>7s} {'logp':>7s} {'ref':>7s} {'update':>7s} {'peak':>7s}")
    for name, over in LEVERS.items():
        cfg = compose(preset="h100", overrides=["model.path=unused", *LEVER_RUN, *over], check=False)
        plan = plan_run(cfg, shape, 8, 80 * 2**30, device=Device(dtype="bfloat16", host=False))
        gib = {p.phase: p.bytes / 2**30 for p in plan.phases}
        print(f"{name:12s} {gib['gen']:7.2f} {gib['logp']:7.2f} {gib['ref']:7.2f} {gib['update_actor']:7.2f} "
              f"{plan.peak.bytes / 2**30:7.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--keep", help="write the runs here instead of a temporary folder")
    p.add_argument("--levers", action="store_true", help="print each offload lever's predicted peaks; run nothing")
    args = p.parse_args()
    print(_common.host_line(_common.host_info()))
    if args.levers:
        levers_table()
        return 0
    print(f"{'config':14s} {'phase':14s} {'plan MiB':>9s} {'measured':>9s} {'ratio':>6s}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        for name in args.configs.split(","):
            m = measure(name, work)
            for phase in PHASES:
                if f"memory/plan_gib/{phase}" in m and f"memory/peak_gib/{phase}" in m:
                    plan, meas = m[f"memory/plan_gib/{phase}"] * 1024, m[f"memory/peak_gib/{phase}"] * 1024
                    worst = max(worst, abs(plan / meas - 1))
                    print(f"{name:14s} {phase:14s} {plan:9.1f} {meas:9.1f} {plan / meas:6.2f}", flush=True)
    print(f"largest distance from the measured peak: {100 * worst:.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
