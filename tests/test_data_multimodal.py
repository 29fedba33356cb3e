"""RLDataset with a vision-language processor (the tiny random Qwen2.5-VL's real Qwen2-VL processor): image rows
get the processor's expanded ids and image inputs, text rows stay exactly as without one; the preflight counts the
expanded ids and stops a model without an image processor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from portrl.config import compose
from portrl.data import DataError, RLDataset, write_split
from portrl.data.geo3k import convert
from portrl.data.geo_diagrams import make_geo_diagram_records
from portrl.data.images import encode_image
from portrl.data.rl_dataset import encode_messages
from portrl.errors import UserError
from portrl.models import load_processor, load_tokenizer, write_tiny_vl_model
from portrl.trainer.preflight import preflight
from portrl.trainer.generation import prompt_batch

from _geo_data import write_geo3k_parquet


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model dir, tokenizer, processor) of a tiny random Qwen2.5-VL."""
    path = write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")
    return path, load_tokenizer(path), load_processor(path)


def text_rows(n, start=0):
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(start, start + n)]


def two_image_row():
    """One row with a 56x56 and a 112x112 image: 4 and 16 image tokens with the tiny processor's bounds."""
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (112, 112), (0, 0, 255))]
    rec = {"images": images, "problem": "<image>Compare the red square with <image>the blue one.", "answer": "2"}
    return convert([("raw", 0, rec)], "train")[0]


def mixed_file(tmp_path):
    geo = convert([("raw", i, r) for i, r in enumerate(make_geo_diagram_records(3, size=56))], "train")
    rows = text_rows(2) + geo + [two_image_row()] + text_rows(1, start=5)
    return write_split(rows, tmp_path / "mixed.parquet"), rows


def test_image_rows_are_expanded_text_rows_unchanged(tmp_path, vl):
    _, tok, processor = vl
    path, rows = mixed_file(tmp_path)
    ds = RLDataset(path, tok, max_prompt_length=512, shuffle=False, processor=processor)
    batch = next(ds.batches(len(rows)))
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    merge = processor.image_processor.merge_size
    text_only = RLDataset(write_split([r for r in rows if "images" not in r or r["images"] is None],
                                      tmp_path / "text.parquet"), tok, max_prompt_length=512, shuffle=False)
    text_ids = iter(text_only.batches(text_only.num_rows).__next__().prompt_ids)
    for row, ids, mm in zip(rows, batch.prompt_ids, batch.multi_modal, strict=True):
        if row.get("images") is None:  # a text row: the ids of a text dataset, no multimodal entry
            assert mm is None and ids == next(text_ids) == encode_messages(tok, row["prompt"])
            continue
        grid = mm["inputs"]["image_grid_thw"]
        n_images = len(row["images"])
        assert grid.shape == (n_images, 3) and mm["inputs"]["pixel_values"].shape[0] == int(grid.prod(-1).sum())
        per_image = (grid.prod(-1) // merge**2).tolist()
        assert ids.count(pad) == sum(per_image)
        # each image's pads sit between its own vision_start / vision_end, in order
        runs = [ids[s + 1:ids.index(end, s)] for s in (j for j, t in enumerate(ids) if t == start)]
        assert [len(r) for r in runs] == per_image and all(set(r) == {pad} for r in runs)
        # verl's raw_prompt_ids: the same prompt with ONE pad per image
        collapsed = [t for j, t in enumerate(ids) if t != pad or ids[j - 1] != pad]
        assert mm["raw_prompt_ids"] == collapsed and mm["raw_prompt_ids"].count(pad) == n_images
        assert [im.mode for im in mm["images"]] == ["RGB"] * n_images
        assert set(mm["inputs"]) == {"pixel_values", "image_grid_thw"}
    assert len(batch.multi_modal[5]["images"]) == 2 and per_image == [4, 16]  # the last image row: two images
    meta = prompt_batch(batch).meta
    assert all(a is b for a, b in zip(meta["multi_modal"], batch.multi_modal, strict=True))
    assert meta["prompt_ids"] == batch.prompt_ids
    assert "multi_modal" not in prompt_batch(next(text_only.batches(2))).meta  # text runs: meta as before


def test_max_prompt_length_counts_the_expanded_ids(tmp_path, vl):
    _, tok, processor = vl
    path, rows = mixed_file(tmp_path)
    full = next(RLDataset(path, tok, max_prompt_length=512, shuffle=False, processor=processor).batches(len(rows)))
    image_rows = [i for i, m in enumerate(full.multi_modal) if m is not None]
    geo = min(image_rows, key=lambda i: len(full.prompt_ids[i]))
    geo_len = len(full.prompt_ids[geo])
    limit = geo_len - 1  # every image row is over it with its image tokens; the shortest is not without them
    assert len(full.multi_modal[geo]["raw_prompt_ids"]) <= limit
    text_rows_fitting = [i for i in range(len(rows)) if i not in image_rows and len(full.prompt_ids[i]) <= limit]
    kept = RLDataset(path, tok, max_prompt_length=limit, shuffle=False, processor=processor)
    assert kept.num_rows == len(text_rows_fitting) == 3
    assert all(m is None for m in next(kept.batches(3)).multi_modal)
    with pytest.raises(DataError, match=rf"row {image_rows[0]}: prompt has \d+ tokens with its images > max_prompt_length "
                                        rf"{limit}, and a prompt with images is not truncated"):
        RLDataset(path, tok, max_prompt_length=limit, filter_overlong_prompts=False, truncation="left",
                  processor=processor)


def test_resume_gives_the_same_batches_with_their_images(tmp_path, vl):
    _, tok, processor = vl
    path, _ = mixed_file(tmp_path)
    first = RLDataset(path, tok, max_prompt_length=512, seed=3, processor=processor)
    it = first.batches(3)
    next(it)
    state = first.state_dict()
    expected = next(it)
    resumed = RLDataset(path, tok, max_prompt_length=512, seed=3, processor=processor)
    resumed.load_state_dict(state)
    got = next(resumed.batches(3))
    assert got.uid == expected.uid and got.prompt_ids == expected.prompt_ids
    for a, b in zip(got.multi_modal, expected.multi_modal, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a["inputs"]["pixel_values"], b["inputs"]["pixel_values"])


def test_image_rows_without_a_processor_name_the_row(tmp_path, vl):
    _, tok, _ = vl
    path, _ = mixed_file(tmp_path)
    with pytest.raises(DataError, match=r"mixed.parquet: row 2: the row has 1 image\(s\), but the model has no image "
                                        r"processor; train on images with a vision-language model"):
        RLDataset(path, tok, max_prompt_length=512)


def _cfg(model, files, *extra):
    out = Path(files["train"]).parent / "run"  # not the default outputs/run of the current directory: a user's run
    return compose(overrides=["data=geo3k", f"model.path={model}", f"data.train_files=[{files['train']}]",
                              f"data.val_files=[{files['test']}]", "device.num_threads=1",
                              f"trainer.output_dir={out}", *extra])


def test_preflight_counts_image_tokens_and_needs_an_image_processor(tmp_path, vl):
    path, tok, processor = vl
    files = write_geo3k_parquet(tmp_path / "geo", n=4, n_test=2)
    preflight(_cfg(path, files, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"))  # reads the images: fine
    # verl's raw_prompt_ids (one pad per image) of the shortest row fit, but no row does with its image tokens
    rows = next(RLDataset(files["train"], tok, max_prompt_length=512, processor=processor).batches(4))
    raw = min(len(m["raw_prompt_ids"]) for m in rows.multi_modal)
    assert raw < min(len(ids) for ids in rows.prompt_ids)
    with pytest.raises(UserError, match=r"only 0 of the 4 rows .* fit data.max_prompt_length"):
        preflight(_cfg(path, files, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                       f"data.max_prompt_length={raw}"))
    text_model = shutil.copytree(path, tmp_path / "text_model", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    with pytest.raises(UserError, match=rf"the data has images \({files['train']} row 0\), but model.path "
                                        rf"'{text_model}' has no image processor \(preprocessor_config.json\)"):
        preflight(_cfg(text_model, files, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"))


def test_encode_image_keeps_bytes_and_rejects_truncated_files():
    png = make_geo_diagram_records(1, size=56)[0]["images"][0]["bytes"]
    assert encode_image(png, "f", 0) == {"bytes": png, "path": None}
    with pytest.raises(DataError, match="row 0: field 'images' holds no decodable image"):
        encode_image(png[: len(png) // 2], "f", 0)
