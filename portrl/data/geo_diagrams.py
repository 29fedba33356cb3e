"""Self-drawn geometry problems with known answers, in hiyouga/geometry3k's raw form (``images``, ``problem``,
``answer``), for tests and smoke runs of the vision-language path without the real dataset.

Each problem is a diagram drawn with Pillow (a right triangle with labelled legs, a rectangle with labelled
sides, a circle with its radius, a triangle with two labelled angles) and a question whose answer follows from
the labels. Problems are deterministic by seed (and Pillow version). The raw rows go through
``portrl preprocess geo3k`` like the real dataset's::

    python -m portrl.data.geo_diagrams --output-dir geo-raw --n 64
    portrl preprocess geo3k --input geo-raw --output-dir ~/data/geo3k
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from portrl.data.images import IMAGE_PLACEHOLDER
from portrl.data.preprocess import write_split

TRIPLES = ((3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (7, 24, 25), (9, 12, 15))
KINDS = ("hypotenuse", "rectangle_area", "circle_diameter", "triangle_angle", "isosceles_hypotenuse")


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _canvas(size: int) -> tuple[Image.Image, ImageDraw.ImageDraw, ImageFont.ImageFont | ImageFont.FreeTypeFont]:
    image = Image.new("RGB", (size, size), "white")
    return image, ImageDraw.Draw(image), ImageFont.load_default()


def draw_problem(kind: str, rng: random.Random, size: int = 128) -> tuple[Image.Image, str, str]:
    """(diagram, problem text after the placeholder, answer) of one problem of ``kind`` (one of KINDS)."""
    image, draw, font = _canvas(size)
    m, s = size // 8, size - size // 8  # margins
    if kind in ("hypotenuse", "isosceles_hypotenuse"):
        a, b, c = rng.choice(TRIPLES) if kind == "hypotenuse" else (rng.randint(2, 9),) * 2 + (None,)
        draw.polygon([(m, s), (s, s), (m, m)], outline="black", width=2)
        draw.rectangle([m, s - size // 12, m + size // 12, s], outline="black")  # the right angle
        draw.text((size // 2, s + 2), str(b), fill="black", font=font)
        draw.text((2, size // 2), str(a), fill="black", font=font)
        draw.text((size // 2 + 4, size // 2 - 10), "x", fill="black", font=font)
        if c is None:
            return image, "Find x, the hypotenuse of the isosceles right triangle.", f"{a}\\sqrt{{2}}"
        return image, "Find x, the hypotenuse of the right triangle.", str(c)
    if kind == "rectangle_area":
        w, h = rng.randint(2, 12), rng.randint(2, 12)
        draw.rectangle([m, size // 4, s, 3 * size // 4], outline="black", width=2)
        draw.text((size // 2, 3 * size // 4 + 2), str(w), fill="black", font=font)
        draw.text((2, size // 2), str(h), fill="black", font=font)
        return image, "Find the area of the rectangle.", str(w * h)
    if kind == "circle_diameter":
        r = rng.randint(2, 20)
        c = size // 2
        draw.ellipse([m, m, s, s], outline="black", width=2)
        draw.line([(c, c), (s, c)], fill="black", width=2)
        draw.text((c + 4, c - 12), str(r), fill="black", font=font)
        return image, "Find the diameter of the circle.", str(2 * r)
    if kind == "triangle_angle":
        a, b = rng.randint(30, 80), rng.randint(30, 80)
        draw.polygon([(m, s), (s, s), (size // 2, m)], outline="black", width=2)
        draw.text((m + 4, s - 14), f"{a}", fill="black", font=font)
        draw.text((s - 18, s - 14), f"{b}", fill="black", font=font)
        draw.text((size // 2 - 3, m + 12), "x", fill="black", font=font)
        return image, "Find x, the angle in degrees.", str(180 - a - b)
    raise ValueError(f"unknown diagram kind {kind!r}; valid: {', '.join(KINDS)}")


def make_geo_diagram_records(n: int, seed: int = 0, size: int = 128) -> list[dict]:
    """``n`` raw records ``{"images": [{"bytes": PNG, "path": None}], "problem": "<image>...", "answer": str}``,
    the problem kinds in turn, their numbers drawn from ``seed``."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        image, problem, answer = draw_problem(KINDS[i % len(KINDS)], rng, size)
        records.append({"images": [{"bytes": _png(image), "path": None}], "problem": IMAGE_PLACEHOLDER + problem,
                        "answer": answer})
    return records


def write_geo_diagram_dataset(output_dir: str | Path, n: int = 64, n_test: int = 16, seed: int = 0,
                              size: int = 128) -> Path:
    """Write ``n`` train and ``n_test`` test records as ``train-00000-of-00001.parquet`` and
    ``test-00000-of-00001.parquet`` in ``output_dir`` (the layout of the dataset's Hub folder); returns it."""
    out = Path(output_dir)
    records = make_geo_diagram_records(n + n_test, seed=seed, size=size)
    write_split(records[:n], out / "train-00000-of-00001.parquet")
    if n_test:
        write_split(records[n:], out / "test-00000-of-00001.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portrl.data.geo_diagrams", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="folder for the raw train/test parquet")
    parser.add_argument("--n", type=int, default=64, help="training problems (default 64)")
    parser.add_argument("--n-test", type=int, default=16, help="test problems (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=128, help="diagram width and height in pixels (default 128)")
    args = parser.parse_args(argv)
    if args.n <= 0 or args.n_test < 0 or args.size < 32:
        parser.error("--n must be positive, --n-test >= 0, --size >= 32")
    out = write_geo_diagram_dataset(args.output_dir, args.n, args.n_test, args.seed, args.size)
    print(f"{args.n} train + {args.n_test} test problems -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
