"""FLOP and byte counts of portrl/plan/flops.py against values derived by hand, for each planned family (Qwen2 with
q/k/v biases and a tied head, Llama untied, Mistral with a head_dim other than hidden / heads, the language model of
Qwen2.5-VL under its vision tower), on tiny shapes read from config.json dictionaries."""

from __future__ import annotations

from portrl.plan.flops import (executed_train_flops, forward_params, prefill_flops, rollout_flops,
                               rollout_read_bytes, train_flops, verl_dense_params, weight_read_bytes)
from portrl.plan.shape import shape_of_raw


def _text(hidden, layers, heads, kv, inter, vocab, **extra):
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab, **extra}


QWEN2 = shape_of_raw({"model_type": "qwen2", "tie_word_embeddings": True, **_text(8, 2, 2, 1, 16, 32)}, "qwen2")
LLAMA = shape_of_raw({"model_type": "llama", "tie_word_embeddings": False, **_text(8, 1, 4, 2, 12, 20)}, "llama")
MISTRAL = shape_of_raw({"model_type": "mistral", **_text(8, 1, 2, 1, 8, 16, head_dim=8)}, "mistral")
VISION = {"hidden_size": 4, "depth": 1, "patch_size": 2, "temporal_patch_size": 1, "in_channels": 1,
          "spatial_merge_size": 1, "intermediate_size": 4, "out_hidden_size": 8}
QWEN25_VL = shape_of_raw({"model_type": "qwen2_5_vl", "tie_word_embeddings": True,
                          "text_config": _text(8, 1, 2, 2, 8, 16), "vision_config": VISION}, "qwen2_5_vl")


def test_qwen2_update_and_rollout():
    # h 8, L 2, a 2, k 1, d 4, i 16, V 32. A layer's matrices: q 8*2*4 = 64, k 8*1*4 = 32, v 32, o 64,
    # MLP 3*8*16 = 384 -> 576; N = 2*576 + 2*32*8 (embedding and head, tied or not) = 1152 + 512 = 1664
    assert verl_dense_params(QWEN2) == 1664
    # sequences of 3 and 5: 6*1664*8 = 79872; attention 12*(9 + 25)*d a L (4*2*2 = 16) = 6528
    assert train_flops(QWEN2, [3, 5]) == 86400
    # gradient checkpointing adds the layers' forward: 2*1152*8 = 18432 and 4*34*16 = 2176
    assert executed_train_flops(QWEN2, [3, 5], checkpointing=True) == 86400 + 20608
    assert executed_train_flops(QWEN2, [3, 5], checkpointing=False) == 86400
    # the two rows share a 2-token prompt, run once: T = 6, 6*1664*6 = 59904 + 6528; recomputed 2*1152*6 + 2176
    assert executed_train_flops(QWEN2, [3, 5], checkpointing=False, tokens=6) == 66432
    assert executed_train_flops(QWEN2, [3, 5], checkpointing=True, tokens=6) == 66432 + 13824 + 2176
    # N_fwd = 1152 + 32*8 (the head once) = 1408. Rows (p 2, r 1): s 3 -> 2*1408*2 + 2*16*3*2 = 5632 + 192;
    # (p 3, r 2): s 5 -> 2*1408*4 + 2*16*5*4 = 11264 + 640; total 5824 + 11904
    assert forward_params(QWEN2) == 1408
    assert rollout_flops(QWEN2, [2, 3], [1, 2]) == 17728
    # a 3-token prompt's prefill: 2*1408*3 + 2*16*3*4 = 8448 + 384
    assert prefill_flops(QWEN2, 3) == 8832


def test_qwen2_decode_bytes():
    # parameters: embedding 32*8 = 256 (tied: also the head); a layer: attention 64+32+32+64 + biases (8 + 2*4) = 208,
    # MLP 384, norms 16 -> 608; body 2*608 + final norm 8 = 1224; 1480 parameters, every one read: 5920 float32 bytes
    assert weight_read_bytes(QWEN2, 4) == 5920
    # responses of 1 and 2 tokens: the prefill and 1 decode step read the weights twice = 11840; the cache: row 2's
    # one decode step reads its 3 prompt tokens + 1 generated = 4 tokens x (2 L k d = 16 elements) x 4 bytes = 256
    assert rollout_read_bytes(QWEN2, [2, 3], [1, 2], 4) == (11840, 256)
    # a float16 cache under float32 weights: 4 tokens x 16 x 2 bytes
    assert rollout_read_bytes(QWEN2, [2, 3], [1, 2], 4, kv_dtype_bytes=2) == (11840, 128)


def test_llama_untied_head():
    # h 8, L 1, a 4, k 2, d 2, i 12, V 20: q 8*4*2 = 64, k 8*2*2 = 32, v 32, o 64, MLP 3*8*12 = 288 -> 480;
    # N = 480 + 2*20*8 = 800
    assert verl_dense_params(LLAMA) == 800
    # one sequence of 4: 6*800*4 = 19200; 12*16*(d a L = 2*4*1 = 8) = 1536
    assert train_flops(LLAMA, [4]) == 20736
    # no biases: attention 192, MLP 288, norms 16 -> 496; body 504; embedding 160 (not read by a decode step: its rows
    # are gathered), head 160: 664 parameters read, 1328 bfloat16 bytes
    assert weight_read_bytes(LLAMA, 2) == 1328
    # 3 decode steps after the prefill for a response of 4 after a prompt of 2: cache 3*2 + 4*3/2 = 12 tokens x
    # (2*1*2*2 = 8 elements) x 2 bytes = 192
    assert rollout_read_bytes(LLAMA, [2], [4], 2) == (4 * 1328, 192)


def test_mistral_head_dim_apart_from_hidden():
    # head_dim 8 while hidden / heads = 4: q 8*2*8 = 128, k 8*1*8 = 64, v 64, o 128, MLP 3*8*8 = 192 -> 576;
    # N = 576 + 2*16*8 = 832
    assert MISTRAL.head_dim == 8
    assert verl_dense_params(MISTRAL) == 832
    # sequences 2, 2, 3: 6*832*7 = 34944; 12*(4 + 4 + 9)*(8*2*1 = 16) = 3264
    assert train_flops(MISTRAL, [2, 2, 3]) == 38208
    # N_fwd = 576 + 128 = 704; one row p 1, r 2: s 3 -> 2*704*2 + 2*16*3*2 = 2816 + 192
    assert rollout_flops(MISTRAL, [1], [2]) == 3008


def test_qwen25_vl_counts_its_language_model_only():
    # the language model: h 8, L 1, a 2, k 2, d 4, i 8, V 16, tied: q, k, v, o 64 each, MLP 3*8*8 = 192 -> 448;
    # N = 448 + 2*16*8 = 704 (verl's count for qwen2_5_vl is its Qwen2 count: the vision tower is not in it)
    assert QWEN25_VL.vision_params > 0
    assert verl_dense_params(QWEN25_VL) == 704
    # one sequence of 6: 6*704*6 = 25344; 12*36*(4*2*1 = 8) = 3456
    assert train_flops(QWEN25_VL, [6]) == 28800
    # read per forward: attention 256 + biases (8 + 16) = 280, MLP 192, norms 16 -> 488; body 496; tied table 128;
    # the vision tower left out: 624 parameters, 1248 bfloat16 bytes
    assert weight_read_bytes(QWEN25_VL, 2) == 1248
