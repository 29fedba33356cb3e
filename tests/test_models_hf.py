"""Local loading, portrl attention inside transformers (Qwen2 and Llama), packed compute_logprobs."""

import pytest
import torch

from portrl.models import compute_logprobs, load_causal_lm, load_tokenizer, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # a larger init than the default makes outputs input-sensitive, so a masking mistake shows
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", initializer_range=0.3, seed=0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from portrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, initializer_range=0.3,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("m") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _batch(seed=0, B=4, P=7, T=6):
    """Left-padded prompts + right-padded responses of varying lengths (verl layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    for b, (lp, lr) in enumerate([(0, 0), (3, 2), (1, 5), (6, 1)][:B]):
        mask[b, :lp] = 0
        mask[b, P + T - lr:] = 0
    return ids.masked_fill(mask == 0, 0), mask, T


def _reference_rows(model, ids, mask, T):
    """Each row alone, unpadded, full logits: the obvious computation."""
    P = ids.shape[1] - T
    out = torch.zeros(ids.shape[0], T)
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        x = ids[b][keep]
        logp = torch.log_softmax(model(x[None]).logits[0].float(), -1)
        start = int(keep[:P].sum())
        for t in range(int(mask[b, P:].sum())):
            out[b, t] = logp[start + t - 1, x[start + t]]
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager", "native"])
def test_compute_logprobs_packed_matches_unpadded_rows(tiny, impl):
    model = load_causal_lm(tiny, backend="cpu", attn_impl=impl)
    assert model.config._attn_implementation == f"portrl_cpu_{impl}"
    ref_model = load_causal_lm(tiny, backend="cpu", attn_impl="hf_eager")
    ids, mask, T = _batch()
    with torch.no_grad():
        want = _reference_rows(ref_model, ids, mask, T)
    for packed in (True, False):
        logp, ent = compute_logprobs(model, ids, mask, T, with_entropy=True, packed=packed)
        assert logp.shape == (4, T) and ent.shape == (4, T)
        assert (logp - want).abs().max().item() <= 1e-5
        assert torch.all(logp[mask[:, -T:] == 0] == 0) and torch.all(ent[mask[:, -T:] == 0] == 0)
        assert torch.all(ent[mask[:, -T:] == 1] > 0)


def test_compute_logprobs_gradients_match_padded_hf(tiny):
    ids, mask, T = _batch(seed=1)
    grads = {}
    for impl, packed in (("sdpa", True), ("hf_sdpa", False)):
        model = load_causal_lm(tiny, backend="cpu", attn_impl=impl)
        logp, ent = compute_logprobs(model, ids, mask, T, with_entropy=True, packed=packed, temperature=0.8)
        (logp.sum() + 0.1 * ent.sum()).backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(g, grads["hf_sdpa"][name], atol=1e-4, rtol=1e-4)


def test_gradient_checkpointing_same_gradients(tiny):
    ids, mask, T = _batch(seed=2)
    grads = []
    for ckpt in (False, True):
        model = load_causal_lm(tiny, backend="cpu", gradient_checkpointing=ckpt)
        model.train()
        compute_logprobs(model, ids, mask, T)[0].sum().backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_models_load_without_hub_kernels(tiny):
    """transformers 5.x kernelizes a model by default (Hub kernels for its norms and MLPs off the CPU); portrl's
    models run portrl's kernels only."""
    model = load_causal_lm(tiny, backend="cpu")
    assert not getattr(model, "use_kernels", False)
    model.train()
    assert not getattr(model, "use_kernels", False) and getattr(model, "_kernels_mode", None) is None


def test_llama_runs_on_portrl_attention(tiny_llama):
    model = load_causal_lm(tiny_llama, backend="cpu")
    ref = load_causal_lm(tiny_llama, backend="cpu", attn_impl="hf_eager")
    assert type(model).__name__ == "LlamaForCausalLM"
    ids, mask, T = _batch(seed=3)
    with torch.no_grad():
        got = compute_logprobs(model, ids, mask, T)[0]
        want = _reference_rows(ref, ids, mask, T)
    assert (got - want).abs().max().item() <= 1e-5


def test_generate_with_cache_matches_hf(tiny):
    """The rollout engine generates with a KV cache on the same model: left-padded prefill + decode."""
    tok = load_tokenizer(tiny)
    prompts = ["<|im_start|>user\nWhat is 12+7?<|im_end|>\n", "3*4="]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][1, 0] == 0  # left padding
    outs = []
    for impl in ("sdpa", "hf_sdpa"):
        model = load_causal_lm(tiny, backend="cpu", attn_impl=impl)
        outs.append(model.generate(**enc, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_compute_logprobs_input_errors(tiny):
    model = load_causal_lm(tiny, backend="cpu")
    ids, mask, T = _batch()
    with pytest.raises(ValueError, match="response_length"):
        compute_logprobs(model, ids, mask, ids.shape[1])
    bad = mask.clone()
    bad[0, ids.shape[1] - T - 1] = 0  # a response token after a masked position
    with pytest.raises(ValueError, match="must follow an unmasked token"):
        compute_logprobs(model, ids, bad, T)
