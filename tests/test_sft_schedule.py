"""run_sft(schedule_steps=): the first ``steps`` steps of a longer SFT, learning rates and all."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from portrl.models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("sft_schedule") / "m", vocab="arith", hidden_size=32,
                            num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)


def _run(path, steps, schedule_steps, monkeypatch, stop=None, cfg=None, **kw):
    import portrl.workers.sft as sft
    from portrl.data import make_arith_sft_rows
    from portrl.models import load_causal_lm, load_tokenizer

    lrs, out = [], {}
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    torch.manual_seed(0)
    model, tok = load_causal_lm(str(path)), load_tokenizer(str(path))
    with monkeypatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", step)
        out.update(sft.run_sft(cfg, model, tok, make_arith_sft_rows(32, seed=0), steps=steps, lr=1e-2, batch_size=4,
                               seed=0, schedule_steps=schedule_steps, stop=stop, **kw))
    _run.result = out
    return lrs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_schedule_steps_stops_part_way(tiny, monkeypatch):
    torch.set_num_threads(1)
    full_lrs, _ = _run(tiny, 40, None, monkeypatch)
    part_lrs, part = _run(tiny, 10, 40, monkeypatch)
    short_lrs, short = _run(tiny, 10, None, monkeypatch)
    assert part_lrs == pytest.approx(full_lrs[:10], rel=1e-12)
    assert short_lrs != pytest.approx(part_lrs)  # a 10-step schedule warms up and decays over 10 steps
    assert any(not torch.equal(part[k], short[k]) for k in part)


def test_schedule_steps_below_steps_is_an_error(tiny):
    from portrl.data import make_arith_sft_rows
    from portrl.models import load_causal_lm, load_tokenizer
    from portrl.workers.sft import run_sft

    model, tok = load_causal_lm(str(tiny)), load_tokenizer(str(tiny))
    with pytest.raises(ValueError, match="schedule_steps"):
        run_sft(None, model, tok, make_arith_sft_rows(8, seed=0), steps=5, lr=1e-2, batch_size=4, schedule_steps=4)


def test_stop_ends_the_sft_where_it_says(tiny, monkeypatch):
    torch.set_num_threads(1)
    full_lrs, _ = _run(tiny, 20, None, monkeypatch)
    asked = []

    def stop(step):
        asked.append(step)
        return step == 6

    lrs, _ = _run(tiny, 20, None, monkeypatch, stop=stop)
    assert asked == [1, 2, 3, 4, 5, 6]
    assert lrs == pytest.approx(full_lrs[:6], rel=1e-12)


def test_target_answer_p_stops_once_reached(tiny, monkeypatch):
    """model.sft_target_answer_p: checked every check_every steps; the schedule stays the full one's."""
    from portrl.config import compose

    torch.set_num_threads(1)
    full_lrs, _ = _run(tiny, 60, None, monkeypatch)
    assert "sft/answer_p" not in _run.result and _run.result["sft/steps"] == 60
    _run(tiny, 60, None, monkeypatch, target_answer_p=0.999999, check_every=10)  # never reached: every step
    assert "sft/answer_p" not in _run.result and _run.result["sft/steps"] == 60
    # P(answer) of this 0.04M-parameter model on its 32 rows: 0.0009 at step 10, 0.003 at 20 (lr 1e-2)
    lrs, _ = _run(tiny, 60, None, monkeypatch, target_answer_p=1e-3, check_every=10)
    res = dict(_run.result)
    assert res["sft/steps"] == 20 and res["sft/answer_p"] >= 1e-3
    assert lrs == pytest.approx(full_lrs[:20], rel=1e-12)
    # the default comes from the config (the trainer's warm start passes only cfg)
    cfg = compose(overrides=["model.sft_target_answer_p=1e-3", "device.name=cpu"])
    _run(tiny, 60, None, monkeypatch, cfg=cfg, check_every=10)
    assert _run.result["sft/steps"] == 20 and _run.result["sft/answer_p"] == pytest.approx(res["sft/answer_p"])
    with pytest.raises(ValueError, match="check_every"):
        _run(tiny, 60, None, monkeypatch, target_answer_p=0.5, check_every=0)
