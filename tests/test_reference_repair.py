"""One damaged file does not make a run unrecoverable: the run's reference copy (``checkpoints/reference``, pinned
by every checkpoint) damaged or missing is rebuilt by a resume from the model source when that still gives the
pinned bytes, the resume then continuing exactly as an undamaged one, the damaged copy kept aside; when the source
does not give them, one line names the damaged file and the recovery, and nothing is changed."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from portrl.trainer.checkpoint import CheckpointError, CheckpointManager, verify
from portrl.trainer.checkpoint_io import load_state

VOLATILE = ("timing_s/", "perf/", "memory/")  # measurements of the machine, not of the run


def _cfg(model, out, **over):
    from omegaconf import OmegaConf

    from portrl.config.options_schema import default_config

    c = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": str(model), "trainer.output_dir": str(out),
            "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
            "data.max_response_length": 4, "rollout.n": 2, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 1e-3,
            "actor.use_kl_loss": True, "trainer.total_steps": 1, "trainer.save_freq": 1, "trainer.test_freq": 0,
            "trainer.val_before_train": False, "trainer.progress_bar": False, "trainer.loggers": ["jsonl"],
            "trainer.plot": False, "trainer.export_hf": False, "trainer.seed": 3}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(c, k, v)
    return c


def _step(out, step):
    """(metrics logged at ``step`` less the machine's measurements, the actor's weights in its checkpoint)."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if r["step"] == step]
    return metrics, load_state(Path(out) / "checkpoints" / f"global_step_{step}", "actor")["model"]


def _tree(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny KL run saved at step 1 (checkpoints/global_step_1 + reference), and what an undamaged resume logs and
    saves at step 2."""
    from portrl.models import write_tiny_model
    from portrl.trainer import run_training

    base = tmp_path_factory.mktemp("refrun")
    model = write_tiny_model(base / "tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, seed=0, initializer_range=0.2)
    run_training(_cfg(model, base / "run"))
    assert (base / "run" / "checkpoints" / "reference").is_dir()
    shutil.copytree(base / "run", base / "undamaged")
    s = run_training(_cfg(model, base / "undamaged", **{"trainer.total_steps": 2}))
    assert s["resumed_from"].endswith("global_step_1")
    return model, base / "run", _step(base / "undamaged", 2)


def _copy(saved_run, tmp_path):
    model, run, expected = saved_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return model, out, expected


def _same_as_undamaged(out, expected):
    metrics, weights = _step(out, 2)
    assert metrics == expected[0] and len(metrics) == 1
    assert weights.keys() == expected[1].keys() and all(torch.equal(weights[k], v) for k, v in expected[1].items())


def test_a_flipped_byte_in_the_reference_is_rebuilt_and_the_resume_continues_as_undamaged(saved_run, tmp_path):
    from portrl.trainer import run_training

    model, out, expected = _copy(saved_run, tmp_path)
    ref = out / "checkpoints" / "reference"
    good = _tree(ref)
    data = bytearray((ref / "ref.safetensors").read_bytes())
    data[-1] ^= 0x01
    (ref / "ref.safetensors").write_bytes(bytes(data))
    s = run_training(_cfg(model, out, **{"trainer.total_steps": 2}))  # trainer.resume=auto
    assert s["resumed_from"].endswith("global_step_1") and s["steps"] == 2
    _same_as_undamaged(out, expected)
    assert _tree(ref) == good  # the pinned copy, byte for byte
    assert verify(out / "checkpoints" / "global_step_2", with_reference=True) is None
    kept = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("reference.damaged-")]
    assert len(kept) == 1 and (kept[0] / "ref.safetensors").read_bytes() == bytes(data)  # kept aside, not deleted


def test_a_missing_reference_is_rebuilt_for_resume_path_and_the_preflight_passes(saved_run, tmp_path):
    from portrl.trainer import run_training
    from portrl.trainer.run_dir import check_run_dir

    model, out, expected = _copy(saved_run, tmp_path)
    ref = out / "checkpoints" / "reference"
    good = _tree(ref)
    shutil.rmtree(ref)
    cfg = _cfg(model, out, **{"trainer.total_steps": 2, "trainer.resume": str(out / "checkpoints" / "global_step_1")})
    check_run_dir(cfg)  # portrl train's preflight: no refusal
    s = run_training(cfg)
    assert s["resumed_from"].endswith("global_step_1") and s["steps"] == 2
    _same_as_undamaged(out, expected)
    assert _tree(ref) == good
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step_1", "global_step_2", "reference"]


def test_a_reference_the_source_no_longer_gives_is_named_with_its_recovery(saved_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from portrl.trainer import run_training

    model, out, _ = _copy(saved_run, tmp_path)
    ref = out / "checkpoints" / "reference"
    data = bytearray((ref / "ref.safetensors").read_bytes())
    data[-1] ^= 0x01
    (ref / "ref.safetensors").write_bytes(bytes(data))
    before = _tree(out)
    weights_file = Path(model) / "model.safetensors"
    original = weights_file.read_bytes()
    changed = load_file(str(weights_file))
    name = sorted(changed)[0]
    changed[name] = changed[name] + 1e-3  # model.path now holds other weights
    try:
        save_file(changed, str(weights_file), metadata={"format": "pt"})
        with pytest.raises(CheckpointError) as err:
            run_training(_cfg(model, out, **{"trainer.total_steps": 2}))
    finally:
        weights_file.write_bytes(original)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{ref / 'ref.safetensors'} sha256 differs" in msg and f"model.path={model}" in msg, msg
    assert "no longer gives the same one" in msg and "restore" in msg and "backup" in msg and "new run" in msg, msg
    assert _tree(out) == before  # nothing set aside, written or left half-done


def test_a_lost_manifest_is_written_again_byte_for_byte_from_the_pin(tmp_path):
    """The pin holds the reference's manifest: with its manifest.json gone the rebuilt copy still has the pinned
    sha256; a pin of the hash alone (older checkpoints) cannot check a rebuild, and says so, changing nothing."""
    from portrl.trainer.reference_repair import restore_reference

    def write(d):
        (d / "ref.bin").write_bytes(b"weights")

    mgr = CheckpointManager(tmp_path)
    pin = mgr.save_reference(write)
    ref = tmp_path / "reference"
    good = _tree(ref)
    assert restore_reference(tmp_path, pin, write, "src") is None  # intact: nothing written
    (ref / "manifest.json").unlink()
    kept = restore_reference(tmp_path, pin, write, "src")
    assert _tree(ref) == good and kept.name.startswith("reference.damaged-")
    assert _tree(kept) == {"ref.bin": good["ref.bin"]}  # the damaged copy, kept aside
    shutil.rmtree(kept)
    (ref / "manifest.json").unlink()
    hash_only = {k: v for k, v in pin.items() if k != "manifest"}
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"manifest.json is missing.*cannot be checked: restore .*backup"):
        restore_reference(tmp_path, hash_only, write, "src")
    assert _tree(tmp_path) == before
