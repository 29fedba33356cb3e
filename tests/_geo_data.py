"""Small geo3k parquet for tests: self-drawn diagram problems (portrl/data/geo_diagrams.py) written in the raw
hiyouga/geometry3k form and converted by ``portrl preprocess geo3k`` (verl's multimodal rows)."""

from __future__ import annotations

from pathlib import Path

from portrl.data.geo_diagrams import write_geo_diagram_dataset
from portrl.data.preprocess import preprocess


def write_geo3k_parquet(out_dir: str | Path, n: int = 8, n_test: int = 4, seed: int = 0, size: int = 56
                        ) -> dict[str, Path]:
    """``{"train": .../train.parquet, "test": .../test.parquet}`` in ``out_dir``: ``n`` and ``n_test`` problems,
    one ``size`` x ``size`` diagram each (56: 4 image tokens with the tiny VL processor of
    portrl.models.write_tiny_vl_model). The raw rows are left in ``out_dir/raw``."""
    out = Path(out_dir)
    raw = write_geo_diagram_dataset(out / "raw", n=n, n_test=n_test, seed=seed, size=size)
    return preprocess("geo3k", out, raw)
