"""The vendor pages of the docs (docs/backends/<vendor>.md): the image commands, the device flags and the presets each
vendor needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = {"cuda": "nvidia", "rocm": "amd", "npu": "ascend", "cpu": "cpu"}
FLAGS = {
    "cuda": ["--gpus all"],
    "rocm": ["--device /dev/kfd", "--device /dev/dri", "--group-add video", "--security-opt seccomp=unconfined"],
    "npu": ["--device /dev/davinci0", "--device /dev/davinci_manager", "--device /dev/devmm_svm",
            "--device /dev/hisi_hdc", "-v /usr/local/dcmi", "-v /usr/local/bin/npu-smi", "-v /usr/local/Ascend/driver"],
    "cpu": [],
}
PRESETS = {"cuda": ["a100", "h100", "h200"], "rocm": ["mi300x", "mi325x"], "npu": ["ascend-910b", "ascend-910c"],
           "cpu": ["cpu"]}


def section(vendor: str) -> str:
    return (DOCS / "backends" / f"{PAGES[vendor]}.md").read_text()


@pytest.mark.parametrize("vendor", PAGES)
def test_vendor_section_has_image_run_train_and_traps(vendor):
    text = section(vendor)
    assert f"docker build -f docker/{vendor}/Dockerfile -t portrl:{vendor} ." in text
    run = next(block for block in re.findall(r"```bash\n(.*?)```", text, re.S) if "docker run" in block)
    for flag in FLAGS[vendor]:
        assert flag in run, f"{vendor}: docker run lacks {flag}"
    for preset in PRESETS[vendor]:
        assert f"`{preset}`" in text
    assert re.search(rf"portrl train --device {vendor} --preset ({'|'.join(PRESETS[vendor])}) algorithm=grpo data=gsm8k", text)
    assert f"portrl doctor --device {vendor}" in text and "| Fix |" in text


def test_parity_section_has_the_three_commands():
    for command in ("portrl parity ops --device D --dtype bfloat16 --report", "portrl parity replay --device D --golden",
                    "portrl parity compare"):
        assert command in (DOCS / "parity.md").read_text()


@pytest.mark.parametrize("vendor", ["cuda", "rocm", "npu"])
def test_vendor_train_in_the_image_mounts_and_names_its_data(vendor):
    """The image's train command: the device flags, a mount for every file it reads or writes (GSM8K as
    `portrl preprocess gsm8k` wrote it on the host, the model, the run folder), and no trainer.num_workers
    (auto: every device the container sees)."""
    text = section(vendor)
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "docker run" in b and " train " in b)
    run = block[block.index("docker run"):]
    for flag in FLAGS[vendor]:
        assert flag in run, f"{vendor}: the train docker run lacks {flag}"
    preprocess = re.search(r'portrl preprocess gsm8k --input \S+ --output-dir "?\$HOME/data/gsm8k"?', block)
    assert preprocess and preprocess.start() < block.index("docker run"), f"{vendor}: no preprocess line first"
    mounts = dict(m[::-1] for m in re.findall(r'-v "?([^\s":]+):([^\s":]+)', run))  # container dir -> host dir
    assert mounts.get("/data") == "$HOME/data", f"{vendor}: the data folder is not mounted at /data"
    paths = (re.findall(r"data\.(?:train|val)_files=\[([^\]]+)\]", run)
             + re.findall(r"(?:model\.path|output_dir)=(\S+)", run))
    assert "/data/gsm8k/train.parquet" in paths  # validation: the test.parquet beside it (Train your own model)
    for path in paths:
        assert any(path.startswith(dst + "/") for dst in mounts), f"{vendor}: {path} is not under a mounted folder"
    assert re.search(rf"portrl:{vendor} train --preset ({'|'.join(PRESETS[vendor])}) algorithm=grpo data=gsm8k", run)
    assert "num_workers" not in "".join(re.findall(r"```bash\n(.*?)```", text, re.S))
