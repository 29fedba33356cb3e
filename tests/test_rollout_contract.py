"""The rollout engine contract: choose_engine (the one rule for ``auto``), engine-neutral settings and each
engine's translation, the backend's check_and_update_engine_options hook, and the capabilities the actor
queries (a third-party engine that declares none still trains)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import portrl.rollout.registry as registry
from portrl.backends.cpu import CPUBackend
from portrl.backends.cuda import CUDABackend
from portrl.backends.npu import NPUBackend
from portrl.backends.rocm import ROCmBackend
from portrl.backends.vllm import VLLMEngine
from portrl.backends.vllm.options import vllm_options
from portrl.config.options_schema import default_config
from portrl.device import Backend
from portrl.errors import UserError
from portrl.models import load_causal_lm, write_tiny_model
from portrl.rollout import (
    SMALL_MODEL_PARAMS,
    EngineCapabilities,
    RolloutEngine,
    RolloutEngineError,
    RolloutSettings,
    SamplingParams,
    choose_engine,
    engine_capabilities,
    make_engine,
    register_engine,
)
from portrl.rollout.hf_engine import HFEngine
from portrl.workers.rollout_worker import rollout_settings


class Dev(Backend):
    """A backend offering ``engines`` on a device of type ``device_type``."""

    name = "testdev"

    def __init__(self, engines=("vllm", "hf"), device_type="cpu"):
        self.engines, self.device_type = tuple(engines), device_type

    def rollout_engines(self):
        return self.engines

    def supports_bf16(self):
        return False

    def fp8_dtype(self):
        return None

    def memory_stats(self):
        return {}

    def reset_peak_memory(self):
        pass

    def memory_available(self):
        return None


def never_called():
    raise AssertionError("the parameter count is only needed for auto on the CPU with hf behind another engine")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations and broken plugins of one test stay in that test."""
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    registry.PLUGINS.reset()
    yield
    registry.PLUGINS.reset()


# --- the one rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("engines, device, params, expected", [
    (("vllm", "hf"), "cpu", 1_000_000, "hf"),  # a small model on the CPU shares the trainer's module
    (("vllm", "hf"), "cpu", SMALL_MODEL_PARAMS - 1, "hf"),
    (("vllm", "hf"), "cpu", SMALL_MODEL_PARAMS, "vllm"),  # a real model: the backend's first
    (("vllm", "hf"), "cpu", None, "vllm"),  # unknown size never counts as small
    (("vllm", "hf"), "cuda", 1_000_000, "vllm"),  # not on the CPU device
    (("hf",), "cpu", 10**12, "hf"),
    (("vllm",), "cpu", 1_000, "vllm"),  # no hf offered: the first available
])
def test_auto_rule(engines, device, params, expected):
    assert choose_engine("auto", Dev(engines, device), num_params=params) == expected
    assert choose_engine(None, Dev(engines, device), num_params=lambda: params) == expected


def test_size_counted_only_when_the_rule_needs_it():
    assert choose_engine("auto", Dev(("vllm", "hf"), "cuda"), num_params=never_called) == "vllm"
    assert choose_engine("auto", Dev(("hf", "vllm"), "cpu"), num_params=never_called) == "hf"
    assert choose_engine("vllm", Dev(("vllm", "hf"), "cpu"), num_params=never_called) == "vllm"


def test_requested_names_and_their_errors():
    assert choose_engine("hf", Dev()) == "hf"
    with pytest.raises(RolloutEngineError, match=r"^rollout engine 'vllm' is not available on backend 'testdev' "
                                                  r"\(it is a known engine, .*\); available: hf, or auto$"):
        choose_engine("vllm", Dev(("hf",)))
    with pytest.raises(RolloutEngineError, match=r"^rollout engine 'nope' is not available on backend 'testdev'; "
                                                  r"available: vllm, hf, or auto$"):
        choose_engine("nope", Dev())
    with pytest.raises(RolloutEngineError, match=r"offers rollout engine 'ghost', but no engine of that name is "
                                                  r"registered; known engines: .*hf"):
        choose_engine("ghost", Dev(("ghost", "hf")))
    with pytest.raises(RolloutEngineError, match=r"backend 'testdev' offers no usable rollout engine \(offers: ghost"):
        choose_engine("auto", Dev(("ghost",)))
    assert issubclass(RolloutEngineError, UserError)  # the CLI prints one line and exits 2


def test_make_engine_counts_a_given_module(tiny):
    """make_engine applies the same rule: a small module on the CPU gets hf even where another engine is first."""
    engine = make_engine("auto", model=load_causal_lm(tiny, backend="cpu"), backend=Dev(("vllm", "hf"), "cpu"))
    assert engine.name == "hf"


# --- settings and their translation ----------------------------------------------------------------
def test_rollout_settings_from_the_config_sections():
    cfg = default_config()
    for k, v in {"rollout.max_num_batched_tokens": 4096, "rollout.gpu_memory_utilization": 0.7,
                 "rollout.tensor_model_parallel_size": 2, "rollout.enforce_eager": True,
                 "rollout.enable_sleep_mode": False, "data.max_prompt_length": 100,
                 "data.max_response_length": 28}.items():
        OmegaConf.update(cfg, k, v)
    s = rollout_settings(cfg.rollout, cfg.data, 5, "bfloat16")
    assert s == RolloutSettings(dtype="bfloat16", seed=5, memory_fraction=0.7, tensor_parallel=2, eager=True,
                                max_sequence_length=128, max_batched_tokens=4096, sleep_between_rollouts=False)
    assert rollout_settings(default_config().rollout, default_config().data, 0, "float32").max_batched_tokens is None


def test_each_engine_translates_the_settings():
    s = RolloutSettings(dtype="bfloat16", seed=3, memory_fraction=0.6, tensor_parallel=4, eager=True,
                        max_sequence_length=256, max_batched_tokens=None, sleep_between_rollouts=True)
    assert HFEngine.translate_settings(s) == {"dtype": "bfloat16"}
    assert vllm_options(s) == VLLMEngine.translate_settings(s) == {
        "dtype": "bfloat16", "seed": 3, "gpu_memory_utilization": 0.6, "tensor_parallel_size": 4,
        "enforce_eager": True, "enable_sleep_mode": True, "max_model_len": 256}
    assert vllm_options(RolloutSettings(max_batched_tokens=512))["max_num_batched_tokens"] == 512
    assert "max_model_len" not in vllm_options(RolloutSettings())
    assert RolloutEngine.translate_settings(s) == {}  # an engine that translates nothing keeps its own defaults


# --- the backend hook --------------------------------------------------------------------------------
def test_each_backends_adjustment():
    vllm = vllm_options(RolloutSettings(sleep_between_rollouts=True))
    assert CPUBackend().check_and_update_engine_options("vllm", dict(vllm)) == {**vllm, "enable_sleep_mode": False}
    assert CPUBackend().check_and_update_engine_options("hf", {"dtype": "float32"}) == {"dtype": "float32"}
    for backend in (CUDABackend(), ROCmBackend(), NPUBackend()):  # no adjustment of their own today
        assert backend.check_and_update_engine_options("vllm", dict(vllm)) == vllm
        assert backend.check_and_update_engine_options("hf", {"dtype": "bfloat16"}) == {"dtype": "bfloat16"}


class Forcing(Dev):
    def check_and_update_engine_options(self, engine, options):
        options["compact_fraction"] = 0.5  # what the platform needs wins over the caller
        return options


def test_hook_sees_translated_settings_and_keywords_and_has_the_last_word(tiny):
    seen = {}

    class Watching(Forcing):
        def check_and_update_engine_options(self, engine, options):
            seen.update(engine=engine, options=dict(options))
            return super().check_and_update_engine_options(engine, options)

    model = load_causal_lm(tiny, backend="cpu")
    engine = make_engine("hf", model=model, backend=Watching(("hf",)), settings=RolloutSettings(dtype="bfloat16"),
                         compact_fraction=0.25)
    assert seen == {"engine": "hf", "options": {"dtype": "bfloat16", "compact_fraction": 0.25}}
    assert engine.compact_fraction == 0.5


# --- capabilities -----------------------------------------------------------------------------------
def test_hf_engine_declares_and_answers(tiny):
    assert engine_capabilities("hf") == EngineCapabilities(in_process_weights=True, forward_recording=True,
                                                           sleep_wake=True, interruptible=True)
    assert VLLMEngine.capabilities == EngineCapabilities(sleep_wake=True, interruptible=True)
    model = load_causal_lm(tiny, backend="cpu")
    shared = make_engine("hf", model=model, backend="cpu")
    assert shared.shares_module(model) and not shared.shares_module(load_causal_lm(tiny, backend="cpu"))
    assert shared.can_record_forward()
    own = make_engine("hf", model_path=tiny, backend="cpu")
    assert not own.shares_module(model) and not own.shares_module(own.model)  # it loaded its own copy
    slow = make_engine("hf", model=model, backend="cpu", fast_decode=False)
    assert not slow.can_record_forward()
    with pytest.raises(RuntimeError, match="fast decode path"):
        slow.start_recording()


def test_declaring_a_capability_means_implementing_it():
    with pytest.raises(TypeError, match="declares forward_recording but does not implement can_record_forward, "
                                        "start_recording, stop_recording"):
        class Liar(RolloutEngine):  # noqa: F841
            capabilities = EngineCapabilities(forward_recording=True)

            def generate(self, prompts, params):
                raise NotImplementedError

            def update_weights(self, named_tensors):
                raise NotImplementedError


class PlainEngine(RolloutEngine):
    """A third-party engine with no optional capability: its own model from ``model_path``, greedy-or-sampled
    decoding by the hf engine it wraps (composition, so none of hf's capabilities leak through)."""

    name = "plain"

    def __init__(self, *, model=None, model_path=None, tokenizer=None, backend=None, **options):
        self.options = options
        self._inner = HFEngine(model_path=model_path, tokenizer=tokenizer, backend=backend)
        self.updates = 0

    def generate(self, prompts, params):
        return self._inner.generate(prompts, params)

    def update_weights(self, named_tensors):
        self.updates += 1
        self._inner.update_weights(named_tensors)


def test_third_party_engine_without_capabilities_trains_in_the_actor(tiny, monkeypatch, clean_registry):
    from portrl.workers.actor import ActorRolloutWorker

    register_engine("plain", PlainEngine)
    monkeypatch.setattr(CPUBackend, "rollout_engines", lambda self: ("plain", "hf"))
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": tiny, "rollout.engine": "plain",
                 "rollout.n": 2, "data.max_response_length": 4, "actor.ppo_mini_batch_size": 2,
                 "actor.optim.lr": 1e-2}.items():
        OmegaConf.update(cfg, k, v)
    w = ActorRolloutWorker(cfg)
    assert isinstance(w.engine, PlainEngine) and w.engine.options == {}  # nothing translated: its own defaults
    prompts = [w.tokenizer(f"{i}+{i}=")["input_ids"] for i in range(2)]
    b = w.generate(prompts, {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "seed": 1}, for_update=True)
    assert w._tape is None  # never asked to record
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    b["advantages"] *= b["response_mask"]
    w.update_actor(b)
    assert w.sync_weights() is True and w.engine.updates == 1  # no shared module: the weights move
    engine_weights = dict(w.engine._inner.model.named_parameters())
    for name, p in w.module.named_parameters():
        torch.testing.assert_close(engine_weights[name], p.detach())
    out = w.engine.generate(prompts, SamplingParams(n=1, max_new_tokens=3, seed=0))
    assert len(out) == 2


@pytest.mark.parametrize("small_below, expected", [(SMALL_MODEL_PARAMS, "hf"), (10, "plain")])
def test_actor_and_rollout_worker_follow_the_same_rule(tiny, monkeypatch, clean_registry, small_below, expected):
    """auto with ("plain", "hf") offered on the CPU: the tiny model counts as small (hf) unless the threshold is
    lowered below its size; the colocated actor and the separated RolloutWorker choose alike."""
    from portrl.workers.actor import ActorRolloutWorker
    from portrl.workers.rollout_worker import RolloutWorker

    register_engine("plain", PlainEngine)
    monkeypatch.setattr(CPUBackend, "rollout_engines", lambda self: ("plain", "hf"))
    monkeypatch.setattr(registry, "SMALL_MODEL_PARAMS", small_below)
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": tiny, "rollout.engine": "auto"}.items():
        OmegaConf.update(cfg, k, v)
    actor, worker = ActorRolloutWorker(cfg), RolloutWorker(cfg)
    assert actor.engine.name == worker.engine.name == expected
    assert actor.engine.shares_module(actor.module) == (expected == "hf")
    assert not worker.engine.shares_module(actor.module)  # the RolloutWorker always has its own copy


class CPUOnlyEngine(PlainEngine):
    """A third-party engine that says where it runs instead of being listed by the backends."""

    name = "cpuonly"

    @classmethod
    def runs_on(cls, backend):
        return backend.device_type == "cpu"


def test_an_engine_that_says_where_it_runs_needs_no_backend_change(tiny, clean_registry):
    register_engine("cpuonly", CPUOnlyEngine)
    cpu = Dev(engines=("hf",))
    assert registry.offered_engines(cpu) == ["hf", "cpuonly"]  # the backend's own list first
    assert choose_engine("cpuonly", cpu) == "cpuonly"
    assert choose_engine("auto", cpu, num_params=10**9) == "hf"  # auto keeps the backend's preference
    other = Dev(engines=("hf",), device_type="xpu")
    assert registry.offered_engines(other) == ["hf"]
    with pytest.raises(RolloutEngineError, match="'cpuonly' is not available on backend 'testdev'"):
        choose_engine("cpuonly", other)
    engine = make_engine("cpuonly", model_path=tiny, backend=cpu)
    assert isinstance(engine, CPUOnlyEngine)
