"""Safe checkpoints: the safetensors + JSON format round-trips a worker's whole state exactly; loading never
unpickles (a crafted pickle is refused and never runs); corrupt, truncated and malformed checkpoints are skipped
for the previous one; old and future formats are refused naming their version; rotation keeps the newest intact
checkpoints and never the one just written; when none is usable, resume=auto lists them instead of starting over.
Checkpoints whose files match a re-hashed manifest but do not load: tests/test_run_identity.py."""

import hashlib
import json
import logging
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from portrl.errors import UserError
from portrl.trainer.checkpoint import CheckpointError, CheckpointManager, open_checkpoint, verify, write_manifest
from portrl.trainer.checkpoint_io import FORMAT_VERSION, load_state, save_state


class _Marker:
    """Unpickling this creates the file at ``path``: what a crafted checkpoint would do with os.system."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _crafted_pickle(marker) -> bytes:
    return pickle.dumps({"model": _Marker(marker)})


def _writer(payload: bytes):
    def write(d):
        (d / "model.bin").write_bytes(payload)
    return write


# ------------------------------------------------------------------------------------------- format
def test_worker_state_round_trips_exactly(tmp_path):
    """Model (tied weights), AdamW state and hyper-parameters, LambdaLR, the three RNG states, counters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight  # tied, as lm_head / embed_tokens
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sched.step()
    random.seed(5)
    np.random.seed(6)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
             "update_count": 3, "kl_coef": None, "data": {"epoch": 1, "position": 8, "shuffle": True}}
    save_state(tmp_path, "actor", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor.json", "actor.safetensors"]
    got = load_state(tmp_path, "actor")
    assert got["model"].keys() == state["model"].keys()
    assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # betas come back a tuple
    assert all(torch.equal(got["optimizer"]["state"][0][k], v) for k, v in state["optimizer"]["state"][0].items())
    assert got["scheduler"] == state["scheduler"] and got["update_count"] == 3 and got["data"] == state["data"]
    # the RNG states restore: the next draws are the same
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.set_rng_state(got["rng"]["torch"])
    random.setstate(got["rng"]["python"])
    np.random.set_state(got["rng"]["numpy"])
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]
    # a fresh optimizer and scheduler load it
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt2.load_state_dict(got["optimizer"])
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5)
    sched2.load_state_dict(got["scheduler"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95) and sched2.last_epoch == 1


def test_views_transposes_and_shared_storage_round_trip(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    state = {"a": base, "row": base[1], "t": base.t(), "same": base, "empty": torch.zeros(0),
             "u8": torch.get_rng_state()}
    save_state(tmp_path, "s", state)
    got = load_state(tmp_path, "s")
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())


def test_a_pickle_in_place_of_a_state_file_is_refused_and_never_runs(tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(_crafted_pickle(proof))  # the payload works: unpickling it does create its file
    assert proof.exists()
    marker = tmp_path / "pwned"
    save_state(tmp_path, "actor", {"w": torch.ones(2)})
    (tmp_path / "actor.safetensors").write_bytes(_crafted_pickle(marker))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_state(tmp_path, "actor")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ readers
@pytest.mark.parametrize("damage, problem", [
    ("files-a-list", "'files' is a list"),
    ("size-a-string", "size of model.bin is '6'"),
    ("sha-not-hex", "not a sha256 hex digest"),
    ("step-a-string", "'step' is a str"),
    ("no-meta", "has no 'meta'"),
    ("path-escapes", "outside the checkpoint"),
    ("not-an-object", "not a JSON object"),
])
def test_malformed_manifest_falls_back_like_a_missing_one(tmp_path, caplog, damage, problem):
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    mgr.save(1, _writer(b"first"), {})
    bad = mgr.save(2, _writer(b"second"), {})
    m = json.loads((bad / "manifest.json").read_text())
    entry = m["files"]["model.bin"]
    if damage == "files-a-list":
        m["files"] = [m["files"]]
    elif damage == "size-a-string":
        entry["size"] = "6"
    elif damage == "sha-not-hex":
        entry["sha256"] = "zz"
    elif damage == "step-a-string":
        m["step"] = "2"
    elif damage == "no-meta":
        del m["meta"]
    elif damage == "path-escapes":
        m["files"] = {"../model.bin": entry}
    else:
        m = [m]
    (bad / "manifest.json").write_text(json.dumps(m))
    assert problem in verify(bad)
    with caplog.at_level(logging.WARNING, logger="portrl.trainer.checkpoint"):
        assert mgr.resolve_auto().name == "global_step_1"
    assert "global_step_2" in caplog.text and problem in caplog.text
    with pytest.raises(CheckpointError, match="unusable"):
        open_checkpoint(bad)  # a named checkpoint (eval --checkpoint, resume=PATH) is an error instead


def test_every_checkpoint_unusable_is_an_error_listing_them(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    one, two = mgr.save(1, _writer(b"first"), {}), mgr.save(2, _writer(b"second"), {})
    (one / "model.bin").write_bytes(b"f")  # truncated
    (two / "manifest.json").unlink()  # partial
    with pytest.raises(CheckpointError) as err:
        mgr.resolve_auto()
    msg = str(err.value)
    assert isinstance(err.value, UserError)
    assert f"{one}: model.bin has 1 bytes" in msg and f"{two}: no manifest.json" in msg
    assert "rather than silently start over" in msg


def test_checkpoints_found_unusable_as_they_loaded_are_skipped_like_damaged_ones(tmp_path, caplog):
    """resolve_auto's ``skip``: checkpoints whose files matched their manifest but did not load (resume_run found
    them) are passed over for the previous intact one, and listed with their problems when none is left."""
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    one, two = mgr.save(1, _writer(b"first"), {}), mgr.save(2, _writer(b"second"), {})
    assert verify(two) is None
    with caplog.at_level(logging.WARNING, logger="portrl.trainer.checkpoint"):
        assert mgr.resolve_auto(skip={two: "actor.safetensors is not a valid safetensors file"}) == one
    assert "resuming from" in caplog.text and f"{two} is unusable" not in caplog.text  # resume_run warned already
    with pytest.raises(CheckpointError) as err:
        mgr.resolve_auto(skip={two: "bad header", one: "trainer.json is not valid JSON"})
    assert f"{two}: bad header; {one}: trainer.json is not valid JSON" in str(err.value)


def _legacy_checkpoint(root, marker):
    """A checkpoint as portrl wrote it before format 1: pickled actor.pt / trainer.pt, no format in the manifest
    (its manifest is intact: only the format is old). Unpickling actor.pt would create ``marker``."""
    path = root / "global_step_2"
    path.mkdir(parents=True)
    (path / "actor.pt").write_bytes(_crafted_pickle(marker))
    (path / "trainer.pt").write_bytes(pickle.dumps({"step": 2}))
    write_manifest(path, 2, {"step": 2})
    return path


def test_old_and_future_formats_are_refused_naming_the_version(tmp_path):
    marker = tmp_path / "pwned"
    mgr = CheckpointManager(tmp_path / "ckpt")
    old = _legacy_checkpoint(tmp_path / "ckpt", marker)
    assert verify(old) is None
    for call in (lambda: mgr.resolve_auto(), lambda: mgr.resolve_resume(str(old)), lambda: open_checkpoint(old)):
        with pytest.raises(CheckpointError, match=r"old pickled format \(actor.pt, trainer.pt; written by portrl "
                                                  r"0.1.0 or earlier\).*checkpoint format 1"):
            call()
    assert not marker.exists()
    new = CheckpointManager(tmp_path / "c2").save(1, _writer(b"x"), {"format": FORMAT_VERSION + 1,
                                                                      "portrl_version": "9.0"})
    with pytest.raises(CheckpointError, match=rf"has format {FORMAT_VERSION + 1} \(written by portrl 9.0\)"):
        open_checkpoint(new)


# ----------------------------------------------------------------------------------------- rotation
def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (5, 6):
        mgr.save(step, _writer(bytes([step])), {})
    written = mgr.save(3, _writer(b"3"), {})  # e.g. resumed from an explicit older checkpoint
    assert written.is_dir() and verify(written) is None
    assert [s for s, _ in mgr.checkpoints()] == [3, 6]


def test_rotation_keeps_the_newest_intact_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    mgr.save(1, _writer(b"1"), {})
    bad = mgr.save(2, _writer(b"2"), {})
    (bad / "model.bin").write_bytes(b"X")  # corrupt after it was written: not worth keeping over step 1
    fresh = CheckpointManager(tmp_path, max_to_keep=2)  # a resumed run's manager: verifies from disk
    fresh.save(3, _writer(b"3"), {})
    assert [s for s, _ in fresh.checkpoints()] == [1, 3]


# -------------------------------------------------------------------------------------- end to end
def _argv(model, out, *extra):
    return ["--log-level", "WARNING", "train", "device.name=cpu", "device.num_threads=1", f"model.path={model}",
            f"trainer.output_dir={out}", "data.arith.num_train=64", "data.arith.num_test=8", "data.train_batch_size=4",
            "data.max_response_length=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_steps=2",
            "trainer.test_freq=2", "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.plot=false",
            "trainer.export_hf=false", *extra]


def _tree(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_crafted_pickle_checkpoint_is_refused_by_train_and_eval(tiny_model, tmp_path):
    """Real `portrl` subprocesses: exit 2, one line naming the old format, no traceback, the pickle never runs."""
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    ckpt = _legacy_checkpoint(out / "checkpoints", marker)
    before = _tree(out)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PORTRL_CACHE=str(tmp_path / "cache"))
    code = "import sys; from portrl.cli import main; sys.exit(main(sys.argv[1:]))"
    evaluate = ["--log-level", "WARNING", "eval", "device.name=cpu", "device.num_threads=1", f"model.path={tiny_model}",
                "data.arith.num_test=8", "--checkpoint", str(ckpt)]
    for argv in (_argv(tiny_model, out), evaluate):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and "old pickled format" in r.stderr, r.stderr[-2000:]
        assert not marker.exists()
    assert _tree(out) == before  # nothing of the old run was touched


@pytest.mark.parametrize("sft", [False, True])
def test_the_reference_model_is_saved_once_and_pinned(tiny_model, tmp_path, capsys, sft):
    """The frozen reference (KL loss) is written once per run, not into every checkpoint: the starting model, or
    after an SFT warm start the post-SFT policy (which model.path does not hold). Resuming verifies it with the
    checkpoint; evaluating a checkpoint does not need it."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from portrl.cli import main
    from portrl.config.options_schema import default_config
    from portrl.trainer import run_training

    def cfg(**over):
        c = default_config()
        base = {"device.name": "cpu", "device.num_threads": 1, "model.path": tiny_model,
                "trainer.output_dir": str(tmp_path / "run"), "data.arith.num_train": 64, "data.arith.num_test": 8,
                "data.train_batch_size": 4, "data.max_response_length": 4, "rollout.n": 2,
                "actor.ppo_mini_batch_size": 4, "actor.use_kl_loss": True, "trainer.total_steps": 2,
                "trainer.save_freq": 1, "trainer.test_freq": 2, "trainer.progress_bar": False,
                "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": False,
                "model.sft_warm_start": sft, "model.sft_steps": 4, "model.sft_batch_size": 8, "model.sft_lr": 1e-2}
        base.update(over)
        for k, v in base.items():
            OmegaConf.update(c, k, v)
        return c

    run_training(cfg())
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", "global_step_2", "reference"]
    pins = {json.loads((root / f"global_step_{s}" / "manifest.json").read_text())["meta"]["reference"]
            ["manifest_sha256"] for s in (1, 2)}
    assert pins == {hashlib.sha256((root / "reference" / "manifest.json").read_bytes()).hexdigest()}
    assert all("ref" not in load_state(root / f"global_step_{s}", "actor") for s in (1, 2))
    ref = load_state(root / "reference", "ref")
    start = load_file(os.path.join(tiny_model, "model.safetensors"))
    same = all(torch.equal(ref[k].float(), start[k].float()) for k in start)
    assert same is (not sft)  # no SFT: the starting weights; SFT: the post-SFT policy
    # a damaged post-SFT reference cannot be rebuilt from model.path: the resume names the file and the recovery
    # (a damaged starting model is rebuilt: tests/test_reference_repair.py)
    target = root / "reference" / "ref.safetensors"
    good = target.read_bytes()
    target.write_bytes(good[:64])
    if sft:
        with pytest.raises(CheckpointError, match=r"reference/ref.safetensors has 64 bytes.*sft_warm_start.*"
                                                  r"restore .*ref.safetensors from a backup"):
            run_training(cfg(**{"trainer.total_steps": 3}))
    # evaluating a checkpoint copied without it works
    alone = tmp_path / "alone" / "global_step_2"
    import shutil

    shutil.copytree(root / "global_step_2", alone)
    argv = ["eval", "device.name=cpu", "device.num_threads=1", f"model.path={tiny_model}", "data.arith.num_test=8",
            "--checkpoint", str(alone)]
    assert main(argv) == 0, capsys.readouterr().err
    target.write_bytes(good)
    s = run_training(cfg(**{"trainer.total_steps": 3}))  # repaired: resumes, and the reference is not rewritten
    assert s["resumed_from"].endswith("global_step_2") and s["steps"] == 3
    assert json.loads((root / "global_step_3" / "manifest.json").read_text())["meta"]["reference"]["manifest_sha256"] \
        in pins
