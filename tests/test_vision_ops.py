"""What the vision path adds to the ops: M-RoPE and its 3-D position index equal transformers' own functions, and
the vision tower's bidirectional attention through portrl's attention function equals transformers' eager one
(also when the decoder's packing keywords reach the vision blocks). Parity against float64 is
tests/test_parity_ops.py (cases attention_varlen_bidirectional and rotary_multimodal)."""

import pytest
import torch

from portrl.device import get_backend
from portrl.models import register_attention
from portrl.models.prefix_sharing import PLAN_KWARG
from portrl.ops import apply_multimodal_rotary, multimodal_rope_index, registry

IMAGE, VIDEO, START, END = 5, 6, 3, 4
SECTION = [2, 3, 3]  # head dim 16
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


def _config(family: str):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": SECTION})
    # patches of 2x2 pixels; Qwen2.5-VL windows of 4x4 patches (window_size 8 px), the middle block full attention
    if family == "qwen2_5_vl":
        cls, vision = Qwen2_5_VLConfig, dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2,
                                             out_hidden_size=32, window_size=8, patch_size=2,
                                             fullatt_block_indexes=[1])
    else:
        cls, vision = Qwen2VLConfig, dict(depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2,
                                          patch_size=2)
    return cls(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
               vision_start_token_id=START, vision_end_token_id=END)


def _model(family: str):
    from transformers import Qwen2_5_VLModel, Qwen2VLModel

    torch.manual_seed(0)
    return (Qwen2_5_VLModel if family == "qwen2_5_vl" else Qwen2VLModel)(_config(family)).eval()


GRIDS = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])


def _rows(g: torch.Generator):
    """Three left-padded rows: text + a 4x6 image + text; text only; two images (2x2, 6x4) between texts."""
    def row(parts):
        ids = []
        for p in parts:
            if isinstance(p, int):
                ids += torch.randint(10, 64, (p,), generator=g).tolist()
            else:
                ids += [START] + [IMAGE] * (p[0] * p[1] * p[2] // 4) + [END]
        return ids
    rows = [row([3, (1, 4, 6), 5]), row([2]), row([1, (1, 2, 2), 2, (1, 6, 4), 3])]
    length = max(map(len, rows))
    ids, mask = torch.full((3, length), 2), torch.zeros(3, length, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, length - len(r):], mask[b, length - len(r):] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_index_equals_transformers(family):
    model = _model(family)
    for seed in range(3):
        ids, mask = _rows(torch.Generator().manual_seed(seed))
        ref, ref_delta = model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=GRIDS, attention_mask=mask)
        mine, delta = multimodal_rope_index(ids, GRIDS, IMAGE, spatial_merge_size=2, attention_mask=mask)
        assert torch.equal(mine, ref * mask) and torch.equal(delta, ref_delta)
    # image tokens really get 2-D positions: the first row's image spans 2 merged rows and 3 columns
    img = ids[0] == IMAGE
    assert mine[1, 0, img].unique().numel() == 2 and mine[2, 0, img].unique().numel() == 3


def test_rope_index_rejects_inconsistent_inputs():
    ids, mask = _rows(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="image_grid_thw has 4 images but the rows hold 3"):
        multimodal_rope_index(ids, torch.cat([GRIDS, GRIDS[:1]]), IMAGE, 2, mask)
    with pytest.raises(ValueError, match="more image token runs than image_grid_thw has images"):
        multimodal_rope_index(ids, GRIDS[:2], IMAGE, 2, mask)
    with pytest.raises(ValueError, match="needs 24 image tokens"):
        multimodal_rope_index(ids, torch.tensor([[1, 8, 12], [1, 2, 2], [1, 6, 4]]), IMAGE, 2, mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_multimodal_rotary_equals_transformers(family):
    """transformers' rotary embedding of the 3-D positions then apply_rotary_pos_emb == the op on per-axis tables."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    config = _config(family).text_config
    rope = (Qwen2_5_VLRotaryEmbedding if family == "qwen2_5_vl" else Qwen2VLRotaryEmbedding)(config)
    ids, mask = _rows(torch.Generator().manual_seed(1))
    pos, _ = multimodal_rope_index(ids, GRIDS, IMAGE, 2, mask)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, ids.shape[1], 16, generator=g, dtype=torch.float64)
    k = torch.randn(3, 1, ids.shape[1], 16, generator=g, dtype=torch.float64)
    cos, sin = rope(q, pos)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    ang = pos.double()[..., None] * rope.inv_freq.double()
    table = torch.cat([ang, ang], dim=-1)[:, :, None]  # (3, B, 1, L, D): one table per axis, heads broadcast
    torch.testing.assert_close(apply_multimodal_rotary(q, table.cos(), table.sin(), SECTION), ref_q)
    torch.testing.assert_close(apply_multimodal_rotary(k, table.cos(), table.sin(), SECTION), ref_k)
    with pytest.raises(ValueError, match="mrope_section must be 3 non-negative sizes"):
        apply_multimodal_rotary(q, table.cos(), table.sin(), [4, 4, 4])
    assert registry.select("rotary_multimodal", backend="cpu") == ("native", apply_multimodal_rotary)


def _vision_inputs(config):
    vc = config.vision_config
    n = int(GRIDS.prod(-1).sum())
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g, dtype=torch.float64), n


def _tower(family: str, attn: str):
    """The model's vision tower (transformers' class) in float64 with attention implementation ``attn``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = _config(family)
    cls = Qwen2_5_VisionTransformerPretrainedModel if family == "qwen2_5_vl" else Qwen2VisionTransformerPretrainedModel
    torch.manual_seed(0)
    return cls._from_config(config.vision_config, attn_implementation=attn).double().eval(), config


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_through_portrl_attention_equals_transformers(family):
    """Every CPU implementation of the varlen op, bidirectional within each image (Qwen2-VL) or each image and
    window (Qwen2.5-VL), equals transformers' SDPA attention in float64 (its eager one takes the softmax in
    float32); the decoder's packing keywords (its cu_seq_lens_q, a shared-prompt plan) passed down the model's
    **kwargs change nothing."""
    ref_tower, config = _tower(family, "sdpa")
    x, n = _vision_inputs(config)
    with torch.no_grad():
        ref = ref_tower(x, grid_thw=GRIDS).pooler_output
    be = get_backend("cpu")
    for impl in registry.runnable("attention_varlen"):
        _, fn = registry.select("attention_varlen", impl=impl, backend=be)
        name = register_attention("cpu", impl, fn)
        tower, _ = _tower(family, name)
        assert tower.blocks[0].attn.config._attn_implementation == name
        text_cu = torch.tensor([0, 7, n + 3], dtype=torch.int32)  # the decoder's rows, not the vision tokens

        class Plan:  # a shared-prompt plan would gather decoder rows; the vision blocks must not read it
            reads = 0
        with torch.no_grad():
            out = tower(x, grid_thw=GRIDS).pooler_output
            packed = tower(x, grid_thw=GRIDS, cu_seq_lens_q=text_cu, cu_seq_lens_k=text_cu, max_length_q=n - 4,
                           max_length_k=n - 4, **{PLAN_KWARG: Plan()}).pooler_output
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12, msg=impl)
        torch.testing.assert_close(packed, ref, rtol=1e-10, atol=1e-12, msg=impl)
        assert Plan.reads == 0


def test_attention_names_never_say_flash(tmp_path):
    """transformers 5.x imports a flash-attention kernel for any implementation name containing "flash" and fails
    for ours: the op implementation 'flash_attn' still loads a model."""
    from transformers import AutoModelForCausalLM

    from portrl.models import write_tiny_model
    from portrl.ops import attention_varlen

    name = register_attention("cpu", "flash_attn", attention_varlen)
    assert "flash" not in name and name.startswith("portrl_cpu_")
    model = AutoModelForCausalLM.from_pretrained(str(write_tiny_model(tmp_path / "m")), attn_implementation=name,
                                                 local_files_only=True)
    assert model.config._attn_implementation == name
