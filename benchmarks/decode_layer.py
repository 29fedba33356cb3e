"""A decode step's layer side by side in one run: the CPU's one-call layer (op ``decode_layer``, implementation
``fused``: backends/cpu/decode_layer.cpp) against its four linears alone (the rows kernel, ``rows_linear``, on the
same weights and row count), on the vs_trl configurations' decode shapes, over distinct layers of random weights (as
many as the model has, so that the weights stream from memory or the last-level cache as they do in a decode step).

For each shape it prints the median milliseconds for all its layers, the weight read rate (GB/s: the layers' weights
over the time) and fused / linears: the share of the layer's time its glue costs (norms, rotary, attention, SwiGLU,
the residuals, the phases' waits), which can fall below 1 where the linears alone leave a thread idle. Compare within
one run. It runs in the environment portrl commands give themselves (portrl/process_env.py: ``GOMP_SPINCOUNT=1000``,
under which a sleeping OpenMP thread wakes for each parallel region, and ``THP_MEM_ALLOC_ENABLE=1``) unless you set
those variables; with libgomp's default spin the linears alone pay no wakes and the ratios rise (0.5B: 1.10).

    python benchmarks/decode_layer.py
    python benchmarks/decode_layer.py --threads 1 --repeats 20
"""

from __future__ import annotations

import argparse

from portrl import process_env

process_env.apply_defaults()  # before torch loads libgomp (module docstring)

import torch  # noqa: E402

import _common  # noqa: E402
from portrl.backends.cpu import isa, native_build  # noqa: E402
from portrl.backends.cpu.decode_layer import LIBRARY  # noqa: E402

#: name -> (rows, hidden, heads, KV heads, head dim, intermediate, layers, keys): the decode steps of vs_trl's
#: configurations (32 rows of 8 prompts x 4 samples; Qwen2.5-0.5B: 4 x 4 rows, ~120 prompt tokens plus new ones)
SHAPES = {"small": (32, 128, 4, 2, 32, 512, 2, 40), "medium": (32, 512, 8, 2, 64, 2048, 4, 40),
          "medium 16 rows": (16, 512, 8, 2, 64, 2048, 4, 40),
          "qwen2.5-0.5b": (16, 896, 14, 2, 64, 4864, 24, 180)}


def layer_inputs(rows, hidden, heads, kv, d, inter, keys, g):
    """One layer's arguments of the op (weights scaled as an initialised model's, keys stored transposed)."""
    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    angle = torch.rand(rows, d, generator=g) * 6
    hidden_keys = torch.rand(rows, keys, generator=g) < 0.2
    hidden_keys[:, -1] = False
    return dict(x=torch.randn(rows, hidden, generator=g), ln1=torch.ones(hidden),
                qkv_w=[w(heads * d, hidden), w(kv * d, hidden), w(kv * d, hidden)],
                qkv_b=torch.randn((heads + 2 * kv) * d, generator=g) * 0.1, o_w=w(hidden, heads * d), o_b=None,
                ln2=torch.ones(hidden), gate_up_w=[w(inter, hidden), w(inter, hidden)], down_w=w(hidden, inter),
                k_store=torch.randn(rows, kv, d, keys + 8, generator=g),
                v_cache=torch.randn(rows, kv, keys + 8, d, generator=g), cos=angle.cos(), sin=angle.sin(),
                hidden=hidden_keys, start=keys - 1, eps1=1e-6, eps2=1e-6, scale=d ** -0.5, heads=heads, kv_heads=kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = isa.chosen().variant
    if variant is None or not native_build.try_load(LIBRARY, variant) or not native_build.try_load("rows_linear",
                                                                                                  variant):
        raise SystemExit(f"decode_layer.py: no CPU kernels here ({isa.chosen().reason})")
    layer = getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant)).layer
    rows_linear = getattr(torch.ops, native_build.ops_namespace("rows_linear", variant)).rows_linear
    print(f"host: {isa.cpu_model()}; variant {variant}; torch threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    for name, (rows, hidden, heads, kv, d, inter, n_layers, keys) in SHAPES.items():
        layers = [layer_inputs(rows, hidden, heads, kv, d, inter, keys, g) for _ in range(n_layers)]
        outs = [tuple(torch.empty(rows, n) for n in ((heads + 2 * kv) * d, hidden, 2 * inter, hidden))
                for _ in layers]
        h, act = torch.randn(rows, hidden, generator=g), torch.randn(rows, inter, generator=g)

        def fused():
            for a, o in zip(layers, outs):
                layer(*a.values(), *o)  # x, the caches and the outputs in place: the same work every repeat

        def linears():
            for a in layers:
                rows_linear(h, a["qkv_w"], a["qkv_b"], -1)
                rows_linear(h, [a["o_w"]], None, -1)
                rows_linear(h, a["gate_up_w"], None, -1)
                rows_linear(act, [a["down_w"]], None, -1)

        gb = n_layers * 4 * sum(t.numel() for a in layers[:1] for t in (*a["qkv_w"], a["o_w"], *a["gate_up_w"],
                                                                          a["down_w"])) / 1e9
        t_fused, t_lin = _common.timed(fused, 1, args.repeats), _common.timed(linears, 1, args.repeats)
        print(f"{name} ({rows} rows, {n_layers} layers, {gb * 1e3:.0f} MB of weights): fused {t_fused * 1e3:.2f} ms "
              f"({gb / t_fused:.1f} GB/s), four linears alone {t_lin * 1e3:.2f} ms ({gb / t_lin:.1f} GB/s); "
              f"fused / linears {t_fused / t_lin:.3f}", flush=True)


if __name__ == "__main__":
    main()
