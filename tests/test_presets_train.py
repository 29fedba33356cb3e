"""Every algorithm preset trains the tiny setup for 20 steps: finite metrics, and a training reward that rises.

Setup (module fixture). The tiny Qwen2 model is SFT-warm-started on arith (an SFT_SCHEDULE-step
schedule: lr 3e-3, 64 examples a step, 2000 rows) until the mean probability of the right answer on
the training prompts reaches SFT_TARGET (checked every SFT_CHECK_EVERY steps; about 900 steps), which
leaves it solving about 60% of them: room to rise, and enough right answers that most groups carry a
signal. It stops on that accuracy, not on a step count, because where this SFT gets to after a given
number of steps moves with floating-point details (see configs/model/tiny.yaml).

Each preset in ``configs/algorithm`` then runs STEPS RL steps on a fixed set of TRAIN_PROMPTS training
prompts (about SEQS_PER_STEP sequences a step, so every prompt comes back
about 4 times), with every hyperparameter of the preset kept except these tiny-setup overrides:

* ``actor.optim.lr`` LR (``critic.optim.lr`` 1e-3): 2e-4, constant (the tiny preset's peak rate, which
  the default run decays by a cosine; model.path given, the tiny preset does not apply here); 5e-4
  collapses GRPO, REMAX, GPG, RLOO and SPPO from a 42% start (probe reward -0.16 to -0.25 in 20 steps);
* ``rollout.n`` capped at MAX_N (DAPO, GSPO, SAPO and VAPO use 16) and ``data.train_batch_size`` =
  SEQS_PER_STEP // n prompts, one optimizer step per RL step, to bound CPU time.

Measurement, with common random numbers: the mean reward of PROBE_SAMPLES samples (temperature 1,
one fixed sampling seed) on each training prompt, before step 1 and after step STEPS. The same
prompts and the same seed before and after, so the difference is the policy's change, not sampling
noise. The batch reward of the steps themselves is printed too, but not asserted on (DAPO's dynamic
sampling keeps only mixed-reward groups, so its batch reward says little about the policy).

Measured by this test (one thread, trainer.seed 0; 2026-11-30, warm start stopped at 900 steps), probe
reward 0.607 before: dapo +0.061, dr_grpo +0.068, gpg +0.057, grpo +0.066, gspo +0.061, online_dpo
+0.059, ppo +0.056, reinforce_pp +0.094, remax +0.050, rloo +0.054, sapo +0.061, sppo +0.055 (VAPO
-0.185, below); the day before, with other float rounding in the update (no replayed forward, per-sequence
attention), the same presets gained +0.048 to +0.094. Run-to-run noise, measured on the
same setup from a warm start at 0.598 with trainer.seed 0 and 1: each preset's gain differed by
0.000-0.019 between the seeds (gains +0.055 to +0.099). MIN_GAIN (0.03) sits well above that noise and
below the smallest gain (0.048-0.050).
(GSPO and SAPO give the same numbers: with one optimizer step per batch the ratio is exactly 1, where
both losses have the gradient of -A·logp, and the same n.)

VAPO does not rise here, by construction: its length-adaptive actor λ = 1 - 1/(0.05·l) is clamped to
0 for responses of l <= 20 tokens, and arith answers are 2-4 tokens, so its advantages are pure
one-step TD errors of a value model that starts from scratch (a fresh head on the policy). That
critic would have to judge whether the answer's digits are right; in 20 steps it cannot, and the
actor follows its noise: probe reward 0.598 -> 0.502 (seed 0; critic warm-up 2 steps, the preset's
10%), 0.403 (seed 1), 0.499 with 10 warm-up steps, 0.426 after 40 steps with 20 warm-up steps; in this
test 0.607 -> 0.423. With algorithm.vapo_alpha=100 (λ ~ 1, everything else VAPO's) it rises like
PPO: 0.598 -> 0.679. VAPO is held to the finite-metrics check and to VAPO_FLOOR, and the test fails
if it ever starts to rise (then it belongs with the others).
"""

from __future__ import annotations

import math

import pytest

from portrl.config import compose, list_presets

pytestmark = pytest.mark.slow

STEPS = 20
SEQS_PER_STEP = 64
MAX_N = 8
TRAIN_PROMPTS = 64
PROBE_SAMPLES = 16
PROBE_SEED = 4242
LR = 2e-4
MIN_GAIN = 0.03
VAPO_FLOOR = 0.25  # VAPO measured 0.502 (seed 0) and 0.403 (seed 1) after 20 steps: it drifts, it does not collapse
SFT_SCHEDULE = 1500  # the SFT's schedule (the default run's); it stops once SFT_TARGET is reached
SFT_TARGET = 0.55  # mean probability of the right answer on the training prompts
SFT_CHECK_EVERY = 50
SFT_LR = 3e-3
SFT_ROWS = 2000
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384, "seed": 0}
# presets that cannot raise the reward in 20 steps of this setup, and why (see the module docstring)
CANNOT_RISE = {
    "vapo": "length-adaptive λ is 0 for 2-4 token answers: advantages are TD errors of a 20-step-old critic",
}


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    """(SFT model dir, training-prompt parquet): the tiny model part-way through the default SFT."""
    import torch

    from portrl.data import make_arith_rows, make_arith_sft_rows, write_split
    from portrl.models import load_causal_lm, load_tokenizer, write_tiny_model
    from portrl.workers.sft import PROBE_ROWS, run_sft

    root = tmp_path_factory.mktemp("presets_train")
    train = root / "train.parquet"
    write_split(make_arith_rows(SFT_ROWS, seed=0, difficulty=1, split="train")[:TRAIN_PROMPTS], train)
    base = write_tiny_model(root / "base", vocab="arith", **TINY)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = load_causal_lm(str(base)), load_tokenizer(str(base))
    train_rows = make_arith_sft_rows(SFT_ROWS, seed=0, difficulty=1, split="train")
    assert PROBE_ROWS == TRAIN_PROMPTS  # run_sft's target check scores exactly the RL training prompts
    sft = run_sft(None, model, tok, train_rows, steps=SFT_SCHEDULE, lr=SFT_LR, batch_size=64, seed=0,
                  target_answer_p=SFT_TARGET, check_every=SFT_CHECK_EVERY)
    print(f"SFT warm start: P(answer) on the training prompts {sft.get('sft/answer_p', 0):.3f} after "
          f"{sft['sft/steps']:.0f} steps")
    out = root / "sft"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, train


def _config(name: str, model_dir, train, out_dir):
    n = min(int(compose(algorithm=name, check=False).rollout.n), MAX_N)
    prompts = SEQS_PER_STEP // n
    overrides = [
        f"model.path={model_dir}", "model.sft_warm_start=false", f"actor.optim.lr={LR}", "critic.optim.lr=1e-3",
        f"data.train_files={train}", f"data.val_files={train}", f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}", f"actor.ppo_micro_batch_size_per_device={prompts * n}",
        f"rollout.n={n}", f"trainer.total_steps={STEPS}", "trainer.test_freq=0", "trainer.val_before_train=true",
        "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false", "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false", "trainer.resume=off", f"trainer.output_dir={out_dir}",
        "device.name=cpu", "device.num_threads=1",
    ]
    return compose(algorithm=name, overrides=overrides)


def _probe_reward(trainer) -> float:
    """Mean reward of PROBE_SAMPLES samples per training prompt, always drawn with PROBE_SEED."""
    sampling = {"n": PROBE_SAMPLES, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "max_new_tokens": int(trainer.cfg.data.max_response_length), "seed": PROBE_SEED}
    batch = trainer.gen.call("generate_from", trainer.val_prompts, sampling)
    return float(trainer.reward.compute_reward(batch).tensors["seq_scores"].mean())


@pytest.mark.parametrize("name", list_presets("algorithm"))
def test_preset_trains_tiny_setup(name, sft_setup, tmp_path):
    from portrl.trainer.rl_trainer import RLTrainer

    model_dir, train = sft_setup
    trainer = RLTrainer(_config(name, model_dir, train, tmp_path / name))
    assert len(trainer.val_prompts) == TRAIN_PROMPTS
    before = _probe_reward(trainer)
    summary = trainer.fit()
    after = _probe_reward(trainer)
    assert summary["steps"] == STEPS
    for step, metrics in enumerate(trainer.history, start=1):
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{name}: non-finite metrics at step {step}: {bad}"
    scores = [m["critic/score/mean"] for m in trainer.history if "critic/score/mean" in m]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    report = (f"{name}: training reward (probe, {PROBE_SAMPLES} samples x {TRAIN_PROMPTS} prompts, same seed) "
              f"{before:.3f} -> {after:.3f} ({after - before:+.3f}); batch reward first 5 steps {first:.3f}, "
              f"last 5 {last:.3f}")
    print(report)
    assert 0.3 < before < 0.9, f"{name}: the warm start is not the expected mid-accuracy model: {report}"
    if name in CANNOT_RISE:
        assert after > VAPO_FLOOR, f"{name}: the policy collapsed: {report}"
        assert after - before < MIN_GAIN, f"{name} now rises; remove it from CANNOT_RISE: {report}"
        pytest.xfail(f"{name} cannot rise in {STEPS} steps here ({CANNOT_RISE[name]}): {report}")
    assert after - before >= MIN_GAIN, f"{name}: the training reward did not rise by {MIN_GAIN}: {report}"
