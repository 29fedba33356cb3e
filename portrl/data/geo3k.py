"""Geometry3K raw rows ({"images", "problem", "answer"}) -> verl's multimodal rows (``portrl preprocess geo3k``).

The rows are the ones verl's geo3k preprocessing example writes from hiyouga/geometry3k: ``data_source``
``hiyouga/geometry3k``, one user message ``problem + " " + GEO3K_INSTRUCTION`` (the problem holds the ``<image>``
placeholder, as in the dataset), ``images`` (the row's images as ``{"bytes", "path"}``), ``ability`` ``math``,
``reward_model`` ``{"style": "rule", "ground_truth": answer}`` and ``extra_info`` ``{split, index, answer,
question}``; portrl.rewards.geo3k scores them.

Differences, both only where verl's script would write a row its own trainer cannot use: a problem without any
``<image>`` placeholder gets one per image in front (the dataset's problems all start with one), and a numeric
answer is written as the number it is (``57.0`` -> ``"57"``). Images given as bytes are kept byte for byte
(``datasets`` may re-encode them: the decoded pixels are the same).
"""

from __future__ import annotations

from portrl.data.images import IMAGE_PLACEHOLDER, encode_image
from portrl.data.schema import DataError, field
from portrl.rewards.text import ground_truth_text

DATA_SOURCE = "hiyouga/geometry3k"
#: verl's instruction for geo3k (the reward reads the <think> block and the last \boxed{})
GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)


def _answer(rec: dict, where: str, i: int) -> str:
    answer = rec.get("answer") if isinstance(rec, dict) else None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        text = ground_truth_text(answer)
        if text not in ("nan", "inf", "-inf"):
            return text
    answer = field(rec, "answer", where, i)  # DataError naming the row: missing, or not a string
    if not answer.strip():
        raise DataError(f"{where}: row {i}: field 'answer' is empty; every row needs the answer it is scored against")
    return answer


def convert(records: list[tuple[str, int, dict]], split: str) -> list[dict]:
    """verl rows from (file, row index, raw record) triples; DataError (one line) naming a bad row."""
    rows: list[dict] = []
    for where, i, rec in records:
        problem = field(rec, "problem", where, i)
        answer = _answer(rec, where, i)
        raw_images = rec.get("images")
        if raw_images is None:
            raise DataError(f"{where}: row {i}: field 'images' is missing; geo3k rows have a list of images")
        if not isinstance(raw_images, (list, tuple)):
            raw_images = [raw_images]  # a single image column (datasets' Image feature, not a Sequence)
        if not raw_images:
            raise DataError(f"{where}: row {i}: field 'images' is empty; geo3k rows have at least one image")
        images = [encode_image(img, where, i, f"images[{j}]") for j, img in enumerate(raw_images)]
        placeholders = problem.count(IMAGE_PLACEHOLDER)
        if placeholders == 0:
            problem = IMAGE_PLACEHOLDER * len(images) + problem
        elif placeholders != len(images):
            raise DataError(f"{where}: row {i}: field 'problem' has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) "
                            f"but the row has {len(images)} image(s); they must match, one placeholder per image")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}],
            "images": images,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(rows), "answer": answer, "question": problem},
        })
    return rows
