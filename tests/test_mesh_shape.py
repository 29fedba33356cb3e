"""The mesh shape (portrl/device/mesh_shape.py): which sizes form a mesh of a world, the dimensions they give, and
which models split over a shape; and the preflight's reading of a model's dimensions (portrl/trainer/mesh_check.py)."""

from __future__ import annotations

import json

import pytest

from portrl.device.mesh_shape import MESH_DIMS, MeshError, MeshShape, divisors, mesh_problems
from portrl.errors import UserError

QWEN_0_5B = {"num_heads": 14, "num_kv_heads": 2, "vocab_size": 151936, "intermediate_size": 4864}


@pytest.mark.parametrize("world, tp, sp, fsdp, shape", [
    (1, 1, 1, -1, (1, 1, 1, 1)),
    (8, 1, 1, -1, (1, 8, 1, 1)),  # FSDP over all
    (8, 2, 2, -1, (1, 2, 2, 2)),  # TP2 x SP2 x FSDP2
    (8, 1, 2, 4, (2, 2, 2, 1)),  # shard groups of 4 (2 data x 2 sequence ranks), replicated twice
    (16, 2, 2, 4, (2, 2, 2, 2)),
    (8, 1, 1, 1, (8, 1, 1, 1)),  # fsdp_size=1: every rank holds a whole copy (DDP-like)
    (8, 8, 1, -1, (1, 1, 1, 8)),
    (4, 1, 4, 4, (1, 1, 4, 1)),  # sequence parallel only: the state is still sharded over the 4 ranks
])
def test_shapes(world, tp, sp, fsdp, shape):
    m = MeshShape.of(world, tp, sp, fsdp)
    assert m.sizes == shape and MESH_DIMS == ("dp_replicate", "dp_shard", "sp", "tp")
    assert m.world == world and m.tp == tp and m.sp == sp
    assert m.dp == m.dp_replicate * m.dp_shard == world // (tp * sp)
    assert m.fsdp == m.dp_shard * m.sp == (world // tp if fsdp == -1 else fsdp)


def test_of_accepts_exactly_the_valid_sizes():
    """Every (world, tp, sp, fsdp_size) up to 12 ranks: a shape when tp*sp divides world and fsdp_size is -1 or a
    multiple of sp dividing world // tp; else one MeshError line that lists valid sizes."""
    for world in range(1, 13):
        for tp in range(0, world + 2):
            for sp in range(0, world + 2):
                for fsdp in (-1, 0, *range(1, world + 2)):
                    ok = tp >= 1 and sp >= 1 and world % (tp * sp) == 0 and \
                        (fsdp == -1 or (fsdp >= 1 and (world // tp) % fsdp == 0 and fsdp % sp == 0))
                    if ok:
                        assert MeshShape.of(world, tp, sp, fsdp).world == world
                        continue
                    with pytest.raises(MeshError) as info:
                        MeshShape.of(world, tp, sp, fsdp)
                    assert "\n" not in str(info.value) and ("valid" in str(info.value) or "one of" in str(info.value))


def test_messages_name_the_keys_and_the_valid_sizes():
    with pytest.raises(MeshError, match=r"^actor\.tensor_parallel_size=3 does not divide trainer\.num_workers=8; "
                                        r"valid: 1, 2, 4, 8$"):
        MeshShape.of(8, tp=3)
    with pytest.raises(MeshError, match=r"^critic\.sequence_parallel_size=4 does not divide trainer\.num_workers=2; "
                                        r"valid: 1, 2$"):
        MeshShape.of(2, sp=4, role="critic")
    with pytest.raises(MeshError, match=r"^actor\.tensor_parallel_size=2 times actor\.sequence_parallel_size=2 is 4 "
                                        r"ranks, which does not divide trainer\.num_workers=6; valid products: 1, 2, 3, 6$"):
        MeshShape.of(6, tp=2, sp=2)
    with pytest.raises(MeshError, match=r"^critic\.fsdp_size=3 must divide the 4 data x sequence ranks .* valid: -1 "
                                        r"\(all 4\), 2, 4$"):
        MeshShape.of(8, tp=2, sp=2, fsdp_size=3, role="critic")
    with pytest.raises(MeshError, match=r"reward_model\.model\.sequence_parallel_size=0 must be >= 1"):
        MeshShape.of(4, sp=0, role="reward_model.model")
    with pytest.raises(MeshError, match=r"trainer\.num_workers=0 must be >= 1"):
        MeshShape.of(0)
    assert issubclass(MeshError, ValueError) and issubclass(MeshError, UserError)  # exit code 2 when it reaches the CLI


def test_tensor_parallel_divides_every_split_dimension():
    assert mesh_problems(MeshShape.of(2, tp=2), **QWEN_0_5B) == []
    problems = mesh_problems(MeshShape.of(6, tp=3), **QWEN_0_5B)
    assert problems[0] == ("actor.tensor_parallel_size=3 does not divide the model's 14 attention heads; valid: "
                           "1, 2, 7, 14; valid for every split dimension: 1, 2")
    assert [p.split(" does not divide the model's ")[1].split(";")[0] for p in problems] == [
        "14 attention heads", "2 key/value heads", "MLP width of 4864 (intermediate_size)", "vocabulary of 151936 tokens"]
    assert "valid (sizes up to the 14 attention heads): 1, 2, 4, 8;" in problems[3]  # 151936 = 2^7 x 1187
    vocab = mesh_problems(MeshShape.of(2, tp=2), num_heads=4, num_kv_heads=2, vocab_size=1001, intermediate_size=384,
                          role="critic")
    assert vocab == ["critic.tensor_parallel_size=2 does not divide the model's vocabulary of 1001 tokens; valid "
                     "(sizes up to the 4 attention heads): 1"]


@pytest.mark.parametrize("heads, kv, tp, sp, fits", [
    (14, 2, 1, 2, True),  # the kv heads split
    (14, 2, 1, 14, True),  # repeated 7 times
    (14, 2, 1, 7, False),  # 7 heads per rank, but 2 kv heads cannot be repeated to 7
    (14, 2, 2, 2, False),  # 7 heads per tensor-parallel rank: 2 does not divide them
    (28, 4, 2, 2, True),  # 14 heads, 2 kv heads per tensor-parallel rank
    (28, 4, 1, 8, False),  # 28 heads do not split 8 ways
    (12, 6, 1, 4, False),  # 4 does not divide the 6 kv heads, and is no multiple of them
    (12, 6, 1, 3, True),
    (32, 8, 4, 4, True),  # 8 heads, 2 kv heads per rank: repeated twice
])
def test_sequence_parallel_splits_the_heads_of_a_tensor_parallel_rank(heads, kv, tp, sp, fits):
    shape = MeshShape.of(tp * sp, tp=tp, sp=sp)
    problems = mesh_problems(shape, num_heads=heads, num_kv_heads=kv, vocab_size=1024, intermediate_size=1024)
    assert (problems == []) == fits, problems
    if not fits:
        assert len(problems) == 1 and problems[0].startswith(f"actor.sequence_parallel_size={sp} does not ")
        valid = [int(v) for v in problems[0].rsplit("valid: ", 1)[1].split(", ")]
        for size in divisors(heads // tp):  # the listed sizes are exactly those that fit
            ok = mesh_problems(MeshShape.of(tp * size, tp=tp, sp=size), num_heads=heads, num_kv_heads=kv,
                               vocab_size=1024, intermediate_size=1024) == []
            assert ok == (size in valid), size


def test_the_preflight_reads_a_models_dimensions_without_loading_it(tmp_path):
    """A vision-language model's language model dimensions (text_config); a config without key/value heads of its
    own is multi-head attention; the built-in tiny model's from model.tiny and its tokenizer."""
    from portrl.config import compose
    from portrl.trainer.mesh_check import model_dims

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "vision_config": {"num_heads": 16},
        "text_config": {"num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                        "intermediate_size": 18944}}))
    assert model_dims(compose(), str(tmp_path)) == {"model_type": "qwen2_5_vl", "num_heads": 28, "num_kv_heads": 4,
                                                    "vocab_size": 152064, "intermediate_size": 18944}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 32,
                                                      "vocab_size": 32000, "intermediate_size": 11008}))
    assert model_dims(compose(), str(tmp_path))["num_kv_heads"] == 32
    from portrl.models import write_tiny_model

    written = json.loads((write_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1) / "config.json").read_text())
    tiny = model_dims(compose(), None)
    assert tiny["model_type"] == "qwen2" and tiny["num_heads"] == 4 and tiny["vocab_size"] == written["vocab_size"]


def test_the_preflight_allows_tensor_parallelism_for_the_families_with_plans():
    from portrl.config.checks_mesh import TP_MODEL_TYPES
    from portrl.models.tensor_parallel import SUPPORTED

    assert tuple(TP_MODEL_TYPES) == SUPPORTED


@pytest.mark.parametrize("overrides, refused", [
    (["actor.lora_rank=8", "actor.sequence_parallel_size=2"], None),  # Ulysses takes peft's layers
    (["actor.lora_rank=8", "actor.tensor_parallel_size=2"], None),  # the adapters split with their layers
    (["actor.lora_rank=8", "actor.tensor_parallel_size=2", "actor.lora_target_modules=[q_proj,lm_head]"],
     "actor.lora_target_modules ['lm_head'] with actor.tensor_parallel_size=2"),
    (["actor.strategy=fsdp", "actor.tensor_parallel_size=2"], None),
    (["actor.strategy=ddp", "actor.sequence_parallel_size=2"], "actor.strategy=ddp cannot run the actor's mesh"),
    (["actor.strategy=ddp", "algorithm=ppo", "critic.tensor_parallel_size=2"], "cannot run the critic's mesh"),
    (["actor.strategy=ddp"], None),  # no mesh: data parallel alone
])
def test_the_config_refuses_lora_on_vocabulary_split_layers_and_a_mesh_without_fsdp(overrides, refused):
    from portrl.config import compose
    from portrl.config.checks_mesh import check_mesh

    problems = check_mesh(compose(overrides=["trainer.num_workers=2", *overrides], check=False))
    assert problems == [] if refused is None else (len(problems) == 1 and refused in problems[0]), problems


def test_the_preflight_refuses_a_mesh_where_fsdp2_cannot_run(monkeypatch):
    """actor.strategy=auto falls back to ddp where FSDP2 cannot run; a mesh is refused there before any model loads."""
    import portrl.trainer.mesh_check as mesh_check
    from portrl.config import compose
    from portrl.device.registry import get_backend

    cfg, backend = compose(overrides=["trainer.num_workers=2", "actor.sequence_parallel_size=2"]), get_backend("cpu")
    mesh_check.check_meshes(cfg, backend)  # FSDP2 runs on the CPU over gloo
    monkeypatch.setattr(mesh_check, "fsdp_supported", lambda b: (False, "torch 2.3 has no fully_shard"))
    with pytest.raises(UserError, match=r"^actor\.tensor_parallel_size=1, actor\.sequence_parallel_size=2: the mesh "
                                        r"shards the model with FSDP2, which cannot run here \(torch 2\.3 has no "
                                        r"fully_shard\); use both sizes 1 on this machine$"):
        mesh_check.check_meshes(cfg, backend)


@pytest.mark.parametrize("heads, kv, valid", [
    (28, 4, [1, 2, 4, 28]),  # Qwen2.5-7B: 7 and 14 divide the heads, but 4 key/value heads neither split nor copy evenly
    (40, 8, [1, 2, 4, 8, 40]),  # Qwen2.5-32B
    (64, 8, [1, 2, 4, 8, 16, 32, 64]),  # Qwen2.5-72B: above 8 workers each key/value head is copied
    (4, 2, [1, 2, 4]),  # the built-in tiny model
])
def test_the_rollout_split_follows_the_heads_and_key_value_heads(heads, kv, valid):
    from portrl.trainer.mesh_check import rollout_tp_sizes

    assert rollout_tp_sizes(heads, kv) == valid


def test_the_rollout_split_is_checked_only_for_engines_that_split(tmp_path):
    from portrl.config import compose
    from portrl.errors import UserError
    from portrl.trainer.mesh_check import check_rollout_split

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 28,
                                                      "num_key_value_heads": 4}))
    wrong = ["rollout.tensor_model_parallel_size=8", f"model.path={tmp_path}"]
    with pytest.raises(UserError, match=r"^rollout.tensor_model_parallel_size=8: .* has 28 attention heads and 4 "
                                        r"key/value heads; valid sizes: 1, 2, 4, 28$"):
        check_rollout_split(compose(overrides=wrong, check=False))
    check_rollout_split(compose(overrides=wrong + ["rollout.engine=hf"], check=False))  # one whole model per rank
    check_rollout_split(compose(overrides=["rollout.tensor_model_parallel_size=4", f"model.path={tmp_path}"],
                                check=False))
