"""The user documentation: a short README, a MkDocs site that builds, the install CI runs is the README's, and the
claims stay honest (what has run on real hardware; no internal run labels)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
USER_DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    return [p for value in node.values() for p in nav_pages(value)]


def test_readme_is_short():
    assert len(README.splitlines()) < 250


def test_every_docs_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["name"] == "material"
    pages = set(nav_pages(config["nav"]))
    files = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert files == pages


def test_ci_installs_and_tests_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    install = next(line for line in ci.splitlines() if line.startswith("pip install"))
    assert install in README and "docs" in install
    test = next(line for line in ci.splitlines() if line.startswith("python -m pytest") and "not slow" in line)
    assert test in README
    assert "mkdocs build --strict" in ci and "mkdocs build --strict" in README
    extra = re.search(r"^docs = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra and "mkdocs>=" in extra.group(1) and "mkdocs-material>=" in extra.group(1)


def test_readme_says_what_has_run_on_real_hardware():
    words = " ".join(README.split())
    assert "tested on the CPU with fakes" in words
    assert "has run on real hardware" in README
    for vendor in ("CPU", "NVIDIA", "AMD", "Huawei Ascend"):
        assert re.search(rf"^\| {vendor}", README, re.M), f"no support row for {vendor}"
    assert "shows, with numbers" not in README


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_carry_no_internal_run_labels(path):
    text = path.read_text()
    labels = re.findall(r"\bruns? [A-Z]\b[^a-z]|\b[A-Z]: \d", text)  # "runs N, O", "run L)", "Z: 0.46"
    assert not labels, f"{path.name}: internal run labels {labels}"


def test_benchmark_results_hold_the_current_figures_of_every_benchmark():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert len(results.splitlines()) <= 400, "benchmarks/RESULTS.md: current results only; the history stays in git"
    assert "git log -p benchmarks/RESULTS.md" in results
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("[!_]*.py")) if f"`{p.name}`" not in results]
    assert not missing, f"benchmarks/RESULTS.md has no result of {missing}"
    assert "`benchmarks/RESULTS.md`" in (ROOT / "docs" / "performance.md").read_text()


@pytest.mark.skipif(shutil.which("mkdocs") is None and not Path(sys.executable).with_name("mkdocs").exists(),
                    reason="the docs extra is not installed")
def test_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).with_name("mkdocs"))
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
