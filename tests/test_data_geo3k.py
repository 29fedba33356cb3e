"""``portrl preprocess geo3k``: raw Geometry3K-style rows (self-drawn diagrams) -> verl's multimodal parquet, and
the checks of an ``images`` column (one-line errors, exit code 2)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from portrl.cli import main
from portrl.data import DataError, preprocess, write_split
from portrl.data.geo3k import GEO3K_INSTRUCTION, convert
from portrl.data.geo_diagrams import KINDS, make_geo_diagram_records, write_geo_diagram_dataset
from portrl.data.images import check_row_images, decode_image, encode_image
from portrl.data.validate import read_verl_file
from portrl.rewards import compute_score

# verl examples/data_preprocess/geo3k.py's instruction, written out here independently of portrl.data.geo3k
VERL_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the "
                    r"final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                    r"answer MUST BE put in \boxed{}.")
VERL_COLUMNS = ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]


def read(path):
    return pq.read_table(path).to_pylist()


def pixels(data: bytes):
    return Image.open(io.BytesIO(data)).convert("RGB").tobytes()


def test_diagrams_round_trip_through_the_cli(tmp_path, capsys):
    raw = write_geo_diagram_dataset(tmp_path / "raw", n=10, n_test=5, seed=3, size=64)
    assert main(["preprocess", "geo3k", "--input", str(raw), "--output-dir", str(tmp_path / "out")]) == 0
    assert "train: 10 rows" in capsys.readouterr().out
    raw_rows = {"train": read(raw / "train-00000-of-00001.parquet"), "test": read(raw / "test-00000-of-00001.parquet")}
    assert GEO3K_INSTRUCTION == VERL_INSTRUCTION
    for split in ("train", "test"):
        table = pq.read_table(tmp_path / "out" / f"{split}.parquet")
        assert table.column_names == VERL_COLUMNS
        assert str(table.schema.field("images").type) == "list<element: struct<bytes: binary, path: string>>"
        for i, (row, src) in enumerate(zip(table.to_pylist(), raw_rows[split], strict=True)):
            assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
            assert row["prompt"] == [{"role": "user", "content": src["problem"] + " " + VERL_INSTRUCTION}]
            assert row["prompt"][0]["content"].startswith("<image>")
            assert row["reward_model"] == {"style": "rule", "ground_truth": src["answer"]}
            assert row["extra_info"] == {"split": split, "index": i, "answer": src["answer"], "question": src["problem"]}
            assert [im["bytes"] for im in row["images"]] == [im["bytes"] for im in src["images"]]  # kept as given
            # the known answer, boxed after a think block, earns the full geo3k reward
            response = f"<think>read the labels</think> The answer is \\boxed{{{src['answer']}}}."
            assert compute_score(row["data_source"], response, row["reward_model"]["ground_truth"])["score"] == 1.0
            assert read_verl_file(tmp_path / "out" / f"{split}.parquet", "data.train_files")[i][4] == row["images"]
    assert not list((tmp_path / "out").glob(".*tmp"))


def test_diagrams_are_deterministic_and_cover_every_kind():
    a, b = make_geo_diagram_records(10, seed=1, size=56), make_geo_diagram_records(10, seed=1, size=56)
    assert a == b and a != make_geo_diagram_records(10, seed=2, size=56)
    assert len({r["problem"] for r in a[:len(KINDS)]}) == len(KINDS)
    assert "\\sqrt{2}" in a[4]["answer"]  # the isosceles right triangle
    assert decode_image(a[0]["images"][0]).size == (56, 56)


def test_every_raw_image_form_is_stored_as_bytes_and_path(tmp_path):
    image = Image.new("RGB", (40, 30), (200, 10, 10))
    png = io.BytesIO()
    image.save(png, format="PNG")
    (tmp_path / "d.png").write_bytes(png.getvalue())
    forms = [image, png.getvalue(), {"bytes": png.getvalue(), "path": "d.png"}, {"bytes": None, "path": str(tmp_path / "d.png")},
             str(tmp_path / "d.png")]
    rows = convert([("raw.parquet", i, {"images": [f], "problem": "<image>Find x.", "answer": "3"})
                    for i, f in enumerate(forms)], "train")
    for row in rows:
        stored = row["images"][0]
        assert set(stored) == {"bytes", "path"} and pixels(stored["bytes"]) == image.tobytes()
    assert [r["images"][0]["path"] for r in rows] == [None, None, "d.png", str(tmp_path / "d.png"), str(tmp_path / "d.png")]
    # a problem without a placeholder gets one per image; a single image (not a list) is one image
    row = convert([("raw", 0, {"images": image, "problem": "Find x.", "answer": 4.0})], "test")[0]
    assert row["prompt"][0]["content"].startswith("<image>Find x. ") and row["reward_model"]["ground_truth"] == "4"


def test_a_saved_hf_dataset_with_image_features_converts(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = make_geo_diagram_records(4, seed=0, size=56)
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"images": [[decode_image(r["images"][0])] for r in records],
                                     "problem": [r["problem"] for r in records],
                                     "answer": [r["answer"] for r in records]}, features=features)
    ds.save_to_disk(str(tmp_path / "saved"))
    paths = preprocess("geo3k", tmp_path / "out", tmp_path / "saved", test_fraction=0.25)
    rows = read(paths["train"]) + read(paths["test"])
    assert sorted(r["reward_model"]["ground_truth"] for r in rows) == sorted(r["answer"] for r in records)
    by_answer = {r["answer"]: r for r in records}
    for row in rows:  # datasets re-encoded the PIL images: the pixels are the drawn ones
        assert pixels(row["images"][0]["bytes"]) == pixels(by_answer[row["reward_model"]["ground_truth"]]["images"][0]["bytes"])


def _raw_file(tmp_path, record):
    return str(write_split([record], tmp_path / "raw.parquet"))


GOOD_IMAGE = make_geo_diagram_records(1, size=56)[0]["images"][0]


@pytest.mark.parametrize("record,message", [
    ({"problem": "<image>Find x.", "answer": "3"}, "row 0: field 'images' is missing"),
    ({"images": [{"bytes": b"not an image", "path": None}], "problem": "<image>Find x.", "answer": "3"},
     "row 0: field 'images[0]' holds no decodable image (UnidentifiedImageError"),
    ({"images": [GOOD_IMAGE], "problem": "<image><image>Find x.", "answer": "3"},
     "field 'problem' has 2 <image> placeholder(s) but the row has 1 image(s)"),
    ({"images": [GOOD_IMAGE], "problem": "<image>Find x."}, "row 0: field 'answer' is missing"),
    ({"images": [], "problem": "<image>Find x.", "answer": "3"}, "row 0: field 'images' is empty"),
])
def test_bad_raw_rows_are_one_line_errors(tmp_path, capsys, record, message):
    assert main(["preprocess", "geo3k", "--input", _raw_file(tmp_path, record), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("portrl preprocess: error: ") and "\n" not in err
    assert not (tmp_path / "o").exists()


def _geo_rows(tmp_path):
    raw = write_geo_diagram_dataset(tmp_path / "raw", n=4, n_test=0, size=56)
    return read(write_split(convert([("raw", i, r) for i, r in enumerate(read(raw / "train-00000-of-00001.parquet"))],
                                    "train"), tmp_path / "ok.parquet"))


def test_image_column_checks(tmp_path):
    row = _geo_rows(tmp_path)[0]
    messages = row["prompt"]
    assert check_row_images(row, "f", 0, messages) == row["images"]
    assert check_row_images({"images": []}, "f", 0, [{"role": "user", "content": "no image"}]) is None  # a text row
    assert check_row_images({}, "f", 0, messages) is None  # no images column: "<image>" is text, as in verl
    with pytest.raises(DataError, match=r"f: row 3: the prompt has 1 <image> placeholder\(s\) but field 'images' is missing"):
        check_row_images({"images": None}, "f", 3, messages)
    with pytest.raises(DataError, match=r"field 'images' has 2 image\(s\) but the prompt has 1 <image>"):
        check_row_images({"images": row["images"] * 2}, "f", 0, messages)
    with pytest.raises(DataError, match=r"field 'images\[0\]' holds no decodable image"):
        check_row_images({"images": [{"bytes": row["images"][0]["bytes"][:60], "path": None}]}, "f", 0, messages)
    with pytest.raises(DataError, match="field 'images' must be a list of images, got str"):
        check_row_images({"images": "x.png"}, "f", 0, messages)
    with pytest.raises(DataError, match="holds no decodable image"):
        encode_image({"path": None}, "f", 0)


@pytest.mark.parametrize("mutate,message", [
    (lambda r: r.update(images=None), "row 1: the prompt has 1 <image> placeholder(s) but field 'images' is missing"),
    (lambda r: r.update(images=r["images"] * 2), "row 1: field 'images' has 2 image(s) but the prompt has 1 <image>"),
    (lambda r: r["images"][0].update(bytes=b"\x89PNG\r\n\x1a\n broken"), "row 1: field 'images[0]' holds no decodable"),
])
def test_bad_image_columns_stop_portrl_train_with_one_line(tmp_path, capsys, mutate, message):
    rows = _geo_rows(tmp_path)
    mutate(rows[1])
    path = write_split(rows, tmp_path / "bad.parquet")
    code = main(["train", "data=geo3k", f"data.train_files=[{path}]", "data.val_files=[]", "device.num_threads=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("portrl train: error: ") and "\n" not in err
    assert f"{path}: {message}" in err


def test_images_without_an_image_processor_stop_before_any_model_loads(tmp_path):
    """The built-in tiny model (a text model) cannot read the rows' images: one line, exit code 2 (a real
    ``portrl`` process: no traceback)."""
    path = write_split(_geo_rows(tmp_path), tmp_path / "geo.parquet")
    env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_DEBUG", None)
    proc = subprocess.run([str(Path(sys.executable).parent / "portrl"), "train", "data=geo3k",
                           f"data.train_files=[{path}]", "data.val_files=[]", "device.num_threads=1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (f"portrl train: error: the data has images ({path} row 0), but the built-in tiny model (model.path "
            "empty) has no image processor") in proc.stderr


def test_qa_rows_for_geometry3k_get_its_instruction(tmp_path):
    raw = tmp_path / "rows.jsonl"
    raw.write_text('{"question": "A square has side 3. Find its area.", "answer": "9"}\n')
    paths = preprocess("qa", tmp_path / "out", raw, test_fraction=0.0, data_source="hiyouga/geometry3k")
    row = read(paths["train"])[0]
    assert row["prompt"][0]["content"] == "A square has side 3. Find its area. " + VERL_INSTRUCTION
    assert "images" not in row  # a text row: the geo3k reward scores it all the same
    assert compute_score(row["data_source"], "<think>3*3</think>\\boxed{9}", row["reward_model"]["ground_truth"])["score"] == 1.0


def test_geo3k_preset_names_the_files_preprocess_writes():
    from portrl.config import compose

    cfg = compose(overrides=["data=geo3k", "model.path=/models/Qwen2.5-VL-7B-Instruct"])  # not the tiny preset's sizes
    assert cfg.data.name == "geo3k" and [str(f) for f in cfg.data.train_files] == [str(Path.home() / "data/geo3k/train.parquet")]
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.train_batch_size) == (1024, 2048, 512)
    assert cfg.actor.ppo_mini_batch_size == 128
