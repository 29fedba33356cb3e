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
  SEQS_PER_STEP // n prompts, one optimizer step per RL step, to bound CPU time;
* VAPO: value pretraining of VAPO_PRETRAIN steps instead of the paper's 50, and the paper's critic
  learning rate of twice the actor's (2e-6 against 1e-6), so 4e-4 (below);
* PRIME: the implicit PRM's learning rate PRM_LR. verl's 1e-6 does not move the tiny PRM, whose batch-normalised
  token rewards are then noise: probe reward 0.607 -> 0.536 in 20 steps; 1e-3 (the tiny model preset's) +0.030,
  1e-3 with beta_train 0.5 +0.013, 1e-2 +0.056.

Measurement, with common random numbers: the mean reward of PROBE_SAMPLES samples (temperature 1,
one fixed sampling seed) on each training prompt, before step 1 and after step STEPS. The same
prompts and the same seed before and after, so the difference is the policy's change, not sampling
noise. The batch reward of the steps themselves is printed too, but not asserted on (DAPO's dynamic
sampling keeps only mixed-reward groups, so its batch reward says little about the policy).

Measured by this test (one thread, trainer.seed 0; 2026-11-30, warm start stopped at 900 steps), probe
reward 0.607 before: dapo +0.061, dr_grpo +0.068, gpg +0.057, grpo +0.066, gspo +0.061, online_dpo
+0.059, reinforce_pp +0.094, remax +0.050, rloo +0.054, sapo +0.061, spin +0.055 (2026-12-01), sppo +0.055;
ppo +0.087 and vapo +0.082 since the value head starts at zero and VAPO pretrains its critic (below). Run-to-run noise:
the same presets, from a warm start at 0.598 with trainer.seed 0 and 1, differed by 0.000-0.019
between the seeds (gains +0.055 to +0.099); PPO +0.087 / +0.094 / +0.065 and VAPO +0.082 / +0.080 /
+0.042 with trainer.seed 0 / 1 / 2. MIN_GAIN (0.03) sits below the smallest of these gains.
(GSPO and SAPO give the same numbers: with one optimizer step per batch the ratio is exactly 1, where
both losses have the gradient of -A·logp, and the same n.)

Why VAPO needs its value pretraining here. Its length-adaptive actor λ = 1 - 1/(0.05·l) is 0 for
responses of l <= 20 tokens, and arith answers are 2-4 tokens, so its advantages are one-step TD errors
of the value model: the digits' credit is V(after the digit) - V(before it), which only a critic that
judges the answer can give. With the paper's 50 pretraining steps (or the earlier 10% in-run warm-up)
the tiny critic explains none of the returns' variance, and VAPO falls: probe reward 0.607 -> 0.423
(seed 0, random value head), 0.534 / 0.510 (seeds 0 / 1, zero value head). The critic learns slowly:
the mean explained variance over all tokens reaches 0.21 after 400 pretraining steps, 0.37 after 800 and
about 0.45 after 2000 (0.85 on the last token, whose value decides whether the answer is right). VAPO's
gain follows it: after 1000 steps -0.005 to +0.053 over seeds and critic rates (3e-4, 4e-4, 1e-3), after
2000 steps at 4e-4 +0.082 / +0.080 / +0.042. Pretraining 2000 steps takes about 110 s on one thread.
"""

from __future__ import annotations

import math

import pytest

from portrl.config import compose, list_presets

from _shared import built_once

pytestmark = pytest.mark.slow

STEPS = 20
SEQS_PER_STEP = 64
MAX_N = 8
TRAIN_PROMPTS = 64
PROBE_SAMPLES = 16
PROBE_SEED = 4242
LR = 2e-4
MIN_GAIN = 0.03
VAPO_PRETRAIN = 2000  # value pretraining steps (module docstring)
PRM_LR = 1e-2  # PRIME's implicit PRM learning rate (module docstring)
SFT_SCHEDULE = 1500  # the SFT's schedule (the default run's); it stops once SFT_TARGET is reached
SFT_TARGET = 0.55  # mean probability of the right answer on the training prompts
SFT_CHECK_EVERY = 50
SFT_LR = 3e-3
SFT_ROWS = 2000
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384, "seed": 0}


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    """(SFT model dir, training-prompt parquet): the tiny model part-way through the default SFT. Built once per
    test session, however many xdist workers run these tests (tests/_shared.py); read-only."""
    import torch

    torch.set_num_threads(1)
    root = built_once(tmp_path_factory, "presets_train", _warm_start)
    return root / "sft", root / "train.parquet"


def _warm_start(root):
    """Write the training prompts and the SFT-warm-started tiny model into ``root``."""
    import torch

    from portrl.data import make_arith_rows, make_arith_sft_rows, write_split
    from portrl.models import load_causal_lm, load_tokenizer, write_tiny_model
    from portrl.workers.sft import PROBE_ROWS, run_sft

    write_split(make_arith_rows(SFT_ROWS, seed=0, difficulty=1, split="train")[:TRAIN_PROMPTS], root / "train.parquet")
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
    model.save_pretrained(root / "sft")
    tok.save_pretrained(root / "sft")


def _config(name: str, model_dir, train, out_dir):
    n = min(int(compose(algorithm=name, check=False).rollout.n), MAX_N)
    prompts = SEQS_PER_STEP // n
    critic_lr = 2 * LR if name == "vapo" else 1e-3
    overrides = [
        f"model.path={model_dir}", "model.sft_warm_start=false", f"actor.optim.lr={LR}", f"critic.optim.lr={critic_lr}",
        f"reward_model.model.optim.lr={PRM_LR}",
        f"data.train_files={train}", f"data.val_files={train}", f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}", f"actor.ppo_micro_batch_size_per_device={prompts * n}",
        f"rollout.n={n}", f"trainer.total_steps={STEPS}", "trainer.test_freq=0", "trainer.val_before_train=true",
        "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false", "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false", "trainer.resume=off", f"trainer.output_dir={out_dir}",
        "device.name=cpu", "device.num_threads=1",
    ]
    if name == "vapo":
        overrides.append(f"critic.pretrain_steps={VAPO_PRETRAIN}")
    return compose(algorithm=name, overrides=overrides)


def _probe_reward(trainer) -> float:
    """Mean reward of PROBE_SAMPLES samples per training prompt, always drawn with PROBE_SEED."""
    sampling = {"n": PROBE_SAMPLES, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "max_new_tokens": int(trainer.cfg.data.max_response_length), "seed": PROBE_SEED}
    batch = trainer.gen.concat("generate_from", trainer.val_prompts, sampling)
    return float(trainer.reward.compute_reward(batch).tensors["seq_scores"].mean())


# Slow: 20 RL steps of 64 sequences each, 30-50 s a preset on 2 shared cores; VAPO several minutes (its 2000 value
# pretraining steps, module docstring); the first test also waits for the SFT warm start (~3.5 min, sft_setup).
@pytest.mark.parametrize("name", list_presets("algorithm"))
def test_preset_trains_tiny_setup(name, sft_setup, tmp_path):
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    model_dir, train = sft_setup
    trainer = RLTrainer(settle_config(_config(name, model_dir, train, tmp_path / name)))
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
    if "critic/pretrain_ev" in summary:
        report += (f"; value pretraining {summary['critic/pretrain_steps']:.0f} steps, explained variance "
                   f"{summary['critic/pretrain_ev']:.3f}")
    print(report)
    assert 0.3 < before < 0.9, f"{name}: the warm start is not the expected mid-accuracy model: {report}"
    assert after - before >= MIN_GAIN, f"{name}: the training reward did not rise by {MIN_GAIN}: {report}"
