"""The sglang rollout engine (backends/sglang/) against a stand-in ``sglang`` that follows SGLang's documented
offline Engine API (tests/_fake_sglang.py): the options and sampling parameters it is given, prompt-major rows
with the sampler's log-probs, weights in buckets with one cache flush, sleep and wake, the install message, the
backends that offer it, and two SPPO steps of the tiny model through it (the SPPO recipe's SGLang variant,
examples/math_sppo_qwen2.5-7b_sglang.sh). The real package needs the CUDA 13 stack; ci/device_check.sh runs it
where it is installed."""

import sys

import pytest
import torch
from omegaconf import OmegaConf

import _fake_sglang
from portrl.rollout import SamplingParams, make_engine
from portrl.rollout.settings import RolloutSettings


@pytest.fixture
def fake_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", _fake_sglang.module())
    _fake_sglang.Engine.instances.clear()
    return _fake_sglang


@pytest.fixture
def engine(fake_sglang, tiny_model):
    from transformers import AutoTokenizer

    from portrl.backends.sglang import SGLangEngine

    tok = AutoTokenizer.from_pretrained(tiny_model)
    settings = RolloutSettings(dtype="float32", seed=3, memory_fraction=0.4, tensor_parallel=1,
                               sleep_between_rollouts=True, max_sequence_length=96)
    eng = SGLangEngine(model_path=tiny_model, tokenizer=tok, sync_bucket_mb=1,
                       **SGLangEngine.translate_settings(settings))
    return eng, tok


def test_options_and_sampling_parameters_are_sglangs(engine):
    eng, tok = engine
    assert eng.engine.kwargs == {"model_path": eng.engine.kwargs["model_path"], "tokenizer_path":
                                 eng.engine.kwargs["model_path"], "dtype": "float32", "random_seed": 3,
                                 "mem_fraction_static": 0.4, "tp_size": 1, "enable_memory_saver": True,
                                 "skip_tokenizer_init": True, "log_level": "error", "context_length": 96}
    eng.generate([[5, 6, 7]], SamplingParams(n=2, temperature=0.7, max_new_tokens=3,
                                             stop_token_ids=(9,), seed=11))
    _, rows, sp = eng.engine.calls[-1]
    assert rows == 2 and sp == {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3,
                                "stop_token_ids": sorted({9, tok.eos_token_id}), "skip_special_tokens": False,
                                "no_stop_trim": True, "sampling_seed": 11}


def test_rows_are_prompt_major_with_the_samplers_log_probs(engine):
    eng, tok = engine
    prompts = [[5, 6, 7], [8, 9]]
    out = eng.generate(prompts, SamplingParams(n=3, temperature=0.9, max_new_tokens=4, seed=1))
    assert len(out) == 6 and all(r in ("stop", "length") for r in out.finish_reasons)
    model = eng.engine.model
    for row, (ids, lps) in enumerate(zip(out.response_ids, out.logprobs)):  # log_softmax(logits / T), row by row
        seq = prompts[row // 3] + ids
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
        want = torch.log_softmax(logits / 0.9, -1)[len(prompts[row // 3]) - 1:-1].gather(1, torch.tensor(ids)[:, None])
        torch.testing.assert_close(torch.tensor(lps), want[:, 0], rtol=1e-5, atol=1e-5)


def test_weights_go_in_buckets_with_one_flush_and_change_the_model(engine):
    eng, _ = engine
    state = {n: p.detach().clone() + 0.5 for n, p in eng.engine.model.named_parameters()}
    eng.sync_bucket_bytes = 64 * 1024  # the tiny model's 0.6 MB in several buckets
    eng.update_weights(state.items())
    calls = [c for c in eng.engine.calls if c[0] == "update_weights_from_tensor"]
    assert len(calls) >= 2 and [c[2] for c in calls] == [False] * (len(calls) - 1) + [True]
    assert sorted(n for c in calls for n in c[1]) == sorted(state)
    for name, p in eng.engine.model.named_parameters():
        assert torch.equal(p, state[name])


def test_sleep_releases_and_wake_resumes_memory(engine):
    eng, _ = engine
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[5]], SamplingParams(max_new_tokens=1))
    eng.wake()
    eng.generate([[5]], SamplingParams(max_new_tokens=1))
    assert [c[0] for c in eng.engine.calls if "memory" in c[0]] == ["release_memory_occupation",
                                                                   "resume_memory_occupation"]
    eng.shutdown()
    assert eng.engine is None


def test_without_sglang_the_error_names_the_install(monkeypatch, tiny_model):
    from portrl.backends.sglang import SGLangEngine

    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[sglang\]" on a CUDA or ROCm machine'):
        SGLangEngine(model_path=tiny_model)


def test_cuda_and_rocm_offer_it_where_installed(monkeypatch):
    import portrl.backends.cuda.backend as cuda_mod
    from portrl.backends.cuda import CUDABackend
    from portrl.backends.rocm import ROCmBackend

    monkeypatch.setattr(cuda_mod, "package_version", lambda dist: "0.5.9" if dist == "sglang" else None)
    assert CUDABackend().rollout_engines() == ("sglang", "hf") == ROCmBackend().rollout_engines()
    monkeypatch.setattr(cuda_mod, "package_version", lambda dist: "1" if dist in ("vllm", "sglang") else None)
    assert CUDABackend().rollout_engines() == ("vllm", "sglang", "hf")


def test_two_sppo_steps_through_the_sglang_engine(fake_sglang, tiny_model, tmp_path, monkeypatch):
    """The CPU backend is made to offer the engine here (SGLang itself never runs on the CPU): the trainer's
    rollout, weight sync and SPPO update run through the adapter and the stand-in."""
    from portrl.backends.cpu import CPUBackend
    from portrl.config.options_schema import default_config
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(CPUBackend, "rollout_engines", lambda self: ("sglang", "hf"))
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": tiny_model,
                 "algorithm.objective": "sppo", "actor.loss_agg_mode": "token-mean", "actor.use_kl_loss": False,
                 "rollout.engine": "sglang", "rollout.n": 2, "trainer.output_dir": str(tmp_path / "run"),
                 "data.arith.num_train": 16, "data.arith.num_test": 4, "data.train_batch_size": 2,
                 "data.max_response_length": 4, "actor.ppo_mini_batch_size": 2, "trainer.total_steps": 2,
                 "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.progress_bar": False,
                 "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.save_final": False}.items():
        OmegaConf.update(cfg, k, v)
    summary = run_training(cfg)
    assert summary["steps"] == 2
    (eng,) = _fake_sglang.Engine.instances
    kinds = [c[0] for c in eng.calls]
    assert kinds.count("generate") == 2 and "update_weights_from_tensor" in kinds
    assert kinds.index("update_weights_from_tensor") > kinds.index("generate")  # the update reached the engine


def test_partial_rollout_with_an_engine_that_cannot_abort_is_one_line(fake_sglang, tiny_model, tmp_path, monkeypatch):
    from portrl.backends.cpu import CPUBackend
    from portrl.config.options_schema import default_config
    from portrl.errors import UserError
    from portrl.trainer.preflight import preflight

    monkeypatch.setattr(CPUBackend, "rollout_engines", lambda self: ("sglang", "hf"))
    cfg = default_config()
    for k, v in {"device.name": "cpu", "model.path": tiny_model, "rollout.engine": "sglang", "trainer.mode": "async",
                 "rollout.placement": "separated", "trainer.output_dir": str(tmp_path / "run")}.items():
        OmegaConf.update(cfg, k, v)
    with pytest.raises(UserError, match=r"async_training.partial_rollout=true stops generations in flight, which "
                                        r"rollout.engine=sglang cannot do; use an engine that can \(hf\) or "
                                        r"async_training.partial_rollout=false"):
        preflight(cfg)


@pytest.mark.parametrize("result, outcome", [((True, "ok"), (True, "ok")), ((False, "bad shape"), (False, "bad shape")),
                                             ({"success": False, "message": "no"}, (False, "no")), (None, (True, ""))])
def test_update_outcome_reads_both_result_forms(result, outcome):
    from portrl.backends.sglang.translate import update_outcome

    assert update_outcome(result) == outcome
