"""Distributed layer, the parts that need no Ray: dispatch helpers, metric reduction, device visibility,
worker env, bucket planning, gradient clipping, LoRA merged weights, reward-model scoring."""

import os

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl import process_env  # noqa: E402
from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.device.backend import Backend  # noqa: E402
from portrl.workers.batch import Batch  # noqa: E402
from portrl.workers.group import WorkerDiedError, concat_batches, reduce_metrics, split_args  # noqa: E402
from portrl.workers.parallel import clip_grad_norm, resolve_strategy, wrap_model  # noqa: E402
from portrl.workers.ray_env import local_device_index, worker_env  # noqa: E402
from portrl.workers.weight_sync import plan_buckets  # noqa: E402


class FakeAccel(Backend):
    """Backend facts only (no device calls): an accelerator Ray knows as GPU."""

    name = "fakeaccel"
    ray_resource = "GPU"
    visible_devices_env = "FAKE_VISIBLE_DEVICES"
    ray_noset_env = ("RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES",)

    def env_presets(self, deterministic=False):
        return {"ALLOC_CONF": "expandable", **({"DETERMINISTIC": "1"} if deterministic else {})}

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


def tiny_qwen2(seed=0, num_labels=None, vocab_size=40, pad_token_id=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      pad_token_id=pad_token_id)
    if num_labels:
        cfg.num_labels = num_labels
        return Qwen2ForSequenceClassification(cfg).eval()
    return Qwen2ForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------- dispatch
def test_split_args_and_combine():
    b = Batch({"x": torch.arange(5).view(5, 1)}, {"uid": list("abcde")})
    per = split_args((b, 3), {"other": b}, 2)
    assert [len(a[0]) for a, _ in per] == [3, 2] and [a[1] for a, _ in per] == [3, 3]
    assert per[1][1]["other"]["uid"] == ["d", "e"]
    back = concat_batches([a[0] for a, _ in per])
    assert torch.equal(back["x"], b["x"]) and back["uid"] == b["uid"]
    with pytest.raises(ValueError, match="batch of 1 rows over 2"):
        split_args((b.slice(0, 1),), {}, 2)


def test_reduce_metrics_rules():
    out = reduce_metrics([
        {"actor/pg_loss": 1.0, "response_length/max": 3, "response_length/min": 2, "num_tokens": 10,
         "timing_s/update": 1.5, "actor/entropy": torch.tensor(0.5), "lst": [1], "name": "a"},
        {"actor/pg_loss": 3.0, "response_length/max": 5, "response_length/min": 1, "num_tokens": 6,
         "timing_s/update": 2.5, "actor/entropy": torch.tensor(1.5), "lst": [2, 3], "name": "b"},
    ])
    assert out == {"actor/pg_loss": 2.0, "response_length/max": 5.0, "response_length/min": 1.0, "num_tokens": 16.0,
                   "timing_s/update": 2.5, "actor/entropy": 1.0, "lst": [1, 2, 3], "name": "a"}


def test_worker_died_error_names_worker_and_checkpoint():
    e = WorkerDiedError("actor rank 1 on node 127.0.0.1 (node id abcd, pid 7)", RuntimeError("killed\ntrace"))
    assert "actor rank 1 on node 127.0.0.1" in str(e) and "killed" in str(e) and "trace" not in str(e)
    assert "global_step_4" in str(e.with_checkpoint("/out/global_step_4"))
    assert "no checkpoint" in str(e.with_checkpoint(None))


# ---------------------------------------------------------------------------- devices / env
def test_local_device_index_cases():
    cpu = get_backend("cpu")
    assert local_device_index(cpu, []) is None
    acc = FakeAccel()
    # Ray set the variable to the worker's own id: it sees one device, index 0
    assert local_device_index(acc, ["3"], {"FAKE_VISIBLE_DEVICES": "3"}) == 0
    # no-set: the variable lists the node's devices; index = position of the given id
    noset = {"RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES": "1", "FAKE_VISIBLE_DEVICES": "4,6,7"}
    assert local_device_index(acc, ["6"], noset) == 1
    assert local_device_index(acc, ["2"], {"RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES": "1"}) == 2
    with pytest.raises(RuntimeError, match="not in FAKE_VISIBLE_DEVICES"):
        local_device_index(acc, ["5"], noset)
    with pytest.raises(RuntimeError, match="no GPU"):
        local_device_index(acc, [], {})


def test_worker_env_layers_presets_user_env_and_noset():
    cfg = default_config()
    cfg.trainer.deterministic = True
    cfg.device.env = {"ALLOC_CONF": "user", "EXTRA": "1"}
    env = worker_env(cfg, FakeAccel(), share_devices=True)
    # the variables torch reads before it loads come first, with this process's values (portrl/process_env.py)
    assert env == {**process_env.current(), "ALLOC_CONF": "user", "DETERMINISTIC": "1", "EXTRA": "1",
                   "RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES": "1"}
    assert worker_env(default_config(), get_backend("cpu")) == {**process_env.current(),
                                                                 "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def test_a_wait_policy_in_device_env_drops_the_default_spin_count(monkeypatch):
    """libgomp takes GOMP_SPINCOUNT over OMP_WAIT_POLICY: a worker told to wait passively must not get the spin
    count portrl would otherwise set (portrl/process_env.py)."""
    for name in process_env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cfg = default_config()
    assert worker_env(cfg, get_backend("cpu"))["GOMP_SPINCOUNT"] == process_env.DEFAULTS["GOMP_SPINCOUNT"]
    monkeypatch.setattr(process_env, "_applied", set())
    process_env.apply_defaults()  # as the CLI does before any command: the spin count is in os.environ now
    assert os.environ["GOMP_SPINCOUNT"] == process_env.DEFAULTS["GOMP_SPINCOUNT"]
    cfg.device.env = {"OMP_WAIT_POLICY": "PASSIVE"}
    env = worker_env(cfg, get_backend("cpu"))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")  # one the user set stays
    assert worker_env(cfg, get_backend("cpu"))["GOMP_SPINCOUNT"] == "50"


# ------------------------------------------------------------------------------ parallel
def test_strategy_resolution_and_single_rank_wrap():
    cpu = get_backend("cpu")
    assert resolve_strategy("auto", cpu) == "fsdp"  # FSDP2 runs on gloo with torch >= 2.6 (tested with 2 ranks)
    with pytest.raises(ValueError, match="valid"):
        resolve_strategy("zero3", cpu)
    m = torch.nn.Linear(2, 2)
    assert wrap_model(m, "auto", cpu) is m  # no process group: the plain model


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    for m in (a, b):
        (m(x) ** 2).sum().mul(10).backward()
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    got = clip_grad_norm(a, 0.5)
    assert got == pytest.approx(float(ref), rel=1e-6) and got > 0.5
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for p in a.parameters():
        p.grad[0] = float("inf")
    before = [p.grad.clone() for p in a.parameters()]
    assert clip_grad_norm(a, 0.5) == float("inf")
    assert all(torch.equal(g, p.grad) for g, p in zip(before, a.parameters()))  # untouched: caller skips the step


# --------------------------------------------------------------------------------- buckets
def test_plan_buckets_boundaries():
    meta = [("a", (4,), "float32"), ("b", (4,), "float32"), ("c", (100,), "float32"), ("d", (2,), "float32"),
            ("e", (2,), "int64"), ("f", (1,), "float32")]
    # 32-byte buckets: a+b fill one; c is larger than a bucket and travels alone; dtype change starts a bucket
    assert plan_buckets(meta, 32) == [[0, 1], [2], [3], [4], [5]]
    assert plan_buckets(meta, 10**6) == [[0, 1, 2, 3], [4], [5]]
    with pytest.raises(ValueError, match="weight_sync_bucket_mb"):
        plan_buckets(meta, 0)


# -------------------------------------------------------------------------------------- LoRA
def test_lora_merged_weights_equal_manual_merge_and_leave_model_alone():
    from portrl.workers.lora import apply_lora, merged_weights

    cfg = default_config()
    cfg.actor.lora_rank, cfg.actor.lora_alpha = 4, 8
    cfg.actor.lora_target_modules = ["q_proj", "v_proj"]
    base = tiny_qwen2()
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, cfg)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # peft starts B at zero (delta 0); make the delta real
            p.data.normal_(0, 0.1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    merged = dict(merged_weights(model))
    assert set(merged) == set(base_sd)  # the base model's names, no adapter tensors
    inner = model.get_base_model()
    for name, w in base_sd.items():
        path = name.rsplit(".", 1)[0]
        if name.endswith("weight") and path.split(".")[-1] in ("q_proj", "v_proj"):
            layer = inner.get_submodule(path)
            manual = w + (8 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
            torch.testing.assert_close(merged[name], manual)
            assert not torch.allclose(merged[name], w)
        else:
            torch.testing.assert_close(merged[name], w, rtol=0, atol=0)
    # peft's own merge agrees, and the training model is unchanged
    import copy

    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for k, v in peft_merged.items():
        torch.testing.assert_close(merged[k], v)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_apply_lora_rejects_bad_config():
    from portrl.workers.lora import apply_lora

    cfg = default_config()
    with pytest.raises(ValueError, match="lora_rank must be > 0"):
        apply_lora(tiny_qwen2(), cfg)
    cfg.actor.lora_rank, cfg.actor.lora_target_modules = 2, ["qkv"]
    with pytest.raises(ValueError, match=r"\['qkv'\] are not modules.*q_proj"):
        apply_lora(tiny_qwen2(), cfg)


# ------------------------------------------------------------------------------ reward model
def test_reward_model_scores_pairs(tmp_path):
    from portrl.trainer.reward_model_scorer import RewardModelScorer

    from portrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # a real HF tokenizer with a chat template (ChatML)
    rm = tiny_qwen2(seed=3, num_labels=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), get_backend("cpu"), batch_size=2)
    prompts = ["what is two plus two", "what is two plus two", "the answer"]
    responses = [" four", " five five five", " four"]
    got = scorer.score(prompts, responses)
    assert got.shape == (3,) and got.dtype == torch.float32
    text = scorer.format(prompts[0], responses[0])
    assert "<|im_start|>assistant" in text and text.index("plus") < text.index("four")  # chat template applied
    # each row alone (no padding) gives the same score as in the padded batch
    for i in range(3):
        ids = scorer.tokenizer(scorer.format(prompts[i], responses[i]), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            alone = rm(**ids).logits[0, 0]
        torch.testing.assert_close(got[i], alone, rtol=1e-5, atol=1e-6)
    assert got[0] != got[1]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        scorer.score(prompts[:2], responses[:1])
    with pytest.raises(FileNotFoundError, match="not a local model directory"):
        RewardModelScorer(str(tmp_path / "missing"), get_backend("cpu"))


def test_a_rendezvous_port_is_free_and_outside_the_ephemeral_range(monkeypatch):
    """Ports for rank 0 to listen on come from below the range outgoing connections take their local ports from
    (a connection of another process could take one between the pick and the listen: CI's EADDRINUSE)."""
    import socket

    from portrl.workers import parallel

    low, _ = parallel._ephemeral_ports()
    ports = {parallel.find_free_port() for _ in range(20)}
    assert all(parallel.LISTEN_PORTS_FROM <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed
    monkeypatch.setattr(parallel, "_ephemeral_ports", lambda: (parallel.LISTEN_PORTS_FROM + 10, 60999))
    assert parallel.find_free_port() > 0  # no room below the range: the OS's pick
