"""Tensor parallelism of a Qwen2.5-VL (issue 60, item 2; portrl.models.tensor_parallel): the tiny Qwen2.5-VL
(portrl/models/tiny_vl.py) under TP=2 (2 CPU processes over gloo; the trainer's mesh, FSDP2 wrap and gradient
checkpointing) gives the one-rank per-token log-probs and entropy of a batch with images (two image rows of 4 and
12 image tokens and a text row, 2 responses each) through the actor's forward (compute_logprobs with the batch's
image inputs, packed and padded), and one backward gives the one-rank gradients, every one of them, and gradient
norm (clip_grad_norm); with the LM head tied to the embedding and with one of its own. Only the language model is
split: every vision-tower parameter stays whole and off the "tp" dimension on both ranks, and its gradient is the
one-rank gradient.

Bounds (float32), argued as portrl.parity.mesh argues its own: TP computes the same sums in another order (the
row-parallel layers add 2 partial products, the vocabulary-parallel log-prob combines 2 partial softmax sums,
DTensor sums the replicated activations' partial gradients), which moves a float32 sum of k terms by about
k * 2^-24 of its magnitude. This model's initialisation is large (0.2, so that outputs depend on the image): its
log-probs reach 13 in magnitude, where one float32 step is 9.5e-7, so the log-probs (and entropy) get LOGP_ATOL =
2e-5, about 20 steps (parity mesh's 1e-5 is as many steps at its log-probs of ~5); the gradient norm (~13) gets
REL_TOL = 1e-5 relative and every gradient REL_TOL of max(its largest entry, 1), parity mesh's bounds. Measured:
log-probs 3.8e-6, entropy 3.3e-6, gradient norm 4.2e-7 relative (the prompts and images of
tests/test_models_vl.py's mixed_prompts). A wrong split (a head, token or image embedding in the wrong place, a missing or doubled
reduction) moves them by 1e-2 or more: other pixels move the image rows' log-probs by 4 or more, and every gradient
tensor here has entries of 5e-3 or more.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from portrl.device import get_backend
from portrl.device.mesh_shape import MeshShape
from portrl.models import compute_logprobs, load_causal_lm, load_processor, write_tiny_vl_model
from portrl.models.multimodal import batch_image_inputs
from portrl.workers.batch import build_rollout_batch
from portrl.workers.mesh import build_mesh
from _gloo_ranks import run_ranks
from test_models_vl import mixed_prompts
from portrl.workers.parallel import ForwardModule, clip_grad_norm, wrap_model

TP2 = MeshShape.of(2, tp=2)
TEMPERATURE = 0.7
HEADS = ("tied", "untied")
# the module docstring says why these bounds
LOGP_ATOL = 2e-5
REL_TOL = 1e-5


def _batch(model_dir: str) -> dict:
    """The batch (built once, given to every rank): prompts with a 56x56 image (4 image tokens), a 112x84 image
    (12) and none, 2 responses each, through the processor as the dataset encodes them; fixed advantages."""
    processor = load_processor(model_dir)
    prompts, entries = mixed_prompts(processor)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (6, 3, 5, 7, 2, 4)]
    batch = build_rollout_batch(prompts, responses, pad_token_id=processor.tokenizer.pad_token_id, n=2,
                                meta={"multi_modal": entries})
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "response_mask": batch["response_mask"], "images": batch_image_inputs(batch.meta["multi_modal"]),
            "advantages": torch.randn(batch["response_mask"].shape, generator=g)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective: every rank calls it in the same order), a plain tensor as it is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _layout(model: Any) -> dict:
    """Where the parameters live: vision-tower parameters on a "tp" mesh dimension or held in part, and the local
    rows of the first query projection."""
    on_tp, partial = [], []
    for name, p in model.named_parameters():
        if ".visual." not in f".{name}":
            continue
        if "tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()):
            on_tp.append(name)
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.shape != p.shape:
            partial.append(name)
    split = {}
    for key, w in (("q_proj", model.model.language_model.layers[0].self_attn.q_proj.weight),
                   ("lm_head", model.lm_head.weight)):
        split[key] = ((w.to_local() if hasattr(w, "to_local") else w).shape[0], w.shape[0])
    return {"vision_on_tp": on_tp, "vision_partial": partial, "split": split,
            "tied": model.lm_head.weight is model.model.language_model.embed_tokens.weight,
            "vision_params": sum(".visual." in f".{n}" for n, _ in model.named_parameters())}


def run(model_dir: str, b: dict, shape: MeshShape | None = None, rank: int = 0) -> dict:
    """The actor's training forward and one backward of the tiny VL in ``model_dir`` under ``shape`` (None: one
    rank) on batch ``b`` (:func:`_batch`): packed log-probs, entropy, the loss, every gradient (whole), the gradient
    norm before clipping; padded log-probs, and packed ones with the images' pixels reversed (no gradient)."""
    torch.manual_seed(0)
    backend = get_backend("cpu")
    # the ranks train with gradient checkpointing, as the actor does a real (>= 100M) model: the backward
    # recomputes every decoder and vision block, collectives included; the reference without (same values)
    model = load_causal_lm(model_dir, "float32", backend=backend, gradient_checkpointing=shape is not None).train()
    module: torch.nn.Module = ForwardModule(model, compute_logprobs)
    if shape is not None:
        module = wrap_model(module, "fsdp", backend, device=torch.device("cpu"),
                            mesh=build_mesh("cpu", shape, rank))
    args = (b["input_ids"], b["attention_mask"], b["response_mask"].shape[1])
    with torch.no_grad():
        padded, _ = module(*args, temperature=TEMPERATURE, packed=False, multi_modal=b["images"])
        other = dict(b["images"], pixel_values=b["images"]["pixel_values"].flip(0))
        swapped, _ = module(*args, temperature=TEMPERATURE, multi_modal=other)
    logp, entropy = module(*args, temperature=TEMPERATURE, with_entropy=True, multi_modal=b["images"])
    mask = b["response_mask"]
    loss = -((logp * b["advantages"] - 0.01 * entropy) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm(model.parameters(), 1.0)
    return {"logp": logp.detach(), "padded": padded, "swapped": swapped, "entropy": entropy.detach(),
            "loss": float(loss.detach()), "grads": grads, "grad_norm": norm, "layout": _layout(model)}


def _heads(rank: int, world: int, model_dirs: dict, batch: dict) -> dict:
    """One TP2 rank's results of each model: ``{head: run(...)}``."""
    return {head: run(d, batch, TP2, rank) for head, d in model_dirs.items()}


def _ranks(model_dirs: dict, batch: dict) -> dict:
    """``run`` of each model in ``model_dirs`` on each rank of TP2 (processes over gloo, forked by a fork server
    that imported this module and the model's class once, as portrl parity mesh starts its ranks: ~10 s less on 2
    cores): ``{rank: {head: results}}``."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([__name__, "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"])
    return run_ranks(_heads, TP2.world, (model_dirs, batch), start_method=method)


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """``{head: (one rank's results, {rank: TP2 results})}`` of the tiny Qwen2.5-VL (byte vocabulary of 272: TP2
    splits it; 4 query heads over 2 key/value heads) with its LM head tied to the embedding (as Qwen2.5-VL-3B) and
    with a head of its own (as the 7B to 72B models); both run in one launch of the ranks."""
    root = tmp_path_factory.mktemp("tp_vl")
    dirs = {head: str(write_tiny_vl_model(root / head, tokenizer="bytes", initializer_range=0.2,
                                          tie_word_embeddings=head == "tied")) for head in HEADS}
    batch = _batch(dirs["tied"])
    ranks = _ranks(dirs, batch)
    return {head: (run(d, batch), {r: got[head] for r, got in ranks.items()}) for head, d in dirs.items()}


@pytest.fixture(params=HEADS)
def runs(all_runs, request):
    return all_runs[request.param]


def test_vl_log_probs_under_tp2_equal_one_rank(runs):
    ref, ranks = runs
    mask = ref["logp"] != 0
    assert int(mask.sum()) == 27 and float(ref["logp"][mask].abs().max()) > 1.0  # every response token, not ~0
    for rank, got in ranks.items():
        for key in ("logp", "padded", "entropy"):
            diff = float((got[key] - ref[key]).abs().max())
            assert diff <= LOGP_ATOL, (rank, key, diff)
        assert abs(got["loss"] - ref["loss"]) <= REL_TOL * abs(ref["loss"]), (rank, got["loss"], ref["loss"])
    torch.testing.assert_close(ref["padded"], ref["logp"], atol=LOGP_ATOL, rtol=0)  # the two layouts agree


def test_the_images_matter_under_tp2_as_on_one_rank(runs):
    ref, ranks = runs
    # other pixels move the image rows' log-probs far past the bound, the text rows' not at all: an image
    # embedding in the wrong place or missing would fail the comparisons above
    assert float((ref["swapped"][:4] - ref["logp"][:4]).abs().max()) > 1e-2
    torch.testing.assert_close(ref["swapped"][4:], ref["logp"][4:])
    for got in ranks.values():
        assert float((got["swapped"] - ref["swapped"]).abs().max()) <= LOGP_ATOL


def test_vl_gradients_under_tp2_equal_one_rank(runs):
    ref, ranks = runs
    assert any(".visual." in n for n in ref["grads"]), "the vision tower trains: its gradients are compared too"
    for rank, got in ranks.items():
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= REL_TOL * ref["grad_norm"], (rank, got["grad_norm"])
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            worst = float((got["grads"][name] - g).abs().max())
            assert worst <= REL_TOL * max(float(g.abs().max()), 1.0), (rank, name, worst)


def test_tp2_splits_the_language_model_only(runs):
    ref, ranks = runs
    for rank, got in ranks.items():
        layout = got["layout"]
        assert layout["vision_params"] == ref["layout"]["vision_params"] > 0
        assert layout["vision_on_tp"] == [] and layout["vision_partial"] == [], (rank, layout)
        assert layout["tied"] == ref["layout"]["tied"]
        for key, (rows, full) in layout["split"].items():  # the query heads and the vocabulary: half a rank
            assert rows * 2 == full == ref["layout"]["split"][key][0], (rank, key)
