"""The CI parity matrix: ci/matrix.yaml is valid and .github/workflows/parity.yml is generated from it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / "ci" / "matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_matrix_has_the_four_legs(matrix):
    data = matrix.load_matrix()
    legs = {e["name"]: e for e in data["legs"]}
    assert set(legs) == {"cpu", "cuda-h100", "rocm-mi300x", "npu-910b"}
    assert data["reference"] == "cpu"
    assert {legs[n]["device"] for n in legs} == {"cpu", "cuda", "rocm", "npu"}
    assert set(legs["cpu"]["dtypes"]) == {"float32", "bfloat16"}
    for e in legs.values():
        assert e["image"] == f"docker/{e['device']}/Dockerfile"


def test_workflow_is_generated_from_matrix(matrix):
    assert matrix.main(["workflow", "--check"]) == 0, "run `python ci/matrix.py workflow`"
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "parity.yml").read_text())
    data = matrix.load_matrix()
    for e in data["legs"]:
        job = wf["jobs"][e["name"]]
        assert job["runs-on"] == e["runner"]
        run = job["steps"][2]["run"]
        assert f"ci/parity.sh {e['name']}" in run and " ".join(e["docker_args"].split()) in run
    assert wf["jobs"]["compare"]["needs"] == [e["name"] for e in data["legs"]]


def test_stale_workflow_is_detected(matrix, tmp_path, monkeypatch, capsys):
    text = (ROOT / "ci" / "matrix.yaml").read_text().replace("timeout_minutes: 90", "timeout_minutes: 91")
    (tmp_path / "matrix.yaml").write_text(text)
    data = yaml.safe_load(text)
    assert matrix.render_workflow(data) != matrix.render_workflow()
    wf = tmp_path / "parity.yml"
    wf.write_text(matrix.render_workflow(data))
    monkeypatch.setattr(matrix, "WORKFLOW", wf)
    assert matrix.main(["workflow", "--check"]) == 1
    assert "is stale" in capsys.readouterr().err


def test_bad_matrix_errors(matrix, tmp_path):
    good = yaml.safe_load((ROOT / "ci" / "matrix.yaml").read_text())
    cases = [
        (lambda d: d["legs"][0].update(tiers=["ops", "speed"]), "unknown tiers/dtypes"),
        (lambda d: d["legs"][1].update(image="docker/none/Dockerfile"), "does not exist"),
        (lambda d: d["legs"][1].update(preset="h999"), "not in configs/device"),
        (lambda d: d["legs"][1].pop("runner"), "expected exactly"),
        (lambda d: d.update(reference="tpu"), "has no leg"),
        (lambda d: d["legs"].append(dict(d["legs"][0])), "duplicate"),
    ]
    for mutate, msg in cases:
        data = yaml.safe_load(yaml.safe_dump(good))
        mutate(data)
        p = tmp_path / "m.yaml"
        p.write_text(yaml.safe_dump(data))
        with pytest.raises(ValueError, match=msg):
            matrix.load_matrix(p)


def test_leg_settings_for_parity_sh():
    out = subprocess.run([sys.executable, "ci/matrix.py", "leg", "rocm-mi300x"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "DEVICE=rocm" in out and "PRESET=mi300x" in out and "TIERS='ops replay e2e'" in out
    bad = subprocess.run([sys.executable, "ci/matrix.py", "leg", "tpu"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown leg 'tpu'" in bad.stderr
    assert subprocess.run(["bash", "-n", "ci/parity.sh"], cwd=ROOT).returncode == 0
