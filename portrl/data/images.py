"""Images of vision-language rows, as verl's multimodal parquet stores them (``images`` beside ``prompt``).

A stored image is ``{"bytes": <PNG/JPEG/... bytes>, "path": str | None}``, the form Hugging Face ``datasets``
writes an image in, and the user turn of the prompt holds one ``<image>`` placeholder per image, in order
(verl's geo3k preprocessing writes such rows; verl's RL dataset splits the text at each placeholder).

* :func:`encode_image` turns what raw datasets hold (a PIL image, bytes, such a dict, a file path) into the
  stored form, checked to decode;
* :func:`check_row_images` checks a row's ``images`` column (a list, every image decodes, as many images as
  placeholders in the prompt); every problem is one :class:`~portrl.data.schema.DataError` naming the file, the
  row and the field;
* :func:`decode_image` opens a stored image as an RGB PIL image (what processors and engines take).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
from PIL import Image, UnidentifiedImageError

from portrl.data.schema import DataError

IMAGE_KEY = "images"
IMAGE_PLACEHOLDER = "<image>"
#: the arrow type of an ``images`` column (a list of datasets' image structs)
IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def _open(data: bytes) -> Image.Image:
    """The image ``data`` encodes, fully decoded (a truncated file fails here, not later)."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _image_bytes(value: Any) -> tuple[bytes, str | None]:
    """(encoded bytes, path) of a raw image; ValueError saying why it is none."""
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        fmt = value.format if value.format in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF") else "PNG"
        value.save(buffer, format=fmt)
        return buffer.getvalue(), None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), None
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return _image_bytes(data)[0], None if path is None else str(path)
        if path:
            return _image_bytes(str(path))[0], str(path)
        raise ValueError("a dict with neither 'bytes' nor 'path'")
    if isinstance(value, (str, Path)):
        p = Path(value).expanduser()
        if not p.is_file():
            raise ValueError(f"image file {str(value)!r} does not exist")
        return p.read_bytes(), str(value)
    raise ValueError(f"a {type(value).__name__}; an image is a PIL image, bytes, {{'bytes', 'path'}} or a file path")


def encode_image(value: Any, where: str, index: int, field: str = IMAGE_KEY) -> dict:
    """The stored form ``{"bytes", "path"}`` of a raw image (bytes kept as given, a PIL image saved in its own
    format or PNG, a file read); DataError naming the row when it is not an image that decodes."""
    try:
        data, path = _image_bytes(value)
        _open(data)
    except (ValueError, OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: row {index}: field {field!r} holds no decodable image ({_short(exc)}); "
                        "give PNG/JPEG bytes, {'bytes', 'path'}, a PIL image or an image file path") from None
    return {"bytes": data, "path": path}


def decode_image(value: Any) -> Image.Image:
    """A stored (or raw) image as an RGB PIL image."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    data, _ = _image_bytes(value)
    return _open(data).convert("RGB")


def count_placeholders(messages: list[dict]) -> int:
    """The ``<image>`` placeholders in the contents of chat messages."""
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)


def check_row_images(row: dict, where: str, index: int, messages: list[dict], image_key: str = IMAGE_KEY,
                     decode: bool = True) -> list | None:
    """The row's images (as stored), or None for a text row: a row of a file without an ``image_key`` column
    (where ``<image>`` is plain text, as in verl), or with no images and no placeholder.

    DataError, one line naming the file and row: the column is not a list; an image does not decode (checked
    with ``decode``); the count differs from the ``<image>`` placeholders of the prompt (a row with
    placeholders and a null or empty ``image_key`` is missing its images).
    """
    if image_key not in row:
        return None
    images = row[image_key]
    placeholders = count_placeholders(messages)
    if images is None or (isinstance(images, (list, tuple)) and not images and not placeholders):
        if placeholders:
            raise DataError(f"{where}: row {index}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) "
                            f"but field {image_key!r} is missing; each placeholder needs its image")
        return None
    if not isinstance(images, (list, tuple)):
        raise DataError(f"{where}: row {index}: field {image_key!r} must be a list of images, got "
                        f"{type(images).__name__}")
    if len(images) != placeholders:
        raise DataError(f"{where}: row {index}: field {image_key!r} has {len(images)} image(s) but the prompt has "
                        f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s); they must match, one placeholder per "
                        "image in order")
    if decode:
        for j, image in enumerate(images):
            encode_image(image, where, index, f"{image_key}[{j}]")
    return list(images)


def _short(exc: BaseException, n: int = 80) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."
