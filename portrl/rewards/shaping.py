"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO", soft overlong punishment).

With L the response length, Lmax the max response length and Lbuf the buffer length:
``r_over = min(-(L - (Lmax - Lbuf)) / Lbuf * penalty_factor, 0)``, added to the task reward.
It is 0 up to Lmax - Lbuf tokens and falls linearly to -penalty_factor at Lmax.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def overlong_buffer_settings(overlong_buffer: Mapping | None, max_response_length: int | None) -> tuple[int, float] | None:
    """(buffer_len, penalty_factor) when shaping is enabled, else None; errors name the bad key."""
    if not overlong_buffer or not overlong_buffer.get("enable", False):
        return None
    unknown = set(overlong_buffer) - {"enable", "len", "penalty_factor", "log"}
    if unknown:
        raise ValueError(f"overlong_buffer has unknown keys {sorted(unknown)}; valid: enable, len, penalty_factor, log")
    buffer_len = int(overlong_buffer.get("len", 0))
    factor = float(overlong_buffer.get("penalty_factor", 1.0))
    if max_response_length is None or int(max_response_length) <= 0:
        raise ValueError("overlong_buffer.enable needs max_response_length > 0")
    if not 0 < buffer_len <= int(max_response_length):
        raise ValueError(f"overlong_buffer.len must be in (0, max_response_length={max_response_length}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"overlong_buffer.penalty_factor must be >= 0, got {factor}")
    return buffer_len, factor


def overlong_rewards(response_lengths: Sequence[int], max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> list[float]:
    """r_over for each length (see the module docstring)."""
    expected = max_response_length - buffer_len
    return [min(-(int(n) - expected) / buffer_len * penalty_factor, 0.0) for n in response_lengths]
