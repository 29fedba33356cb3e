"""CheckpointManager: atomic writes, manifests, rotation, resume modes, corrupt/partial detection."""

import json
import logging
import os

import pytest

from portrl.trainer.checkpoint import CheckpointError, CheckpointManager, read_meta, verify


def _writer(payload: bytes):
    def write(d):
        (d / "model.bin").write_bytes(payload)
        (d / "sub").mkdir()
        (d / "sub" / "state.json").write_text(json.dumps({"n": len(payload)}))
    return write


def test_save_writes_manifest_with_sizes_and_hashes(tmp_path):
    import hashlib

    mgr = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
    path = mgr.save(3, _writer(b"abc"), {"step": 3, "note": "x"})
    assert path == tmp_path / "ckpt" / "global_step_3"
    m = read_meta(path)
    from portrl import __version__
    from portrl.trainer.checkpoint_io import FORMAT_VERSION

    assert m["step"] == 3 and m["meta"] == {"step": 3, "note": "x", "format": FORMAT_VERSION,
                                            "portrl_version": __version__}
    assert m["files"]["model.bin"] == {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}
    assert "sub/state.json" in m["files"]
    assert verify(path) is None
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["global_step_3"]  # no temp dir left


def test_only_last_k_kept(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 10):
        mgr.save(step, _writer(bytes([step])), {})
    assert [s for s, _ in mgr.checkpoints()] == [3, 10]  # numeric, not lexical, order
    assert mgr.latest_valid().name == "global_step_10"


def test_failed_write_leaves_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    mgr.save(1, _writer(b"ok"), {})

    def boom(d):
        (d / "half.bin").write_bytes(b"1")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, boom, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]
    assert mgr.latest_valid().name == "global_step_1"


def test_killed_write_temp_dir_is_ignored_and_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    mgr.save(1, _writer(b"ok"), {})
    stale = tmp_path / ".tmp_global_step_2_99999"  # what a SIGKILL during write_fn leaves
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"partial")
    assert mgr.latest_valid().name == "global_step_1"
    mgr.save(3, _writer(b"new"), {})
    assert not stale.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "delete_manifest", "bad_manifest"])
def test_corrupt_checkpoint_falls_back_to_previous(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    mgr.save(1, _writer(b"first"), {})
    bad = mgr.save(2, _writer(b"second"), {})
    target = bad / "model.bin"
    if damage == "truncate":
        target.write_bytes(b"sec")
    elif damage == "flip":
        target.write_bytes(b"secOnd")  # same size, different bytes
    elif damage == "delete_file":
        target.unlink()
    elif damage == "delete_manifest":
        (bad / "manifest.json").unlink()
    else:
        (bad / "manifest.json").write_text("{not json")
    assert verify(bad) is not None
    with caplog.at_level(logging.WARNING, logger="portrl.trainer.checkpoint"):
        assert mgr.latest_valid().name == "global_step_1"
    assert "global_step_2" in caplog.text and "unusable" in caplog.text
    assert mgr.resolve_resume("auto").name == "global_step_1"


def test_resolve_resume_modes(tmp_path):
    mgr = CheckpointManager(tmp_path / "c", max_to_keep=2)
    assert mgr.resolve_resume("auto") is None  # nothing yet: a fresh start
    first = mgr.save(5, _writer(b"a"), {})
    assert mgr.resolve_resume("off") is None
    assert mgr.resolve_resume("auto") == first
    assert mgr.resolve_resume(str(first)) == first
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        mgr.resolve_resume(str(tmp_path / "nope"))
    (first / "model.bin").write_bytes(b"zz")
    with pytest.raises(CheckpointError, match="unusable: model.bin"):
        mgr.resolve_resume(str(first))


def test_resave_same_step_replaces(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    mgr.save(4, _writer(b"old"), {})
    path = mgr.save(4, _writer(b"newer"), {"v": 2})
    assert (path / "model.bin").read_bytes() == b"newer" and read_meta(path)["meta"]["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["global_step_4"]


def test_torch_state_roundtrip(tmp_path):
    import torch

    from portrl.trainer.checkpoint_io import load_state, save_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, lambda d: save_state(d, "model", model.state_dict()), {})
    other = torch.nn.Linear(4, 2)
    other.load_state_dict(load_state(mgr.resolve_resume("auto"), "model"))
    assert torch.equal(other.weight, model.weight) and path.name == "global_step_1"


def test_bad_max_to_keep():
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager("x", max_to_keep=0)
