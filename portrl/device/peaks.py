"""What a device can do at best: each backend's peak table, per device model and dtype (``Backend.device_models``).

A :class:`PeakThroughput` is a dense matmul peak (FLOP/s in one dtype, no sparsity) and a memory read bandwidth
(bytes/s), with where the figures come from (a vendor datasheet, or "measured" for the CPU, which measures its own
when asked). MFU and the rooflines of portrl/trainer/speed.py divide by them; a device model with no published
figure declares none, and the run says "no peak figure" rather than a guess.

The model is ``device.model`` when a config names it (a device preset sets it), else detected from the device's
name as the vendor's runtime reports it (:func:`model_of_name`: the first declared model one of whose ``matches``
the lower-cased name contains, and none of its ``excludes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from portrl.errors import UserError


@dataclass(frozen=True)
class PeakThroughput:
    """``flops_per_s``: dense matmul FLOP/s in one dtype; ``bytes_per_s``: memory read bandwidth; ``source``: where
    the figures come from (a datasheet's name, or how they were measured)."""

    flops_per_s: float
    bytes_per_s: float
    source: str


@dataclass(frozen=True)
class DeviceModel:
    """One device model of a backend's peak table: its ``device.model`` name, the lower-case substrings of the
    runtime's device name that identify it (and those that rule it out: another form factor of the same chip, with
    other peaks), and its peaks by torch dtype name (empty: no published figure)."""

    name: str
    matches: tuple[str, ...]
    peaks: Mapping[str, PeakThroughput] = field(default_factory=dict)
    excludes: tuple[str, ...] = ()


def half_precision(flops_per_s: float, bytes_per_s: float, source: str) -> dict[str, PeakThroughput]:
    """The peaks of a device whose bf16 and fp16 matmuls run at the same rate, by dtype name."""
    peak = PeakThroughput(flops_per_s, bytes_per_s, source)
    return {"bfloat16": peak, "float16": peak}


def model_of_name(models: Sequence[DeviceModel], device_name: str) -> DeviceModel | None:
    """The declared model whose ``matches`` the device name contains and whose ``excludes`` it does not
    (case-insensitive), None when none is."""
    lowered = device_name.lower()
    for model in models:
        if any(m in lowered for m in model.matches) and not any(x in lowered for x in model.excludes):
            return model
    return None


def named_model(models: Sequence[DeviceModel], name: str, backend: str) -> DeviceModel:
    """The declared model called ``name``; UserError (one line, exit 2) listing the backend's models otherwise."""
    for model in models:
        if model.name == name:
            return model
    known = ", ".join(m.name for m in models) or "(none: this backend measures its own peaks)"
    raise UserError(f"device.model={name!r} is not a device model of backend {backend!r}; its models: {known}")
