"""Σπ² (``sum_pi_squared``) of every response token from the old-log-prob pass, and the two optimal-token-baseline
estimators that read it training through ``portrl train`` (portrl/models/logprobs.py, portrl/workers/actor.py)."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from portrl.cli import main
from portrl.config.options_schema import default_config
from portrl.models import compute_logprobs, load_causal_lm, write_tiny_model
from portrl.models.logprobs import sum_pi_squared
from portrl.workers.actor import old_log_probs_needed

# tests/test_cli_commands.py SMALL: the tiny model and batch shape
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "trainer.progress_bar=false", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
         "model.sft_warm_start=false", "trainer.export_hf=false", "trainer.plot=false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.3)
    return load_causal_lm(str(path))


def _batch(vocab: int):
    """Left-padded prompts (P=4) + right-padded responses (T=5), rows of different lengths."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :2] = 0  # a shorter prompt
    mask[2, 7:] = 0  # a shorter response
    mask[0, 0] = 0
    return ids * mask, mask


def _float64_reference(model, ids, mask, temperature):
    """Σ_v π(v)² from the full logits of a padded forward, in float64."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double() / temperature
    probs = torch.softmax(logits[:, 3:8], dim=-1)  # columns P-1 .. P+T-2 score the response tokens
    return (probs ** 2).sum(-1) * mask[:, 4:].double()


@pytest.mark.parametrize("packed, chunk", [(True, None), (True, 3), (False, 2)])
def test_sum_pi_squared_equals_a_float64_softmax(tiny, packed, chunk):
    ids, mask = _batch(tiny.config.vocab_size)
    want = _float64_reference(tiny, ids, mask, 0.7)
    with torch.no_grad():
        logp, ent, spi = compute_logprobs(tiny, ids, mask, 5, temperature=0.7, packed=packed, chunk_size=chunk,
                                          with_sum_pi_squared=True)
        plain = compute_logprobs(tiny, ids, mask, 5, temperature=0.7, packed=packed, chunk_size=chunk)
    assert spi.shape == (3, 5) and spi.dtype == torch.float32
    torch.testing.assert_close(spi.double(), want, rtol=2e-6, atol=1e-7)
    assert bool((spi[mask[:, 4:].bool()] > 0).all()) and float(spi[2, 3:].abs().sum()) == 0.0  # 0 at padding
    assert len(plain) == 2 and torch.equal(plain[0], logp) and ent is None  # the normal path is unchanged
    # peaky and flat rows: stable for any logit scale (Σπ² of a uniform distribution over V is 1/V)
    h = torch.tensor([[0.0, 0.0], [400.0, -400.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [-1.0, 0.0]])
    torch.testing.assert_close(sum_pi_squared(h, w, 1.0, None, 1), torch.tensor([0.25, 1.0]))


def test_the_estimators_force_the_old_log_prob_pass():
    cfg = default_config()
    OmegaConf.update(cfg, "algorithm.adv_estimator", "grpo")
    assert not old_log_probs_needed(cfg, 8)  # on-policy GRPO: no extra forward
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        OmegaConf.update(cfg, "algorithm.adv_estimator", name)
        assert old_log_probs_needed(cfg, 8)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baselines_train_two_steps(estimator, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--log-level", "WARNING", "train", *SMALL, f"algorithm.adv_estimator={estimator}",
            "actor.entropy_coeff=0.01", f"trainer.output_dir={out}"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "timing_s/old_log_prob" in r  # Σπ² came from the old-log-prob pass
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert r["actor/grad_norm"] > 0
