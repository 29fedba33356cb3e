"""trainer.profile.steps (portrl/trainer/profiling.py): the profiled steps' traces with a range per phase, the
vendor range APIs each backend declares (NVTX through torch.cuda.nvtx, mstx through a fake torch_npu that follows the
documented API), and a profiled worker in its own process."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from portrl.backends.cuda import CUDABackend
from portrl.backends.npu import NPUBackend
from portrl.backends.rocm import ROCmBackend
from portrl.config.options_schema import default_config
from portrl.device import get_backend
from portrl.trainer.metrics import Timer
from portrl.workers.profiled import ProfiledWorker

PHASES = ("portrl/step", "portrl/gen", "portrl/reward", "portrl/adv", "portrl/update_actor",
          "portrl/sync")


def _ranges(trace: Path) -> dict:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"]: e for e in events if e.get("name", "").startswith("portrl/") and e.get("ph") == "X"}


def test_a_profiled_step_writes_a_trace_with_every_phase(tiny_model, tmp_path, monkeypatch):
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": tiny_model,
                 "trainer.output_dir": str(tmp_path / "run"), "data.arith.num_train": 16, "data.arith.num_test": 4,
                 "data.train_batch_size": 2, "data.max_response_length": 4, "rollout.n": 2,
                 "actor.ppo_mini_batch_size": 2, "trainer.total_steps": 2, "trainer.test_freq": 0,
                 "trainer.val_before_train": False, "trainer.progress_bar": False, "trainer.loggers": ["jsonl"],
                 "trainer.plot": False, "trainer.save_final": False, "trainer.profile.steps": [2]}.items():
        OmegaConf.update(cfg, k, v)
    run_training(cfg)
    profile = tmp_path / "run" / "profile"
    assert [p.name for p in profile.iterdir()] == ["step_2"]  # step 1 was not recorded
    assert [p.name for p in (profile / "step_2").iterdir()] == ["driver.json"]  # no temporary file left
    ranges = _ranges(profile / "step_2" / "driver.json")
    assert set(PHASES) <= set(ranges)
    step = ranges["portrl/step"]
    for name in PHASES[1:]:  # each phase inside the step's range
        assert step["ts"] <= ranges[name]["ts"] and ranges[name]["ts"] + ranges[name]["dur"] <= step["ts"] + step["dur"]


class _RecordingBackend:
    def __init__(self):
        self.calls = []

    def range_push(self, name):
        self.calls.append(("push", name))

    def range_pop(self):
        self.calls.append(("pop",))


def test_timer_opens_and_closes_a_vendor_range_per_phase_even_on_error():
    rec = _RecordingBackend()
    timer = Timer(ranges=rec)
    with pytest.raises(ValueError):
        with timer("step"):
            with timer("gen"):
                pass
            with timer("update_actor"):
                raise ValueError("x")
    assert rec.calls == [("push", "portrl/step"), ("push", "portrl/gen"), ("pop",), ("push", "portrl/update_actor"),
                         ("pop",), ("pop",)]
    assert set(timer.times) == {"step", "gen", "update_actor"}
    assert Timer()._ranges is None  # unprofiled steps: no ranges at all


@pytest.mark.parametrize("backend_cls", [CUDABackend, ROCmBackend])
def test_cuda_and_rocm_ranges_are_torch_cuda_nvtx(backend_cls, monkeypatch):
    """torch.cuda.nvtx is NVTX on CUDA builds and roctx on ROCm builds; here its calls are recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    backend = backend_cls()
    backend.range_push("portrl/gen")
    backend.range_pop()
    assert calls == [("push", "portrl/gen"), ("pop",)]
    assert backend.profiler_activities == ("CUDA",) and backend.range_api in ("NVTX", "roctx")


def _fake_torch_npu(calls):
    """torch_npu's documented profiler and mstx surface, recording what is called."""
    class Profile:
        def __init__(self, activities, on_trace_ready):
            calls.append(("profile", tuple(activities)))
            self.on_trace_ready = on_trace_ready

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.on_trace_ready(self)

    def handler(dir_name, worker_name=None, use_gzip=False):
        def write(prof):
            Path(dir_name).mkdir(parents=True)
            (Path(dir_name) / "trace_view.json").write_text("{}")
        return write

    ids = iter(range(7, 100))
    mstx = types.SimpleNamespace(range_start=lambda msg, stream=None: calls.append(("start", msg)) or next(ids),
                                 range_end=lambda range_id: calls.append(("end", range_id)))
    profiler = types.SimpleNamespace(profile=Profile, tensorboard_trace_handler=handler,
                                     ProfilerActivity=types.SimpleNamespace(CPU="CPU", NPU="NPU"))
    return types.SimpleNamespace(profiler=profiler, npu=types.SimpleNamespace(mstx=mstx))


def test_npu_profiles_with_torch_npus_profiler_and_marks_mstx_ranges(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    backend = NPUBackend()
    with backend.step_profiler(tmp_path / "step_3", "driver"):
        backend.range_push("portrl/step")
        backend.range_push("portrl/gen")
        backend.range_pop()
        backend.range_pop()
    assert calls == [("profile", ("CPU", "NPU")), ("start", "portrl/step"), ("start", "portrl/gen"), ("end", 8),
                     ("end", 7)]
    assert (tmp_path / "step_3" / "driver" / "trace_view.json").exists()


class _Worker(ProfiledWorker):
    def __init__(self):
        self.backend, self.rank = get_backend("cpu"), 1

    def work(self):
        return (torch.ones(64, 64) @ torch.ones(64, 64)).sum()


def test_a_worker_profiles_itself_under_its_role_and_rank(tmp_path):
    worker = _Worker()
    worker.profile_start(str(tmp_path), "actor")
    worker.work()
    worker.profile_stop()
    worker.profile_stop()  # a second stop is nothing
    events = json.loads((tmp_path / "actor_rank1.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
