"""portrl.models.forward_tape: replaying the rollout's recorded matmuls gives the training forward's log-probs,
entropies and gradients; a changed weight or an unrecorded row falls back to the ordinary forward."""

import pytest
import torch

import portrl.models.forward_tape as forward_tape
from portrl.models import compute_logprobs, load_causal_lm, write_tiny_model
from portrl.rollout import SamplingParams, make_engine
from portrl.workers.batch import build_rollout_batch

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]  # unequal lengths: the prefill is left-padded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", initializer_range=0.3, seed=0)


def _rollout(model, n=3, max_new=9, seed=4):
    engine = make_engine("hf", model=model, backend="cpu")
    assert engine.can_record_forward() and engine.shares_module(model)
    engine.start_recording()
    out = engine.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=max_new, seed=seed, stop_token_ids=(20, 21, 22)))
    tape = engine.stop_recording()
    assert tape is not None
    batch = build_rollout_batch(PROMPTS, out.response_ids, pad_token_id=0, n=n)
    return tape, batch, out


def _logprobs_and_grads(model, batch, rows=None, tape=None):
    model.zero_grad(set_to_none=True)
    t = batch.tensors
    ids, mask = t["input_ids"], t["attention_mask"]
    if rows is not None:
        ids, mask = ids[rows], mask[rows]
    logp, ent = compute_logprobs(model, ids, mask, t["responses"].shape[1], temperature=0.9, with_entropy=True,
                                 tape=tape)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    for name, g in a[2].items():
        torch.testing.assert_close(g, b[2][name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("rows", [None, [7, 0, 4, 2, 8]], ids=["whole-batch", "shuffled-subset"])
def test_replay_equals_fresh_forward(tiny, monkeypatch, rows):
    model = load_causal_lm(tiny, backend="cpu")
    tape, batch, out = _rollout(model)
    assert len(set(map(len, out.response_ids))) > 1  # early stops: the decode batch was compacted
    replays = []
    real = forward_tape.replay_hidden_states
    monkeypatch.setattr(forward_tape, "replay_hidden_states", lambda *a: replays.append(1) or real(*a))
    model.train()
    fresh = _logprobs_and_grads(model, batch, rows)
    assert tape.usable(model.model)
    replayed = _logprobs_and_grads(model, batch, rows, tape=tape)
    assert replays == [1]
    _assert_same(replayed, fresh)
    # the replayed log-probs are the rollout's own (same weights, same tokens)
    resp_mask = batch.tensors["response_mask"].bool()
    if rows is None:
        rollout_lp = torch.zeros_like(resp_mask, dtype=torch.float32)
        for r, lps in enumerate(out.logprobs):
            rollout_lp[r, :len(lps)] = torch.tensor(lps)
        replayed_t1 = compute_logprobs(model, batch.tensors["input_ids"], batch.tensors["attention_mask"],
                                       resp_mask.shape[1], tape=tape)[0]
        torch.testing.assert_close(replayed_t1.detach()[resp_mask], rollout_lp[resp_mask], atol=1e-4, rtol=1e-4)


def test_replay_runs_the_recording_engines_swiglu_without_detecting_the_backend(tiny, monkeypatch):
    """The replay's SiLU MLPs take the decoder's swiglu kernel from the tape: selecting one there with no backend
    re-detected the backend (package metadata of every vendor) at every update step."""
    import portrl.device.registry as device_registry
    from portrl.ops import select

    model = load_causal_lm(tiny, backend="cpu")
    tape, batch, _ = _rollout(model)
    assert tape.swiglu is select("swiglu", backend="cpu")[1]
    calls = []
    monkeypatch.setattr(tape, "swiglu", lambda gate, up: calls.append(1) or torch.nn.functional.silu(gate) * up)
    monkeypatch.setattr(device_registry, "detect", lambda: pytest.fail("the replay detected the backend"))
    model.train()
    _logprobs_and_grads(model, batch, tape=tape)
    assert len(calls) == len(model.model.layers)


def test_replay_runs_the_recording_backends_rms_norm_for_every_norm(tiny, monkeypatch):
    """Each layer's two norms and the final one go through the tape's rms_norm op (the CPU's fused kernel)."""
    from portrl import ops

    model = load_causal_lm(tiny, backend="cpu")
    tape, batch, _ = _rollout(model)
    assert tape.rms_norm is ops.select("rms_norm", backend="cpu")[1]
    calls = []
    monkeypatch.setattr(tape, "rms_norm", lambda x, w, eps: calls.append(eps) or ops.rms_norm(x, w, eps))
    model.train()
    _logprobs_and_grads(model, batch, tape=tape)
    assert calls == [model.config.rms_norm_eps] * (2 * len(model.model.layers) + 1)



def test_replay_rotates_q_and_k_through_the_recording_backends_rotary(tiny, monkeypatch):
    """Each layer's q and k go through the tape's rotary op (the CPU's fused kernel), with the same gradients as the
    native formula: the replay then equals the fresh forward (test_replay_equals_fresh_forward) through it."""
    from portrl import ops

    model = load_causal_lm(tiny, backend="cpu")
    tape, batch, _ = _rollout(model)
    assert tape.rotary is ops.select("rotary", backend="cpu")[1]
    model.train()
    fused = _logprobs_and_grads(model, batch, tape=tape)
    calls = []
    monkeypatch.setattr(tape, "rotary", lambda x, cos, sin: calls.append(x.shape[1]) or ops.apply_rotary(x, cos, sin))
    _assert_same(_logprobs_and_grads(model, batch, tape=tape), fused)
    heads = (model.config.num_attention_heads, model.config.num_key_value_heads)
    assert calls == [*heads] * len(model.model.layers)

def test_changed_weights_or_unknown_rows_fall_back(tiny, monkeypatch):
    model = load_causal_lm(tiny, backend="cpu")
    tape, batch, _ = _rollout(model)
    replays = []
    real = forward_tape.replay_hidden_states
    monkeypatch.setattr(forward_tape, "replay_hidden_states", lambda *a: replays.append(1) or real(*a))
    other = batch.tensors["input_ids"].clone()
    last = batch.tensors["attention_mask"].sum(1) - 1
    other[0, last[0]] = (other[0, last[0]] + 1) % 60 + 3  # a response the rollout did not sample
    assert tape.positions(other, batch.tensors["attention_mask"], batch.tensors["responses"].shape[1]) is None
    assert not tape.usable(load_causal_lm(tiny, backend="cpu").model)  # another module with equal weights
    with torch.no_grad():  # what an optimizer step does
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    assert not tape.usable(model.model)
    model.train()
    _assert_same(_logprobs_and_grads(model, batch, tape=tape), _logprobs_and_grads(model, batch))
    assert replays == []


def test_engine_records_only_when_asked(tiny):
    model = load_causal_lm(tiny, backend="cpu")
    engine = make_engine("hf", model=model, backend="cpu")
    params = SamplingParams(n=2, max_new_tokens=5, seed=1)
    plain = engine.generate(PROMPTS, params)
    assert engine.stop_recording() is None
    engine.start_recording()
    recorded = engine.generate(PROMPTS, params)
    assert engine.stop_recording() is not None
    assert recorded.response_ids == plain.response_ids  # recording changes nothing in the sampling


def test_replay_under_gradient_checkpointing_equals_fresh_forward_and_runs_no_layer_matmul(tiny, monkeypatch):
    """Under the model's gradient checkpointing the replay recomputes each layer in backward from the tape: same
    log-probs, entropies and gradients as the checkpointed fresh forward, and no matmul of a layer's weights runs
    in either pass (only the backward's products, whose shapes differ)."""
    model = load_causal_lm(tiny, backend="cpu", gradient_checkpointing=True)
    tape, batch, _ = _rollout(model)
    model.train()
    fresh = _logprobs_and_grads(model, batch)
    recomputes = []
    real = forward_tape._replay_layer
    monkeypatch.setattr(forward_tape, "_replay_layer", lambda *a: recomputes.append(torch.is_grad_enabled()) or real(*a))
    layer_weights = {id(p) for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    forward_products = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: forward_products.append(id(w) in layer_weights) or linear(x, w, b))
    _logprobs_and_grads(model, batch)
    assert any(forward_products) and not recomputes  # the fresh forward runs the layer linears
    forward_products.clear()
    replayed = _logprobs_and_grads(model, batch, tape=tape)
    _assert_same(replayed, fresh)
    layers = len(model.model.layers)
    # the forward took each layer's output from the tape (x + o + down); only the recompute in backward ran the layer
    assert recomputes == [True] * layers
    assert not any(forward_products)  # no layer linear ran: the tape gave every output


@pytest.mark.parametrize("case", ["untied-head", "frozen-embedding"])
def test_checkpointed_replay_without_a_tied_or_trainable_embedding(tmp_path, case):
    """The sparse embedding gradient is only for a weight the head shares (an untied embedding gets the dense one),
    and a frozen embedding (the first layer's input needs no grad) still gives every layer its gradients."""
    path = write_tiny_model(tmp_path / "m", initializer_range=0.3, seed=0, tie_word_embeddings=case != "untied-head")
    model = load_causal_lm(path, backend="cpu", gradient_checkpointing=True)
    if case == "frozen-embedding":
        model.model.embed_tokens.weight.requires_grad_(False)  # tied: the head is frozen too
    tape, batch, _ = _rollout(model)
    assert tape.tied_embedding == (case != "untied-head")
    model.train()
    fresh = _logprobs_and_grads(model, batch)
    replayed = _logprobs_and_grads(model, batch, tape=tape)
    _assert_same(replayed, fresh)
    assert all(g.layout == torch.strided for g in replayed[2].values())


def test_engine_skips_a_recording_over_its_byte_budget(tiny):
    model = load_causal_lm(tiny, backend="cpu")
    engine = make_engine("hf", model=model, backend="cpu")
    params = SamplingParams(n=2, max_new_tokens=5, seed=1)
    need = forward_tape.tape_nbytes(model, len(PROMPTS), max(map(len, PROMPTS)), 2, 4)
    engine.start_recording(max_bytes=need)
    tape = engine.generate(PROMPTS, params) and engine.stop_recording()
    assert tape is not None and sum(b.numel() * b.element_size() for layer in tape.buffers for b in layer) == need
    engine.start_recording(max_bytes=need - 1)
    engine.generate(PROMPTS, params)
    assert engine.stop_recording() is None
    assert engine._fast._last_tape is None  # the earlier recording's buffers were let go, not kept for reuse


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_final_replay_frees_each_layer_after_its_last_read(tiny, checkpointing):
    """free_after_replay: the same log-probs and gradients, each layer's buffers freed once backward no longer
    needs them (under checkpointing: not before its recompute in backward); the tape is then unusable, and the
    next recording allocates new buffers instead of reusing freed ones."""
    model = load_causal_lm(tiny, backend="cpu", gradient_checkpointing=checkpointing)
    tape, batch, _ = _rollout(model)
    model.train()
    fresh = _logprobs_and_grads(model, batch)
    layers = len(model.model.layers)
    freed_at_backward_start = []  # counted when the final norm's gradient arrives, before any layer's backward
    model.model.norm.weight.register_hook(lambda g: freed_at_backward_start.append(sum(b is None for b in tape.buffers)))
    tape.free_after_replay = True
    replayed = _logprobs_and_grads(model, batch, tape=tape)
    _assert_same(replayed, fresh)
    # without checkpointing the forward was each layer's last read; with it, backward still recomputes them all
    assert freed_at_backward_start == [0 if checkpointing else layers]
    assert all(b is None for b in tape.buffers) and not tape.usable(model.model)
    engine = make_engine("hf", model=model, backend="cpu")
    engine._fast._last_tape = tape  # as the decoder keeps its last tape to lend its buffers
    engine.start_recording()
    engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=9, seed=4, stop_token_ids=(20, 21, 22)))
    again = engine.stop_recording()
    assert again is not None and all(b is not None for b in again.buffers)
