"""trainer.num_workers=null (the default): every device the chosen backend sees on this node, resolved once by
RLTrainer when the run starts (logged, recorded in its config) and checked by the preflight by the same rule; an
explicit value wins and keeps the check against the node; the CPU is one device."""

from __future__ import annotations

import logging
import sys

import pytest

from portrl.config import compose
from portrl.config.presets import ConfigError
from portrl.device.registry import clear_cache, get_backend
from portrl.errors import UserError
from portrl.trainer.preflight import TRAIN, preflight
from portrl.workers.setup import auto_num_workers, resolve_num_workers

#: a backend plugin whose device_count() reads its own visible-devices variable, as the vendor backends' torch
#: device modules do (4 devices when the variable is unset)
FAKE_PLUGIN = """
import os

from portrl.device import Backend, ProbeResult


class FakeAcceleratorBackend(Backend):
    name = "fakeacc"
    device_type = "fakeacc"
    dist_backend = "gloo"
    ray_resource = "GPU"
    visible_devices_env = "FAKEACC_VISIBLE_DEVICES"
    detect_priority = -100

    def device_count(self):
        visible = os.environ.get(self.visible_devices_env)
        return 4 if visible is None else len([d for d in visible.split(",") if d.strip()])

    def probe(self):
        return ProbeResult(True, device_count=self.device_count(), device_name="fake accelerator")

    def supports_bf16(self):
        return True

    def fp8_dtype(self):
        return None

    def memory_stats(self):
        return {}

    def reset_peak_memory(self):
        pass

    def memory_available(self):
        return None
"""


@pytest.fixture
def fake_backend(tmp_path, monkeypatch):
    """The plugin installed as a real distribution (dist-info with an entry point) on sys.path."""
    info = tmp_path / "portrl_fakeacc-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portrl_fakeacc\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portrl.backends]\nfakeacc = portrl_test_fakeacc:FakeAcceleratorBackend\n")
    (tmp_path / "portrl_test_fakeacc.py").write_text(FAKE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "portrl_test_fakeacc", raising=False)
    monkeypatch.delenv("FAKEACC_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    clear_cache()
    yield get_backend("fakeacc")
    monkeypatch.undo()
    clear_cache()


def _cfg(tmp_path, *overrides):
    return compose(overrides=[f"trainer.output_dir={tmp_path / 'run'}", *overrides])


def test_default_is_null_and_config_show_prints_it(tmp_path, capsys):
    from portrl.cli import main

    assert _cfg(tmp_path).trainer.num_workers is None
    assert main(["config", "show"]) == 0
    assert "num_workers: null" in capsys.readouterr().out


def test_auto_is_every_visible_device_of_the_node(fake_backend, tmp_path, monkeypatch, caplog):
    cfg = _cfg(tmp_path, "device=fakeacc")
    with caplog.at_level(logging.INFO, logger="portrl"):
        preflight(cfg, TRAIN)  # checks, logs nothing of it (a refused run prints its one error line only)
        assert "num_workers" not in caplog.text and cfg.trainer.num_workers is None
        assert resolve_num_workers(cfg, fake_backend) == 4  # what RLTrainer records before it builds its workers
    assert "trainer.num_workers=null -> 4 (4 fakeacc device(s) visible on this node)" in caplog.text

    monkeypatch.setenv("FAKEACC_VISIBLE_DEVICES", "0,1")  # the vendor's variable hides two
    assert resolve_num_workers(_cfg(tmp_path, "device=fakeacc"), fake_backend) == 2


def test_an_explicit_value_wins_and_is_checked_against_the_node(fake_backend, tmp_path, caplog):
    cfg = _cfg(tmp_path, "device=fakeacc", "trainer.num_workers=3")
    preflight(cfg, TRAIN)
    with caplog.at_level(logging.INFO, logger="portrl"):
        assert resolve_num_workers(cfg, fake_backend) == 3
    assert "num_workers" not in caplog.text
    with pytest.raises(UserError, match=r"^trainer.num_workers=8 needs 8 fakeacc devices, this node has 4; set "
                                        r"trainer.num_workers<=4, or null \(auto"):
        preflight(_cfg(tmp_path, "device=fakeacc", "trainer.num_workers=8"), TRAIN)


def test_auto_above_one_needs_ray(fake_backend, tmp_path, monkeypatch):
    import portrl.trainer.preflight as preflight_mod

    monkeypatch.setattr(preflight_mod, "module_available", lambda name: name != "ray")
    with pytest.raises(UserError, match=r"^trainer.num_workers=null \(auto\) is 4 here \(4 fakeacc device\(s\) "
                                        r"visible on this node\): more than one worker runs on Ray, but ray is not"):
        preflight(_cfg(tmp_path, "device=fakeacc"), TRAIN)


@pytest.mark.parametrize("overrides, want, why", [
    (["trainer.nnodes=2"], 8, "4 fakeacc device(s) visible on this node x trainer.nnodes=2"),
    (["rollout.placement=separated", "rollout.num_rollout_workers=1"], 3,
     "less rollout.num_rollout_workers=1 (rollout.placement=separated)"),
    (["trainer.use_ray=false"], 1, "trainer.use_ray=false runs one worker in this process"),
])
def test_auto_counts_nodes_and_separated_rollout_workers(fake_backend, tmp_path, overrides, want, why):
    n, reason = auto_num_workers(_cfg(tmp_path, "device=fakeacc", *overrides), fake_backend)
    assert n == want and why in reason


def test_cpu_is_one_worker(tmp_path):
    cfg = _cfg(tmp_path, "device=cpu")
    preflight(cfg, TRAIN)
    assert resolve_num_workers(cfg, get_backend("cpu")) == 1
    assert auto_num_workers(cfg, get_backend("cpu")) == (1, "the cpu backend is one device")


def test_rl_trainer_records_the_resolved_number(tmp_path):
    """RLTrainer (run_training, portrl train, the Python API) resolves null once, before it builds its workers, and
    its config, the one its tracker logs, holds the number."""
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    cfg = _cfg(tmp_path, "device=cpu", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
               "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=8",
               "data.arith.num_test=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
               "model.sft_warm_start=false", "trainer.progress_bar=false")
    trainer = RLTrainer(settle_config(cfg))
    try:
        assert cfg.trainer.num_workers is None  # the caller's config is left as it was
        assert trainer.cfg.trainer.num_workers == 1 and trainer.actor.num_workers == 1
    finally:
        trainer.actor.shutdown()


def test_zero_is_refused_and_null_accepted():
    with pytest.raises(ConfigError, match=r"trainer.num_workers=0 must be >= 1, or null \(auto: every device"):
        compose(overrides=["trainer.num_workers=0"])
    assert compose(overrides=["trainer.num_workers=null"]).trainer.num_workers is None
