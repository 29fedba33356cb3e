"""Validation accuracy before and after a fixed RL budget, for every algorithm preset, on the built-in tasks: the
learning table of the docs (issue 38, item 6). Not a timed test: a measurement that writes a table and a plot.

    python benchmarks/learning_table.py OUT_DIR [--presets grpo,vapo,...] [--tasks arith,wordprob] [--steps 30]
                                        [--prompts 16] [--seed 0] [--threads 2] [--fresh] [--verbose]

Workload: the default tiny model (``model=tiny``: Qwen2 architecture, hidden 128, 2 layers, byte vocabulary),
float32 on the CPU, on each task of ``--tasks``: ``arith`` (one-step sums, answers of 1-3 tokens) and ``wordprob``
(two- or three-step word problems with worked answers of 48-85 tokens in GSM8K's ``#### N`` format, scored by the
GSM8K reward). A model trained from scratch knows nothing of a task, so each task first gets one SFT warm start
(``portrl sft data=TASK``: the tiny preset's schedule, stopped once P(answer) reaches ``model.sft_target_answer_p``),
written once to ``OUT_DIR/sft/TASK`` and shared by every preset: all presets of a task start from the same weights.

Each run is ``portrl train algorithm=PRESET data=TASK model.path=OUT_DIR/sft/TASK`` in a process of its own with the
same budget for every preset: ``--steps`` steps of ``--prompts`` prompts (one mini-batch a step), ``trainer.seed``
``--seed``; everything else as the algorithm preset and the tiny preset (``model=tiny``, named: a ``model.path``
alone would leave the model preset out) compose it (samples per prompt, learning
rates, critic, reward model, value pretraining: ``portrl config show algorithm=PRESET`` shows them). Validation:
greedy, on the task's 200 test problems, before the first step and after the last. Read from the run's
``metrics.jsonl`` (portrl.trainer.tracking): ``before`` / ``after`` are the first and last ``val/acc/mean``;
``minutes`` is the run's wall time (start-up, validations and, for VAPO, the preset's critic pretraining included;
the shared SFT not). A run that fails is recorded with its last output line and the table says so.

Written to ``OUT_DIR``: ``results.json`` (every run, rewritten after each, so an interrupted invocation resumes:
runs already there with the same budget are not run again unless ``--fresh``), ``learning_table.md`` (preset,
task, before, after, delta, minutes) and ``learning_table.png`` (one panel per task: the accuracy after the budget
per preset, the accuracy before as a mark on each bar).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "algorithm").glob("*.yaml"))
TASKS = ("arith", "wordprob")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line; a bad value is argparse's one-line error and exit code 2."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder (created; holds the SFT models, the runs, the table and the plot)")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help=f"comma-separated, of {', '.join(PRESETS)} (default all)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default both)")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run (default 30)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step, one mini-batch (default 16)")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed of every run and SFT (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (device.num_threads; default 2)")
    p.add_argument("--timeout-min", type=float, default=180.0, help="limit of one run, minutes (default 180)")
    p.add_argument("--fresh", action="store_true", help="run again what results.json already holds")
    p.add_argument("--verbose", action="store_true", help="show each run's output")
    args = p.parse_args(argv)
    args.presets = _names(p, "--presets", args.presets, PRESETS)
    args.tasks = _names(p, "--tasks", args.tasks, TASKS)
    if min(args.steps, args.prompts, args.threads) < 1 or args.timeout_min <= 0:
        p.error("--steps, --prompts and --threads must be >= 1 and --timeout-min > 0")
    return args


def _names(p: argparse.ArgumentParser, flag: str, text: str, valid) -> List[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        p.error(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return names


def portrl_cmd(*argv: str) -> List[str]:
    """The ``portrl`` command line run by this Python."""
    return [sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main())", *argv]


def run_logged(cmd: List[str], log: Path, timeout_s: float, verbose: bool) -> Optional[str]:
    """Run ``cmd`` with its output in ``log``; None when it succeeded, else its last output line (the reason)."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false")
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log, "w") as fh:
            code = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout_s / 60:.0f} min (--timeout-min)"
    text = log.read_text(errors="replace")
    if verbose:
        print(text[-20000:], file=sys.stderr)
    lines = [x for x in text.splitlines() if x.strip()]
    return None if code == 0 else f"exit code {code}: {lines[-1].strip() if lines else '(no output)'}"


def warm_start(args: argparse.Namespace, task: str) -> Dict[str, object]:
    """The task's shared SFT model in ``OUT/sft/TASK`` (made once): ``{"path", "minutes", "summary"}``."""
    out = Path(args.out) / "sft" / task
    info = out.parent / f"{task}.json"
    if (out / "config.json").is_file() and info.is_file():
        return json.loads(info.read_text())
    t0 = time.perf_counter()
    err = run_logged(portrl_cmd("sft", "--output", str(out), "--on-existing", "move_aside", f"data={task}",
                                "model=tiny", f"trainer.seed={args.seed}", f"device.num_threads={args.threads}"),
                     out.parent / f"{task}.log", args.timeout_min * 60, args.verbose)
    if err is not None:
        raise RuntimeError(f"the SFT warm start of {task} failed ({err}); see {out.parent / f'{task}.log'}")
    lines = (out.parent / f"{task}.log").read_text().splitlines()
    summary = next((x for x in reversed(lines) if x.startswith("SFT: ")), "").split("; model written")[0]
    result = {"path": str(out), "minutes": (time.perf_counter() - t0) / 60, "summary": summary}
    info.write_text(json.dumps(result))
    return result


def train_overrides(args: argparse.Namespace, preset: str, task: str, model: str, run_dir: Path) -> List[str]:
    """The ``portrl train`` overrides of one run: the preset, the shared warm start and the common budget."""
    return [
        f"algorithm={preset}", f"data={task}", "model=tiny", f"model.path={model}", "model.sft_warm_start=false",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.steps}", "trainer.val_before_train=true",
        f"trainer.seed={args.seed}", f"trainer.output_dir={run_dir}", "trainer.save_final=false",
        "trainer.export_hf=false", "trainer.plot=false", "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]", f"device.num_threads={args.threads}",
    ]


def summarize(run_dir: Path, steps: int) -> Dict[str, Optional[float]]:
    """``before`` / ``after`` (first and last ``val/acc/mean``) and the mean training accuracy of the first and last
    five steps, from the run's ``metrics.jsonl``."""
    from portrl.trainer.tracking import read_metrics_up_to

    records = sorted(read_metrics_up_to(run_dir, steps), key=lambda r: int(r.get("step", 0)))
    vals = [r["val/acc/mean"] for r in records if "val/acc/mean" in r]
    train = [r["critic/acc/mean"] for r in records if int(r.get("step", 0)) >= 1 and "critic/acc/mean" in r]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {"before": vals[0] if len(vals) > 1 else None, "after": vals[-1] if len(vals) > 1 else None,
            "train_acc_first": mean(train[:5]), "train_acc_last": mean(train[-5:]),
            "steps_done": float(max((int(r.get("step", 0)) for r in records), default=0))}


def one_run(args: argparse.Namespace, preset: str, task: str, model: str) -> dict:
    """``portrl train`` of one preset on one task, in its own process; its figures, wall minutes and error."""
    run_dir = Path(args.out) / "runs" / f"{task}-{preset}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own folder of an earlier, failed or --fresh, run
    t0 = time.perf_counter()
    err = run_logged(portrl_cmd("train", *train_overrides(args, preset, task, model, run_dir)),
                     run_dir.with_suffix(".log"), args.timeout_min * 60, args.verbose)
    figures = summarize(run_dir, args.steps) if (run_dir / "metrics.jsonl").is_file() else {}
    return {"preset": preset, "task": task, "minutes": (time.perf_counter() - t0) / 60, "error": err,
            **_budget(args), **figures}


def _budget(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "prompts": args.prompts, "seed": args.seed}


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table(runs: List[dict], sft: Dict[str, dict]) -> str:
    """The Markdown table (accuracies in %, delta in points), then one line per task's SFT warm start."""
    lines = ["| preset | task | before % | after % | delta (pts) | minutes |", "|---|---|---:|---:|---:|---:|"]
    for r in runs:
        ok = r.get("before") is not None and r.get("after") is not None
        delta = f"{100 * (r['after'] - r['before']):+.1f}" if ok else "-"
        after = _pct(r.get("after")) if r.get("error") is None else f"failed: {r['error'][:120]}"
        lines.append(f"| {r['preset']} | {r['task']} | {_pct(r.get('before'))} | {after} | {delta} | "
                     f"{r['minutes']:.1f} |")
    if runs:
        b = runs[0]
        lines.append(f"\n{b['steps']} RL steps of {b['prompts']} prompts, trainer.seed {b['seed']}; tiny model, CPU "
                     f"({os.cpu_count()} cores). Each task's runs start from one shared SFT warm start:")
    for task, info in sft.items():
        lines.append(f"- {task}: {info['summary'] or 'SFT'} ({info['minutes']:.1f} min)")
    return "\n".join(lines)


def plot(runs: List[dict], path: Path, steps: int) -> None:
    """One panel per task: bars of the accuracy after the budget per preset (green: above the accuracy before, red:
    not), a black mark at the accuracy before, "failed" where the run failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    width = max(6.0, 1.2 + 0.45 * len({r["preset"] for r in runs}) * len(tasks))
    fig, axes = plt.subplots(1, len(tasks), figsize=(width, 4.6), squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        rs = [r for r in runs if r["task"] == task]
        xs = list(range(len(rs)))
        after = [100 * r["after"] if r.get("error") is None and r.get("after") is not None else 0.0 for r in rs]
        before = [100 * r["before"] if r.get("before") is not None else float("nan") for r in rs]
        ax.bar(xs, after, color=["tab:green" if a > b else "tab:red" for a, b in zip(after, before)], alpha=0.8,
               label=f"after {steps} steps (green: higher)")
        ax.scatter(xs, before, marker="_", s=300, linewidths=2, color="black", zorder=3, label="before")
        for x, r in zip(xs, rs):
            if r.get("error") is not None:
                ax.text(x, 2, "failed", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [r["preset"] for r in rs], rotation=60, ha="right")
        ax.set_title(task)
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy, %")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Validation accuracy before and after {steps} RL steps\n"
                 "(tiny model, CPU; one SFT warm start per task)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    runs: List[dict] = json.loads(results.read_text())["runs"] if results.is_file() and not args.fresh else []
    runs = [r for r in runs if all(r.get(k) == v for k, v in _budget(args).items())]
    sft: Dict[str, dict] = {}
    for task in args.tasks:
        sft[task] = warm_start(args, task)
        print(f"{task}: warm start {sft[task]['path']} ({sft[task]['summary']}, {sft[task]['minutes']:.1f} min)",
              flush=True)
        for preset in args.presets:
            if any(r["preset"] == preset and r["task"] == task and r.get("error") is None for r in runs):
                continue
            r = one_run(args, preset, task, str(sft[task]["path"]))
            runs = [x for x in runs if (x["preset"], x["task"]) != (preset, task)] + [r]
            print(f"{preset} on {task}: {_pct(r.get('before'))} -> {_pct(r.get('after'))} % in {r['minutes']:.1f} min"
                  + (f" ({r['error']})" if r["error"] else ""), flush=True)
            results.write_text(json.dumps({"runs": runs}, indent=1))
    order = {(t, p): i for i, (t, p) in enumerate((t, p) for t in args.tasks for p in args.presets)}
    shown = sorted((r for r in runs if (r["task"], r["preset"]) in order),
                   key=lambda r: order[(r["task"], r["preset"])])
    (out / "learning_table.md").write_text(table(shown, sft) + "\n")
    plot(shown, out / "learning_table.png", args.steps)
    print("\n" + table(shown, sft))
    print(f"\nwritten: {out / 'learning_table.md'}, {out / 'learning_table.png'}, {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
