"""Shared-prompt packing (portrl.models.prefix_sharing): same log-probs and gradients, fewer tokens."""

import pytest
import torch

from portrl.models import compute_logprobs, load_causal_lm, write_tiny_model
from portrl.models.prefix_sharing import plan_shared_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # a larger init than the default makes outputs input-sensitive, so a masking mistake shows
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", initializer_range=0.3, seed=0)


def _grouped_batch(seed=0, P=6, T=5):
    """Three prompts (lengths 6, 3, 1) x samples of response lengths including 1 and 0, rows of a group
    not adjacent (as after a shuffle), left-padded prompts + right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (6, 3, 1)]
    rows = [(0, 5), (1, 2), (0, 1), (2, 3), (0, 4), (1, 5), (2, 1), (0, 0), (1, 3)]  # (prompt, response length)
    ids = torch.zeros(len(rows), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(rows):
        ids[b, P - len(prompts[p]):P] = prompts[p]
        mask[b, P - len(prompts[p]):P] = 1
        ids[b, P:P + r] = torch.randint(3, 100, (r,), generator=g)
        mask[b, P:P + r] = 1
    return ids, mask, T


def test_plan_counts_each_prompt_once_and_drops_last_tokens():
    ids, mask, T = _grouped_batch()
    layout = plan_shared_prompts(ids, mask, T)
    assert layout.groups == 3
    resp = mask[:, -T:].sum(1)
    assert layout.flat_ids.numel() == (6 + 3 + 1) + int((resp - 1).clamp(min=0).sum())
    assert layout.score_rows.numel() == int(resp.sum())
    assert layout.plan.keep.numel() == layout.flat_ids.numel()
    # each virtual sequence starts with its group's prompt at positions 0..P-1
    starts = layout.plan.cu_seqlens[:-1].long()
    assert torch.all(layout.position_ids[layout.plan.gather[starts]] == 0)


def test_plan_declines_rows_with_holes():
    ids, mask, T = _grouped_batch()
    mask[0, 7] = 0  # a hole inside row 0's response
    assert plan_shared_prompts(ids, mask, T) is None


@pytest.mark.parametrize("impl", ["sdpa", "eager", "native"])
def test_shared_prompts_same_logprobs_and_gradients(tiny, impl):
    ids, mask, T = _grouped_batch(seed=1)
    results = {}
    for share, packed in ((True, True), (False, True), (False, False)):
        model = load_causal_lm(tiny, backend="cpu", attn_impl=impl)
        logp, ent = compute_logprobs(model, ids, mask, T, with_entropy=True, packed=packed,
                                     share_prompts=share, temperature=0.8)
        (logp.sum() + 0.1 * ent.sum()).backward()
        results[(share, packed)] = (logp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()})
    ref_logp, ref_ent, ref_grads = results[(False, False)]
    for key in ((True, True), (False, True)):
        logp, ent, grads = results[key]
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-4, rtol=1e-4, msg=f"{key} {name}")
    assert torch.all(ref_logp[mask[:, -T:] == 0] == 0)


def test_shared_prompts_only_with_portrl_attention(tiny):
    """transformers' own attention ignores the plan, so compute_logprobs must not use it there."""
    ids, mask, T = _grouped_batch(seed=2)
    model = load_causal_lm(tiny, backend="cpu", attn_impl="hf_sdpa")
    with torch.no_grad():
        shared, _ = compute_logprobs(model, ids, mask, T, share_prompts=True)
        plain, _ = compute_logprobs(model, ids, mask, T, packed=False)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_critic_values_shared_equal_padded(tiny):
    """The critic's value model reads the same hidden states: shared, packed and padded agree (values and
    gradients), and padding gets 0."""
    from portrl.workers.critic import ValueModel

    ids, mask, T = _grouped_batch(seed=3)
    results = []
    for share, packed in ((True, True), (False, True), (False, False)):
        torch.manual_seed(0)
        vm = ValueModel(load_causal_lm(tiny, backend="cpu"))
        # a zero head (the init) would pass no gradient to the decoder
        torch.nn.init.normal_(vm.value_head.weight, std=vm.value_head.in_features ** -0.5)
        values = vm(ids, mask, T, packed=packed, share_prompts=share)
        values.pow(2).sum().backward()
        results.append((values.detach(), vm.value_head.weight.grad.clone(),
                        vm.base.layers[0].self_attn.v_proj.weight.grad.clone()))
    for got in results[:2]:
        for a, want in zip(got, results[2]):
            torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-4)
    assert torch.all(results[0][0][mask[:, -T:] == 0] == 0)


def test_falls_back_when_the_plan_does_not_reach_the_attention(tiny, monkeypatch, caplog):
    """A transformers version that dropped the keyword on its way to the attention would give the wrong
    attention; compute_logprobs notices (no layer read the plan) and runs plain packing instead."""
    import portrl.models.logprobs as lp_mod

    ids, mask, T = _grouped_batch(seed=4)
    model = load_causal_lm(tiny, backend="cpu")
    with torch.no_grad():
        want, _ = compute_logprobs(model, ids, mask, T, packed=False)
        monkeypatch.setattr(lp_mod, "PLAN_KWARG", "a_keyword_no_attention_reads")
        with caplog.at_level("WARNING"):
            got, _ = compute_logprobs(model, ids, mask, T, share_prompts=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert "shared-prompt plan" in caplog.text
