"""Run identity: trainer.resume=auto continues only its own run; another run's folder is refused naming the keys that
differ (or moved aside on request); resume=off never overwrites a finished run; a truncated newest checkpoint falls
back to the previous one, and so does one re-hashed over content that does not load; a changed learning rate is
applied and logged; a failed launch changes nothing."""

import hashlib
import json
import logging
import shutil

import pytest
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.errors import UserError
from portrl.trainer.checkpoint import CheckpointError
from portrl.trainer.run_identity import fingerprint, identity_diff, run_identity


def _cfg(model, out, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": model, "trainer.output_dir": str(out),
            "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
            "data.max_response_length": 4, "rollout.n": 2, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 1e-3,
            "trainer.total_steps": 2, "trainer.save_freq": 1, "trainer.test_freq": 2, "trainer.seed": 3,
            "trainer.progress_bar": False, "trainer.loggers": ["jsonl"], "trainer.plot": False,
            "trainer.export_hf": False}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _tree(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _steps(out):
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tiny_model, tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    from portrl.trainer import run_training

    out = tmp_path_factory.mktemp("finished") / "run"
    run_training(_cfg(tiny_model, out))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step_1", "global_step_2"]
    return out


@pytest.fixture
def run_dir(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# --------------------------------------------------------------------------------------------- units
def test_identity_keys_and_the_keys_that_may_change():
    cfg = default_config()
    ident = run_identity(cfg)
    assert ident["model.path"] == "<tiny>" and "model.tiny.hidden_size" in ident and "algorithm.adv_estimator" in ident
    for key, value in (("trainer.total_steps", 99), ("actor.optim.lr", 5e-4), ("trainer.loggers", ["console"]),
                       ("trainer.test_freq", 1), ("trainer.save_freq", 7), ("data.val_files", ["v.parquet"]),
                       ("trainer.num_workers", 2), ("trainer.output_dir", "elsewhere")):
        other = default_config()
        OmegaConf.update(other, key, value)
        assert fingerprint(run_identity(other)) == fingerprint(ident), key
    for key, value in (("trainer.seed", 1), ("model.path", "/models/x"), ("data.train_batch_size", 8),
                       ("rollout.n", 8), ("actor.ppo_mini_batch_size", 2), ("algorithm.adv_estimator", "rloo"),
                       ("data.train_files", ["t.parquet"]), ("data.max_response_length", 64)):
        other = default_config()
        OmegaConf.update(other, key, value)
        assert fingerprint(run_identity(other)) != fingerprint(ident), key
    other = default_config()
    OmegaConf.update(other, "trainer.seed", 4)
    assert identity_diff(ident, run_identity(other)) == ["trainer.seed: 0 -> 4"]


# ---------------------------------------------------------------------------------------- end to end
def test_a_different_run_is_refused_naming_what_differs(tiny_model, run_dir):
    from portrl.trainer import run_training

    before = _tree(run_dir)
    with pytest.raises(CheckpointError) as err:
        run_training(_cfg(tiny_model, run_dir, **{"trainer.seed": 4, "rollout.n": 4}))
    msg = str(err.value)
    assert isinstance(err.value, UserError)
    assert "holds a different run (rollout.n: 2 -> 4; trainer.seed: 3 -> 4)" in msg
    assert "fresh trainer.output_dir" in msg and "trainer.on_existing_run=move_aside" in msg
    (run_dir / "run.json").unlink()  # no run record: the checkpoints still say whose they are
    with pytest.raises(CheckpointError, match=r"global_step_2 belongs to a different run \(trainer.seed: 3 -> 4\)"):
        run_training(_cfg(tiny_model, run_dir, **{"trainer.seed": 4}))
    before.pop("run.json")
    assert _tree(run_dir) == before
    s = run_training(_cfg(tiny_model, run_dir, **{"trainer.seed": 4, "trainer.total_steps": 1,
                                                  "trainer.on_existing_run": "move_aside"}))
    assert "resumed_from" not in s and _steps(run_dir) == [0, 1]  # a new run; the old one kept whole beside it
    assert [_tree(p) for p in run_dir.parent.iterdir() if p.name.startswith("run.old-")] == [before]


def test_resume_off_into_a_finished_run_refuses_or_moves_it_aside(tiny_model, run_dir):
    from portrl.trainer import run_training

    before = _tree(run_dir)
    with pytest.raises(CheckpointError, match=r"holds an earlier run \(run.json, metrics.jsonl, 2 checkpoints\) and "
                                              r"trainer.resume=off starts a new one"):
        run_training(_cfg(tiny_model, run_dir, **{"trainer.resume": "off"}))
    assert _tree(run_dir) == before
    old_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    s = run_training(_cfg(tiny_model, run_dir, **{"trainer.resume": "off", "trainer.on_existing_run": "move_aside",
                                                  "trainer.total_steps": 1}))
    assert s["steps"] == 1 and "resumed_from" not in s
    aside = [p for p in run_dir.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and _tree(aside[0]) == before  # the old run, whole
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != old_id
    assert _steps(run_dir) == [0, 1]
    with pytest.raises(CheckpointError, match="trainer.on_existing_run='keep' is not valid; valid: refuse, move_aside"):
        run_training(_cfg(tiny_model, run_dir, **{"trainer.on_existing_run": "keep"}))


def test_a_folder_of_unknown_identity_is_refused(tiny_model, run_dir):
    from portrl.trainer import run_training

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "run.json").unlink()  # e.g. a finished run without checkpoints, written before run.json existed
    with pytest.raises(CheckpointError, match=r"holds a run of unknown identity \(metrics.jsonl; no run.json\)"):
        run_training(_cfg(tiny_model, run_dir))


def test_truncated_newest_checkpoint_resumes_from_the_previous(tiny_model, run_dir, caplog):
    from portrl.trainer import run_training

    newest = run_dir / "checkpoints" / "global_step_2" / "actor.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        s = run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 3}))
    assert s["resumed_from"].endswith("global_step_1") and s["steps"] == 3
    assert "global_step_2 is unusable (actor.safetensors has 100 bytes" in caplog.text
    assert _steps(run_dir) == [0, 1, 2, 3]  # the old step-2 line replaced, not duplicated
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_2", "global_step_3"]


def test_all_checkpoints_unusable_stops_with_a_list(tiny_model, run_dir):
    from portrl.trainer import run_training

    (run_dir / "checkpoints" / "global_step_2" / "manifest.json").write_text('{"step": 2, "files": []}')
    (run_dir / "checkpoints" / "global_step_1" / "trainer.json").write_text("{}")
    before = _tree(run_dir)
    with pytest.raises(CheckpointError) as err:
        run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 3}))
    msg = str(err.value)
    assert "found no usable checkpoint" in msg and "global_step_2: manifest.json has no 'meta'" in msg
    assert "global_step_1: trainer.json has 2 bytes" in msg
    assert _tree(run_dir) == before


def test_a_changed_learning_rate_is_applied_and_logged(tiny_model, run_dir, caplog):
    from portrl.trainer import run_training

    with caplog.at_level(logging.WARNING):
        run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 3, "actor.optim.lr": 5e-4}))
    assert "actor.optim.lr changed since the checkpoint (0.001 -> 0.0005)" in caplog.text
    rows = {json.loads(x)["step"]: json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert rows[2]["actor/lr"] == pytest.approx(1e-3) and rows[3]["actor/lr"] == pytest.approx(5e-4)


def test_a_failed_launch_leaves_the_finished_run_unchanged(tiny_model, run_dir, monkeypatch):
    from portrl.trainer import run_training
    from portrl.trainer.rl_trainer import RLTrainer

    before = _tree(run_dir)

    def boom(self, step):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(RLTrainer, "train_step", boom)
    with pytest.raises(RuntimeError, match="launch failed"):  # resumed, fails in its first step
        run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 4}))
    assert _tree(run_dir) == before
    shutil.rmtree(run_dir / "checkpoints")  # a run of this identity without checkpoints starts over ...
    before = _tree(run_dir)
    monkeypatch.setattr(RLTrainer, "validate", lambda self, step: boom(self, step))
    with pytest.raises(RuntimeError, match="launch failed"):  # ... and fails before it logs anything
        run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 4}))
    assert _tree(run_dir) == before and _steps(run_dir) == [0, 1, 2]


def test_the_refusals_come_before_any_model_loads(tiny_model, run_dir, capsys):
    """`portrl train` checks the run folder in its preflight (no checksum, nothing changed) and the error is one
    line with exit code 2."""
    from portrl.cli import main
    from portrl.trainer.run_dir import check_run_dir

    before = _tree(run_dir)
    with pytest.raises(CheckpointError, match=r"holds a different run \(trainer.seed: 3 -> 4\)"):
        check_run_dir(_cfg(tiny_model, run_dir, **{"trainer.seed": 4}))
    check_run_dir(_cfg(tiny_model, run_dir, **{"trainer.seed": 4, "trainer.on_existing_run": "move_aside"}))
    check_run_dir(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 9}))  # its own run: fine
    assert _tree(run_dir) == before
    argv = ["train", "device.name=cpu", f"model.path={tiny_model}", f"trainer.output_dir={run_dir}",
            "data.arith.num_train=64", "data.arith.num_test=8", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "trainer.resume=off"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("portrl train: error: trainer.output_dir=") and "holds an earlier run" in err
    assert "Traceback" not in err and _tree(run_dir) == before



def test_resume_from_an_older_checkpoint_of_the_same_folder_is_refused(tiny_model, run_dir, tmp_path):
    """A continuation from step 1 next to the run's step-2 checkpoint would be mixed with it (resume=auto takes the
    highest step); resuming a copy in a fresh folder works."""
    from portrl.trainer import run_training

    older = run_dir / "checkpoints" / "global_step_1"
    with pytest.raises(CheckpointError, match=r"has newer checkpoints \(global_step_2\)"):
        run_training(_cfg(tiny_model, run_dir, **{"trainer.resume": str(older)}))
    fresh = tmp_path / "branch"
    s = run_training(_cfg(tiny_model, fresh, **{"trainer.resume": str(older), "trainer.total_steps": 3}))
    assert s["resumed_from"] == str(older) and s["steps"] == 3 and _steps(fresh) == [2, 3]
    assert json.loads((fresh / "run.json").read_text())["identity"] == json.loads(
        (run_dir / "run.json").read_text())["identity"]


def _craft(ckpt, damage):
    """Damage checkpoint ``ckpt``'s content, then recompute its manifest so that every sha256 matches: what a
    crafted (or re-hashed) checkpoint looks like to the integrity check."""
    from safetensors.torch import load_file, save_file

    from portrl.trainer.checkpoint import write_manifest

    actor = ckpt / "actor.safetensors"
    if damage == "safetensors-header":
        raw = bytearray(actor.read_bytes())
        size = int.from_bytes(raw[:8], "little")
        raw[8:8 + size] = b"{" + b"x" * (size - 1)  # the header is no longer JSON
        actor.write_bytes(bytes(raw))
    elif damage == "trainer-json":
        (ckpt / "trainer.json").write_text('{"step": 2, "data": ')
    elif damage == "trainer-state":
        (ckpt / "trainer.json").write_text('{"step": 2}')  # valid JSON, but no data position, RNG or KL
    elif damage == "wrong-shape":
        tensors = load_file(str(actor))
        name = next(k for k in sorted(tensors) if k.startswith("model.") and tensors[k].ndim == 2)
        tensors[name] = tensors[name][:-1].contiguous()  # a row short of the model's
        save_file(tensors, str(actor))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    write_manifest(ckpt, manifest["step"], manifest["meta"])


@pytest.mark.parametrize("damage, reason", [
    ("safetensors-header", "actor.safetensors is not a valid safetensors file"),
    ("trainer-json", "trainer.json is not valid JSON"),
    ("trainer-state", "trainer.json"),
    ("wrong-shape", "actor state does not fit"),
])
def test_a_rehashed_checkpoint_that_does_not_load_falls_back_like_a_damaged_one(tiny_model, finished, run_dir, tmp_path,
                                                                                 caplog, capsys, damage, reason):
    """Bad content under a manifest that matches it (re-hashed): resume=auto skips it with a warning naming the
    checkpoint and why, and resumes from the previous one, as it does for a hash mismatch (what the bad one loaded
    before it failed is all replaced: step 2 is replayed as the run first made it); named with trainer.resume=PATH
    it is an error instead, and so is one `portrl eval --checkpoint` names."""
    from portrl.trainer import run_training

    newest = run_dir / "checkpoints" / "global_step_2"
    _craft(newest, damage)
    branch = tmp_path / "branch"
    with pytest.raises(CheckpointError, match=rf"checkpoint {newest} is unusable: .*{reason}"):
        run_training(_cfg(tiny_model, branch, **{"trainer.resume": str(newest), "trainer.total_steps": 3}))
    if damage in ("safetensors-header", "wrong-shape"):  # the policy: `portrl eval` refuses it in one line too
        from portrl.cli import main

        argv = ["eval", "device.name=cpu", "device.num_threads=1", f"model.path={tiny_model}",
                "data.arith.num_test=8", "--checkpoint", str(newest)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"portrl eval: error: checkpoint {newest} is unusable: ") and reason in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with caplog.at_level(logging.WARNING):
        s = run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 3}))
    assert s["resumed_from"].endswith("global_step_1") and s["steps"] == 3
    assert f"checkpoint {newest} is unusable" in caplog.text and reason in caplog.text
    assert _steps(run_dir) == [0, 1, 2, 3]
    assert _row(run_dir, 2) == _row(finished, 2)


def _row(out, step):
    """Step ``step``'s metrics line without the machine's measurements (times, throughput, memory)."""
    row = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] == step)
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "memory/"))}


def test_no_checkpoint_that_loads_stops_with_the_list(tiny_model, run_dir):
    """When every checkpoint is re-hashed bad content, resume=auto stops listing each with its reason, as it does when
    none is intact, and starts nothing over."""
    from portrl.trainer import run_training

    root = run_dir / "checkpoints"
    _craft(root / "global_step_2", "safetensors-header")
    _craft(root / "global_step_1", "trainer-json")
    with pytest.raises(CheckpointError) as err:
        run_training(_cfg(tiny_model, run_dir, **{"trainer.total_steps": 3}))
    msg = str(err.value)
    assert "found no usable checkpoint" in msg and "rather than silently start over" in msg
    assert f"{root / 'global_step_2'}: actor.safetensors is not a valid safetensors file" in msg
    assert f"{root / 'global_step_1'}: trainer.json is not valid JSON" in msg
    assert _steps(run_dir) == [0, 1, 2] and sorted(p.name for p in root.iterdir()) == ["global_step_1", "global_step_2"]
