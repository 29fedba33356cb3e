"""Settings of DAPO's overlong reward shaping (Yu et al. 2025, soft overlong punishment).

The formula, ``r_over = min(-(L - (Lmax - Lbuf)) / Lbuf * penalty_factor, 0)``, is
portrl.algo.overlong_penalty; this module checks the ``overlong_buffer`` config for it.
"""

from __future__ import annotations

from typing import Mapping


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
