"""No command deletes or overwrites what it did not write: every command that takes an output path refuses one that
holds something (one line, exit 2, the user's file intact), moves it aside when asked, and never replaces a path
that appeared while it ran (portrl.outputs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from portrl.cli import main
from portrl.outputs import OutputExists, claim, move_aside, publish

KEEP = "the user's notes\n"
Q = ["device.num_threads=1", "trainer.progress_bar=false"]


@pytest.fixture
def quiet_cwd(monkeypatch, tmp_path):
    """Any model load fails the test (each refusal comes before one); the tiny model cache is private."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started: a model load was reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(argv: list[str]) -> int:
    try:
        return main(["--log-level", "WARNING", *argv])
    except SystemExit as exc:
        return int(exc.code)


def _metrics_run(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "critic/score/mean": 0.1 * s}) + "\n"
                                               for s in range(1, 4)))
    return run


def _ops_report(root: Path) -> Path:
    path = root / "cpu.json"
    path.write_text(json.dumps({"kind": "parity-ops", "backend": "cpu", "dtype": "float32", "cases": []}))
    return path


# (id, the user's path to plant: "file" | "dir", argv given that path as {out} and the fixture folder as {tmp})
CASES = [
    ("sft-output", "dir", ["sft", "--steps", "1", "--output", "{out}", *Q]),
    ("sft-default-output", "dir", ["sft", "--steps", "1", "trainer.output_dir={tmp}/outputs", *Q]),
    ("eval-report", "file", ["eval", "--report", "{out}", *Q]),
    ("preprocess-output-dir", "file", ["preprocess", "arith", "--n", "20", "--output-dir", "{tmp}"]),
    ("plot", "file", ["plot", "{tmp}/run"]),
    ("parity-ops-report", "file", ["parity", "ops", "--report", "{out}", "--op", "rmsnorm"]),
    ("parity-record-output", "dir", ["parity", "record", "--output", "{out}"]),
    ("parity-replay-report", "file", ["parity", "replay", "--golden", "{tmp}/nogolden", "--report", "{out}"]),
    ("parity-e2e-report", "file", ["parity", "e2e", "--report", "{out}"]),
    ("parity-rollout-report", "file", ["parity", "rollout", "--report", "{out}"]),
    ("parity-mesh-report", "file", ["parity", "mesh", "--report", "{out}"]),
    ("parity-compare-output", "file", ["parity", "compare", "{tmp}/cpu.json", "--output", "{out}"]),
    ("train-output-dir", "dir", ["train", "trainer.output_dir={out}", "trainer.resume=off", *Q]),
]
# where each command writes when the planted path is not its flag's value
PLANTED = {"sft-default-output": "outputs/sft", "preprocess-output-dir": "train.parquet", "plot": "run/plots/reward.png",
           "parity-compare-output": "out.md"}


def _plant(case: str, kind: str, tmp: Path) -> Path:
    path = tmp / PLANTED.get(case, "out")
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        path.mkdir()
        (path / "notes.txt").write_text(KEEP)
    else:
        path.write_text(KEEP)
    return path


def _kept(path: Path) -> bool:
    return (path / "notes.txt" if path.is_dir() else path).read_text() == KEEP


@pytest.mark.parametrize("case, kind, argv", CASES, ids=[c[0] for c in CASES])
def test_every_output_path_that_holds_something_is_refused(case, kind, argv, quiet_cwd, capsys):
    _metrics_run(quiet_cwd)
    _ops_report(quiet_cwd)
    planted = _plant(case, kind, quiet_cwd)
    before = sorted(p.name for p in quiet_cwd.iterdir())
    rc = _run([a.format(out=planted, tmp=quiet_cwd) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(planted) in lines[0] and ("move_aside" in lines[0]), lines[0]
    assert _kept(planted)
    assert sorted(p.name for p in quiet_cwd.iterdir()) == before  # nothing written, nothing moved


def test_every_command_with_an_output_path_is_in_the_table():
    """A command that gains an output flag (--output, --output-dir, --report) or --on-existing gets a row here."""
    import importlib

    from portrl.cli import COMMANDS, build_parser

    def flags(parser) -> set:
        return {o for a in parser._actions for o in a.option_strings}

    outputs = {"--output", "--output-dir", "--report", "--on-existing"}
    found = set()
    for name, (module, _) in COMMANDS.items():
        extra = getattr(importlib.import_module(f"portrl.cli.{module}"), "EXTRA", None)
        sub = next(a for a in build_parser(name)._actions if a.dest == "command").choices[name]
        if extra is not None and outputs & {o for args, _ in extra for o in args}:
            found.add(name)
        elif outputs & flags(sub):
            found.add(name)
        for action in sub._actions:  # parity's subcommands
            if action.dest == "parity_command":
                found |= {f"{name}-{s}" for s, p in action.choices.items() if outputs & flags(p)}
    covered = {c[0].split("-")[0] for c in CASES} | {"-".join(c[0].split("-")[:2]) for c in CASES}
    assert found - {"parity"} <= covered, found - covered
    assert len(found) >= 9


def test_move_aside_keeps_the_old_output_and_writes_the_new(quiet_cwd, capsys):
    planted = _plant("preprocess-output-dir", "file", quiet_cwd)
    rc = _run(["preprocess", "arith", "--n", "20", "--output-dir", str(quiet_cwd), "--on-existing", "move_aside"])
    assert rc == 0, capsys.readouterr().err
    olds = list(quiet_cwd.glob("train.parquet.old-*"))
    assert len(olds) == 1 and olds[0].read_text() == KEEP
    import pyarrow.parquet as pq

    assert pq.read_metadata(planted).num_rows == 18


def test_plot_rewrites_its_own_plots_and_refuses_others(quiet_cwd, capsys):
    run = _metrics_run(quiet_cwd)
    assert _run(["plot", str(run)]) == 0
    first = sorted(p.name for p in (run / "plots").iterdir())
    assert _run(["plot", str(run)]) == 0, capsys.readouterr().err  # its own PNGs (marked) are rewritten
    assert sorted(p.name for p in (run / "plots").iterdir()) == first
    (run / "plots" / first[0]).write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    assert _run(["plot", str(run)]) == 2
    assert _run(["plot", str(run), "--on-existing", "move_aside"]) == 0
    assert len(list((run / "plots").glob(f"{first[0]}.old-*"))) == 1


def test_claim_accepts_a_missing_path_and_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert claim(tmp_path / "empty", "--output") == tmp_path / "empty"
    assert claim(tmp_path / "none", "--output") == tmp_path / "none"
    os.symlink(tmp_path / "none", tmp_path / "dangling")
    with pytest.raises(OutputExists):  # a link is something the user made, even a dangling one
        claim(tmp_path / "dangling", "--output")


def test_publish_never_replaces_what_appeared_meanwhile(tmp_path):
    for kind in ("file", "dir"):
        out, tmp = tmp_path / f"out-{kind}", tmp_path / f".tmp-{kind}"
        if kind == "dir":
            tmp.mkdir()
            (tmp / "model.safetensors").write_text("new")
            out.mkdir()
            (out / "notes.txt").write_text(KEEP)
        else:
            tmp.write_text("new")
            out.write_text(KEEP)
        went = publish(tmp, out)
        assert went != out and went.name.startswith(f"out-{kind}.new-") and _kept(out)
        assert (went / "model.safetensors" if kind == "dir" else went).read_text() == "new"
    (tmp_path / "empty").mkdir()
    (tmp_path / ".tmp-e").mkdir()
    assert publish(tmp_path / ".tmp-e", tmp_path / "empty") == tmp_path / "empty"  # an empty folder is replaced


def test_move_aside_renames_and_never_deletes(tmp_path):
    (tmp_path / "out").write_text(KEEP)
    target = move_aside(tmp_path / "out")
    assert not (tmp_path / "out").exists() and target.read_text() == KEEP and target.name.startswith("out.old-")
    (tmp_path / "out").write_text(KEEP)
    assert move_aside(tmp_path / "out") != target  # a second one in the same second gets its own name
