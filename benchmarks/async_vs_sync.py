"""Asynchronous RL against synchronous, side by side in one invocation (issue 35, item 8).

    python benchmarks/async_vs_sync.py [--data arith|wordprob] [--seeds 0,1,2] [--steps 20] [--modes MODE,...]
                                       [--prompts 16] [--samples 8] [--lr 1e-4] [--sft-steps 400] [--model-cache DIR]
    python benchmarks/async_vs_sync.py --quick        # a short smoke of the wiring (small model, 3 steps)

Workload: GRPO (the ``grpo`` preset: group advantages, KL loss against the reference) on the arith task
(``data=arith``, difficulty 1: a number below 100 plus or minus one digit, answers of a few tokens, at most 16 new
tokens; greedy validation on its 200 test problems; ``--data wordprob``: the word problems of three steps, worked
answers of 64-85 tokens, at most 128 new tokens, where generation is a larger share of a step) with the medium
benchmark model (benchmarks/_common.py CONFIGS:
Qwen2 architecture, hidden 512, 4 layers, arith vocabulary; 15.4M parameters), float32 on the CPU. A model that
knows nothing of the task gets no reward, so every run starts from one SFT warm start of that model (``portrl sft``:
``--sft-steps`` steps of ``--sft-batch`` examples at ``--sft-lr``, stopped early once P(answer) reaches
``--sft-target-p``, as the default run's warm start does), written once into ``--model-cache`` and shared by every
mode and seed (``--warm-start DIR``: start from that model folder instead, e.g. an SFT made by hand). Each RL run:
``--prompts`` prompts x ``--samples`` samples a step, one optimizer step per batch, constant lr ``--lr``,
``--steps`` steps, validation before the first step and after the last only.

Modes (``--modes``, all by default, run in this order for each seed so that a change in machine load hits each):

* ``sync-colocated``: ``trainer.mode=sync`` with rollout and training in one process on 2 torch threads (what
  users run today);
* ``sync``: ``trainer.mode=sync, rollout.placement=separated``: the rollout worker (a Ray actor with its own
  model) and the trainer on disjoint cores (on a 2-core machine one each), so every separated mode has the same
  resources;
* ``one_step_off``: batch k+1 generates while step k trains (staleness 1, no partial rollout);
* ``async-s1`` / ``async-s2``: ``trainer.mode=async``, ``async_training.max_staleness`` 1 / 2, ``stale_samples
  =wait``, partial rollout on (the defaults).

Each run is ``portrl train`` in a process of its own; the figures come from its ``metrics.jsonl``. Samples per
second: trained response sequences (prompts x samples per step) over the summed ``timing_s/step`` of steps 2..S
(start-up, the first step, which cannot overlap, and validation excluded). Accuracy: ``val/acc/mean`` after the
last step, so after the same number of samples in every mode. Printed per mode: the medians over the seeds (range
in brackets), the ratios of the medians to ``sync`` and ``sync-colocated``, the median phase times of a step
(``timing_s/<phase>``: in the overlapped modes ``gen`` is the time the trainer waited for its batch) and the
batches' mean / max staleness (``async/staleness_*``). ``--json PATH`` writes every run's figures; ``--table
PATH ...`` prints the table of the runs of such files, pooled (seeds run in separate invocations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

SEPARATED = ["rollout.placement=separated"]
MODES: Dict[str, List[str]] = {
    "sync-colocated": ["trainer.mode=sync", "device.num_threads=2"],
    "sync": ["trainer.mode=sync", *SEPARATED],
    "one_step_off": ["trainer.mode=one_step_off", *SEPARATED],
    "async-s1": ["trainer.mode=async", "async_training.max_staleness=1", *SEPARATED],
    "async-s2": ["trainer.mode=async", "async_training.max_staleness=2", *SEPARATED],
}
BASELINES = ("sync", "sync-colocated")  # the ratios' denominators
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "sync")  # shown first; others follow
QUICK = dict(config="small", steps=3, seeds="0", prompts=4, samples=2, sft_steps=20, sft_batch=16, sft_target_p=None)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line; a bad value is argparse's one-line error and exit code 2."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated trainer.seed values (default 0,1,2)")
    p.add_argument("--steps", type=int, default=20, help="RL steps per run (>= 2; default 20)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--data", default="arith", choices=("arith", "wordprob"),
                   help="task: arith (answers of a few tokens) or wordprob (worked answers of 64-85 tokens)")
    p.add_argument("--config", default="medium", choices=sorted(_common.CONFIGS), help="benchmark model")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--lr", type=float, default=1e-4, help="actor learning rate, constant (default 1e-4)")
    p.add_argument("--sft-steps", type=int, default=400, help="SFT warm start schedule length (default 400)")
    p.add_argument("--sft-batch", type=int, default=32, help="SFT examples per step (default 32)")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="SFT peak learning rate (default 1e-3)")
    p.add_argument("--sft-target-p", type=float, default=0.45,
                   help="stop the SFT once P(answer) reaches this (default 0.45; <= 0: run the whole schedule)")
    p.add_argument("--model-cache", default=None, help="folder that keeps the model and its SFT between runs")
    p.add_argument("--warm-start", default=None,
                   help="start every run from this model folder instead (no SFT here; e.g. an earlier portrl sft)")
    p.add_argument("--quick", action="store_true", help="smoke: small model, 3 steps, seed 0, 4 x 2 samples")
    p.add_argument("--json", default=None, help="write every run's figures to this file")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="run nothing: print the table of the runs in these --json files, pooled (e.g. seeds run apart)")
    p.add_argument("--verbose", action="store_true", help="show each run's output")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        args.seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: comma-separated integers, e.g. 0,1,2")
    args.modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(MODES)}")
    if not args.seeds or args.steps < 2 or min(args.prompts, args.samples, args.sft_steps, args.sft_batch) < 1:
        p.error("--seeds needs one seed or more, --steps >= 2, --prompts / --samples / --sft-steps / --sft-batch >= 1")
    missing = [t for t in args.table or [] if not Path(t).is_file()]
    if missing:
        p.error(f"--table: no such file {', '.join(missing)} (give files written by --json)")
    if args.warm_start and not (Path(args.warm_start) / "config.json").is_file():
        p.error(f"--warm-start {args.warm_start}: not a model folder (no config.json)")
    if args.sft_target_p is not None and args.sft_target_p <= 0:
        args.sft_target_p = None
    return args


def portrl_cmd(*argv: str) -> List[str]:
    """The ``portrl`` command line run by this Python."""
    return [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())", *argv]


def run_quiet(cmd: List[str], verbose: bool, what: str) -> None:
    """Run ``cmd``; its output is shown when it fails or ``verbose``; RuntimeError naming ``what`` on failure."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if verbose or proc.returncode != 0:
        print(proc.stdout[-20000:], file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {proc.returncode} (output above)")


def warm_start(args: argparse.Namespace, cache: Path) -> Path:
    """The SFT warm start every run starts from: the benchmark model trained by ``portrl sft`` on the task, made once
    per settings in ``cache`` (its name holds the settings)."""
    model = cache / args.config
    if not (model / "config.json").exists():
        _common.build_model(args.config, model)
    target = f"p{args.sft_target_p:g}" if args.sft_target_p else "full"
    task = "" if args.data == "arith" else f"-{args.data}"
    out = cache / f"sft-{args.config}{task}-s{args.sft_steps}-b{args.sft_batch}-lr{args.sft_lr:g}-{target}"
    if not (out / "config.json").exists():
        overrides = [f"model.path={model}", f"data={args.data}", "device.num_threads=2"]
        if args.sft_target_p:
            overrides.append(f"model.sft_target_answer_p={args.sft_target_p}")
        t0 = time.perf_counter()
        run_quiet(portrl_cmd("sft", "--output", str(out), "--on-existing", "move_aside", "--steps",
                             str(args.sft_steps), "--batch-size", str(args.sft_batch), "--lr", str(args.sft_lr),
                             *overrides), args.verbose, "the SFT warm start")
        print(f"SFT warm start written to {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def train_overrides(args: argparse.Namespace, model: Path, mode: str, seed: int, out_dir: Path) -> List[str]:
    """The ``portrl train`` overrides of one run."""
    return [
        f"data={args.data}", "algorithm=grpo", f"model.path={model}", "model.sft_warm_start=false",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"rollout.n={args.samples}", f"actor.optim.lr={args.lr}", f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.steps}", "trainer.val_before_train=true", f"trainer.seed={seed}",
        f"trainer.output_dir={out_dir}", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
        "trainer.progress_bar=false", "trainer.loggers=[jsonl]", *MODES[mode],
    ]


def summarize(records: List[dict], sequences_per_step: int) -> dict:
    """One run's figures from its ``metrics.jsonl`` records (``{"step": k, ...}``; step 0: validation before
    training): ``samples_per_s`` over steps 2..S (see the module docstring), ``acc_before`` / ``acc_after`` (the
    last ``val/acc/mean``), ``phases`` (median seconds of each ``timing_s/<phase>`` over steps 2..S, the
    validation's excluded), the staleness means of the steps that log it, and the seconds of all steps (``step_s``) and
    of the validations (``val_s``)."""
    steps = sorted((r for r in records if int(r.get("step", 0)) >= 1), key=lambda r: int(r["step"]))
    timed = [r for r in steps[1:] if "timing_s/step" in r]
    if not timed:
        raise ValueError("no timed step after the first: run at least 2 steps")
    vals = [r["val/acc/mean"] for r in sorted(records, key=lambda r: int(r.get("step", 0))) if "val/acc/mean" in r]
    names = {k.split("/", 1)[1] for r in timed for k in r if k.startswith("timing_s/") and k != "timing_s/val"}
    phases = {n: _common.median([r[f"timing_s/{n}"] for r in timed if f"timing_s/{n}" in r]) for n in names}
    stale = {k: _common.median([r[k] for r in timed if k in r])
             for k in ("async/staleness_mean", "async/staleness_max")}
    return {
        "samples_per_s": sequences_per_step * len(timed) / sum(r["timing_s/step"] for r in timed),
        "acc_before": vals[0] if len(vals) > 1 else None, "acc_after": vals[-1] if vals else None,
        "phases": phases, "staleness_mean": stale["async/staleness_mean"],
        "staleness_max": stale["async/staleness_max"],
        "dropped": sum(r.get("async/dropped_samples", 0.0) for r in steps), "steps": len(steps),
        "step_s": sum(r.get("timing_s/step", 0.0) for r in steps),
        "val_s": sum(r.get("timing_s/val", 0.0) for r in records),
    }


def one_run(args: argparse.Namespace, model: Path, mode: str, seed: int) -> dict:
    """``portrl train`` of one mode and seed in its own process; its summarize()d figures plus wall time."""
    with tempfile.TemporaryDirectory(prefix="portrl-async-bench-") as tmp:
        out_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        run_quiet(portrl_cmd("train", *train_overrides(args, model, mode, seed, out_dir)), args.verbose,
                  f"mode {mode} seed {seed}")
        wall = time.perf_counter() - t0
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        result = summarize([json.loads(x) for x in lines if x.strip()], args.prompts * args.samples)
    return {"mode": mode, "seed": seed, "wall_s": wall, **result}


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table(runs: List[dict], modes: List[str]) -> str:
    """The Markdown table of medians over seeds per mode (range in brackets), ratios to the baselines that ran,
    accuracy difference to ``sync`` in points, median phase times and staleness."""
    by = {m: [r for r in runs if r["mode"] == m] for m in modes}
    med = {m: _common.median([r["samples_per_s"] for r in rs]) for m, rs in by.items()}
    acc = {m: _common.median([r["acc_after"] for r in rs if r["acc_after"] is not None]) for m, rs in by.items()}
    bases = [b for b in BASELINES if b in by]
    names = [p for p in PHASES if any(p in r["phases"] for r in runs)]
    names += sorted({p for r in runs for p in r["phases"]} - set(names) - {"step"})
    head = ["mode", "seeds", "samples/s", *[f"x {b}" for b in bases], "val acc % before -> after",
            "acc - sync (pts)", "s/step", *[f"{p} s" for p in names], "staleness mean / max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, rs in by.items():
        sps = [r["samples_per_s"] for r in rs]
        before = _common.median([r["acc_before"] for r in rs if r["acc_before"] is not None])
        cells = [m, str(len(rs)), f"{med[m]:.2f} [{min(sps):.2f}-{max(sps):.2f}]",
                 *[_fmt(med[m] / med[b], ".2f") + "x" for b in bases],
                 f"{_pct(before)} -> {_pct(acc[m])} [{_pct(min(r['acc_after'] for r in rs))}-"
                 f"{_pct(max(r['acc_after'] for r in rs))}]",
                 _fmt(100 * (acc[m] - acc["sync"]), "+.1f") if "sync" in acc else "-",
                 _fmt(_common.median([r["phases"].get("step") for r in rs]), ".2f"),
                 *[_fmt(_common.median([r["phases"][p] for r in rs if p in r["phases"]]), ".2f") for p in names],
                 f"{_fmt(_common.median([r['staleness_mean'] for r in rs]), '.2f')} / "
                 f"{_fmt(_common.median([r['staleness_max'] for r in rs]), '.0f')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pooled_table(paths: List[str]) -> str:
    """The table() of the runs saved in ``paths`` (--json files), modes in MODES order."""
    runs = [r for path in paths for r in json.loads(Path(path).read_text())["runs"]]
    return table(runs, [m for m in MODES if any(r["mode"] == m for r in runs)])


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(pooled_table(args.table))
        return 0
    cache_tmp = None if args.model_cache else tempfile.TemporaryDirectory(prefix="portrl-async-bench-model-")
    cache = Path(args.model_cache or cache_tmp.name)
    cache.mkdir(parents=True, exist_ok=True)
    model = Path(args.warm_start) if args.warm_start else warm_start(args, cache)
    runs: List[dict] = []
    for seed in args.seeds:
        for mode in args.modes:
            r = one_run(args, model, mode, seed)
            runs.append(r)
            print(f"{mode} seed {seed}: {r['samples_per_s']:.2f} samples/s, val acc {_pct(r['acc_before'])} -> "
                  f"{_pct(r['acc_after'])} %, {r['wall_s']:.0f} s wall ({r['step_s']:.0f} s steps, {r['val_s']:.0f} s "
                  f"validation)", flush=True)
            if args.json:
                _common.write_result(args.json, {"args": {k: v for k, v in vars(args).items()}, "runs": runs})
    print(f"\n{args.config} model, {args.data}, {args.prompts} prompts x {args.samples} samples, {args.steps} steps, "
          f"seeds {','.join(map(str, args.seeds))}; nproc {os.cpu_count()}\n")
    print(table(runs, args.modes))
    if cache_tmp is not None:
        cache_tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
