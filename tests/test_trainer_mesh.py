"""The trainer under a device mesh (portrl.workers.mesh): PPO with two Ray workers, the actor sequence parallel and
the critic tensor parallel, trains, checkpoints and exports; a resume under the swapped mesh (actor tensor parallel,
critic sequence parallel) continues it, and its next step equals the uninterrupted run's up to float32 reordering.
Both meshes put the two workers in one data-parallel group (dp = 1), so rank 0 generates every rollout and the
runs see the same rows. The numerics of each mesh against one rank are `portrl parity mesh`'s (.ci/run)."""

import json
import math
import os
import shutil

import pytest
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402
from _ray_trainer import fit, logged_metrics  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from portrl.models import write_tiny_model

    p = str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64, seed=0, initializer_range=0.2))
    init_ray(_cfg(p, "unused", {}), get_backend("cpu"), num_cpus=4)
    yield p
    ray.shutdown()


def _cfg(path, out, mesh, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "trainer.output_dir": str(out),
            "trainer.num_workers": 2, "algorithm.adv_estimator": "gae", "model.sft_warm_start": False,
            "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
            "data.max_response_length": 5, "rollout.n": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_epochs": 1,
            "actor.ppo_micro_batch_size_per_device": 4, "actor.optim.lr": 1e-3, "actor.entropy_coeff": 0.01,
            "trainer.total_steps": 3,
            "trainer.save_freq": 2, "trainer.test_freq": 0, "trainer.progress_bar": False,
            "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": True, "trainer.seed": 3}
    base.update(mesh)
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


SP_TP = {"actor.sequence_parallel_size": 2, "critic.tensor_parallel_size": 2}
TP_SP = {"actor.tensor_parallel_size": 2, "critic.sequence_parallel_size": 2}


@pytest.mark.slow  # two Ray workers train 3 PPO steps under a mesh, then a resume under another (60-120 s)
def test_ppo_trains_under_a_mesh_and_resumes_under_another(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    ref_out = tmp_path / "ref"
    summary = fit(_cfg(tiny, ref_out, SP_TP))
    want = logged_metrics(ref_out)
    assert {1, 2, 3} <= set(want)
    for step in (1, 2, 3):
        assert want[step]["actor/grad_norm"] > 0 and math.isfinite(want[step]["critic/vf_loss"])
    ckpt = ref_out / "checkpoints" / "global_step_2"
    # the sequence-parallel actor writes a shard per rank; the tensor-parallel critic its gathered state
    assert (ckpt / "actor" / "rank_1.safetensors").is_file() and not (ckpt / "critic" / "rank_1.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(summary["export_dir"], local_files_only=True)  # the export loads

    out = tmp_path / "swapped"
    shutil.copytree(ref_out, out)
    shutil.rmtree(out / "checkpoints" / "global_step_3")
    kept = [line for line in (ref_out / "metrics.jsonl").read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= 2]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    resumed = fit(_cfg(tiny, out, TP_SP, **{"trainer.export_hf": False}))
    assert resumed["resumed_from"].endswith("global_step_2")
    got = logged_metrics(out)[3]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert got[key] == pytest.approx(want[3][key], rel=1e-4, abs=1e-6), key
