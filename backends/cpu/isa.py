"""Which instruction-set variant of the CPU's native kernels (backends/cpu/rows_linear.cpp, swiglu.cpp,
decode_attention.cpp) runs here.

Variants, best first: ``avx512`` (AVX-512 F/BW/VL/DQ, the CPUs torch itself runs as ``AVX512``: Intel Skylake-SP and
later, AMD Zen 4 and later) and ``avx2`` (AVX2 + FMA: Intel Haswell and later, AMD Zen 1-3, most laptops and cloud
VMs). The choice follows the CPU's flags (``/proc/cpuinfo``) and torch's own CPU capability, which caps it: a torch
that runs as AVX2 (``ATEN_CPU_CAPABILITY=avx2``, the way to emulate an AVX2-only host) gets the AVX2 variant, one
that runs as ``default`` none. A CPU that runs AVX-512 on 256-bit units (AMD Zen 4: :data:`HALF_WIDTH_AVX512`)
gets the AVX2 variant first, measured as fast or faster there. Where no variant can run (another architecture, a
CPU without AVX2 + FMA, no C++ compiler), the decode linear takes MKL's packed matmul and SwiGLU torch's ops.

``PORTRL_CPU_ISA`` forces the choice: ``avx512`` or ``avx2`` (that variant, when this CPU and torch can run it; else
none, with the reason), ``off`` (none: the fallbacks), ``auto`` or unset (the best that runs). Any other value is
a :class:`~portrl.errors.UserError` of one line. An AVX-512 host runs as an AVX2-only one (torch's ops, MKL's and
portrl's kernels) with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PORTRL_CPU_ISA=avx2``.

This module imports no torch (``portrl doctor`` shows the choice in a fraction of a second: :func:`doctor_choice`);
:func:`chosen` asks torch for its capability and logs the choice and its reason once (INFO).
"""

from __future__ import annotations

import logging
import os
import platform
from functools import lru_cache
from typing import NamedTuple

from portrl.errors import UserError

from .toolchain import compiler

ENV = "PORTRL_CPU_ISA"
SETTINGS = ("auto", "avx512", "avx2", "off")
#: the CPU flags each variant needs (Linux /proc/cpuinfo names), best variant first. AVX512: torch's own test for
#: its AVX512 capability (at::vec::Vectorized of 16 lanes needs BW/VL/DQ), AVX2: torch's for AVX2.
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"), "avx2": ("avx2", "fma")}
NAMES = {"avx512": "AVX-512", "avx2": "AVX2+FMA"}
#: the torch CPU capabilities under which each variant may run (torch's ops already use those instructions)
TORCH_ALLOWS = {"avx512": ("AVX512",), "avx2": ("AVX512", "AVX2")}
#: CPUs (``vendor_id``, ``cpu family`` of /proc/cpuinfo) that run AVX-512 on 256-bit units, each 512-bit
#: instruction in two passes, where ``auto`` prefers the AVX2 variant: AMD family 25 (Zen 4; Zen 3, the same
#: family, has no AVX-512), where the AVX2 variant was as fast or faster (docs/performance.md). Zen 5 (family 26)
#: has 512-bit units.
HALF_WIDTH_AVX512 = frozenset({("AuthenticAMD", 25)})

log = logging.getLogger(__name__)
_logged: set = set()


class Choice(NamedTuple):
    """The variant that runs (None: none, the fallbacks serve) and why, in words."""

    variant: str | None
    reason: str


def setting(environ: dict | os._Environ | None = None) -> str:
    """``PORTRL_CPU_ISA``'s value (``auto`` when unset or empty); a :class:`UserError` naming the valid ones for
    any other value."""
    value = (environ if environ is not None else os.environ).get(ENV, "").strip().lower() or "auto"
    if value not in SETTINGS:
        raise UserError(f"{ENV}={value!r} is not valid: use one of {', '.join(SETTINGS)} "
                        "(auto: the best this CPU runs)")
    return value


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    """The text of ``/proc/cpuinfo``, read once per process; empty where it cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _first_fields(cpuinfo: str) -> dict:
    """``key -> value`` of the first processor's lines of ``cpuinfo`` (the first of each key)."""
    fields: dict = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@lru_cache(maxsize=1)
def cpu_flags(cpuinfo: str | None = None) -> frozenset:
    """The CPU's feature flags (x86 ``flags`` and Arm ``Features`` lines of ``/proc/cpuinfo``; ``cpuinfo`` its
    text); empty where the file cannot be read (not Linux)."""
    found: set = set()
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            found.update(value.split())
    return frozenset(found)


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, int]:
    """The CPU's ``vendor_id`` and ``cpu family`` (x86 /proc/cpuinfo; ``cpuinfo`` its text); ``("", -1)`` where
    either is missing."""
    fields = _first_fields(_cpuinfo() if cpuinfo is None else cpuinfo)
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else -1


def preference(identity: tuple[str, int]) -> tuple[str, ...]:
    """The variants ``auto`` tries on a CPU of ``identity`` (:func:`cpu_identity`), first choice first."""
    return ("avx2", "avx512") if identity in HALF_WIDTH_AVX512 else tuple(NEEDS)


def cpu_model() -> str:
    """The CPU's model name (``model name`` of /proc/cpuinfo), else ``platform.processor()`` or the machine."""
    return _first_fields(_cpuinfo()).get("model name") or platform.processor() or platform.machine()


def missing(variant: str, flags: frozenset | set) -> tuple[str, ...]:
    """The flags ``variant`` needs that ``flags`` lacks (``()``: this CPU runs it)."""
    return tuple(f for f in NEEDS[variant] if f not in flags)


def torch_capability_estimate(flags: frozenset | set, environ: dict | os._Environ | None = None) -> str:
    """torch's CPU capability as torch computes it, without importing torch: ``ATEN_CPU_CAPABILITY`` when it is
    ``avx512``, ``avx2`` or ``default`` (torch trusts it), else AVX512 / AVX2 / DEFAULT from the CPU's flags."""
    env = (environ if environ is not None else os.environ).get("ATEN_CPU_CAPABILITY", "")
    if env in ("avx512", "avx2", "default"):
        return env.upper()
    return next((v.upper() for v in NEEDS if not missing(v, flags)), "DEFAULT")


def choose(flags: frozenset | set, machine: str, torch_capability: str, wanted: str, compiler_found: bool,
           identity: tuple[str, int] = ("", -1)) -> Choice:
    """The variant for a CPU of ``machine`` (``platform.machine()``) with ``flags`` and ``identity``
    (:func:`cpu_identity`: a Zen 4 prefers AVX2, :data:`HALF_WIDTH_AVX512`), torch running as ``torch_capability``
    (``torch.backends.cpu.get_cpu_capability()``), ``PORTRL_CPU_ISA`` = ``wanted``."""
    if wanted == "off":
        return Choice(None, f"{ENV}=off")
    if machine.lower() not in ("x86_64", "amd64"):
        return Choice(None, f"the native kernels need an x86-64 CPU (this one: {machine})")
    reasons = []
    order = (wanted,) if wanted in NEEDS else preference(identity)
    half_width = (order[0] == "avx2" and wanted == "auto" and not missing("avx512", flags)
                  and torch_capability in TORCH_ALLOWS["avx512"])  # AVX-512 would have run: say why it did not
    for variant in order:
        lacks = missing(variant, flags)
        if lacks:
            reasons.append(f"{NAMES[variant]} needs the CPU flags {'/'.join(lacks)}")
        elif torch_capability not in TORCH_ALLOWS[variant]:
            reasons.append(f"{NAMES[variant]} needs torch to run as {' or '.join(TORCH_ALLOWS[variant])}, it runs as "
                           f"{torch_capability}" + (f" (ATEN_CPU_CAPABILITY={_aten()})" if _aten() else ""))
        elif not compiler_found:
            return Choice(None, "the native kernels need a C++ compiler to build backends/cpu/*.cpp once "
                          "(install g++ or set CXX)")
        else:
            why = (f"{ENV}={wanted}" if wanted != "auto" else "; ".join(reasons) if reasons else
                   f"this CPU has {'/'.join(NEEDS[variant])}, torch runs as {torch_capability}{_aten_note()}")
            if half_width and variant == "avx2":
                why += (f"; preferred to AVX-512, which this CPU ({identity[0]} family {identity[1]}) runs on "
                        f"256-bit units ({ENV}=avx512 for it)")
            return Choice(variant, f"{NAMES[variant]} variant ({why})")
    return Choice(None, "; ".join(reasons) + (f" ({ENV}={wanted})" if wanted != "auto" else ""))


def _aten() -> str:
    return os.environ.get("ATEN_CPU_CAPABILITY", "")


def _aten_note() -> str:
    return f", ATEN_CPU_CAPABILITY={_aten()}" if _aten() else ""


def chosen() -> Choice:
    """The variant that runs in this process and why (:func:`choose` with torch's own capability); logs it once
    per distinct choice at INFO. Raises :class:`UserError` for a bad ``PORTRL_CPU_ISA``."""
    choice = _chosen(setting(), os.environ.get("CXX"), os.environ.get("PATH"))
    if choice not in _logged:
        _logged.add(choice)
        if choice.variant:
            log.info("native CPU kernels: %s", choice.reason)
        else:
            log.info("native CPU kernels: off (%s); the decode linear takes MKL's packed matmul, SwiGLU torch's ops",
                     choice.reason)
    return choice


@lru_cache(maxsize=16)
def _chosen(wanted: str, cxx: str | None, path: str | None) -> Choice:
    """:func:`chosen`'s choice, once per ``PORTRL_CPU_ISA`` / ``CXX`` / ``PATH`` (a process asks per call)."""
    import torch  # noqa: PLC0415  (torch: the doctor runs without it)

    return choose(cpu_flags(), platform.machine(), torch.backends.cpu.get_cpu_capability(), wanted,
                  compiler() is not None, cpu_identity())


def doctor_choice() -> Choice:
    """:func:`choose` for ``portrl doctor``, without torch: its capability estimated
    (:func:`torch_capability_estimate`).
    Raises :class:`UserError` for a bad ``PORTRL_CPU_ISA``."""
    flags = cpu_flags()
    return choose(flags, platform.machine(), torch_capability_estimate(flags), setting(), compiler() is not None,
                  cpu_identity())
