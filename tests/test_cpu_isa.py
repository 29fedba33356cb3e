"""Which instruction-set variant of the CPU's native kernels runs (backends/cpu/isa.py): from the CPU's flags,
capped by torch's CPU capability, forced by PORTRL_CPU_ISA; logged once and shown by ``portrl doctor``. The kernels
of each variant are tested in test_ops_cpu_native.py."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portrl.backends.cpu import isa
from portrl.backends.cpu.backend import kernels_check
from portrl.errors import UserError

ZEN4 = frozenset("sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16".split())
ZEN3 = frozenset("sse4_2 avx avx2 fma f16c".split())
IVY_BRIDGE = frozenset("sse4_2 avx f16c".split())


def test_the_best_variant_the_cpu_and_torch_run_is_chosen():
    assert isa.choose(ZEN4, "x86_64", "AVX512", "auto", True).variant == "avx512"
    zen3 = isa.choose(ZEN3, "x86_64", "AVX2", "auto", True)
    assert zen3.variant == "avx2" and "AVX-512 needs the CPU flags avx512f/avx512bw/avx512vl/avx512dq" in zen3.reason
    # avx2 alone is not enough: the kernel's FMAs need fma
    no_fma = isa.choose(frozenset({"avx2"}), "x86_64", "DEFAULT", "auto", True)
    assert no_fma.variant is None and "AVX2+FMA needs the CPU flags fma" in no_fma.reason
    old = isa.choose(IVY_BRIDGE, "x86_64", "DEFAULT", "auto", True)
    assert old.variant is None and "AVX2+FMA needs the CPU flags avx2/fma" in old.reason
    arm = isa.choose(frozenset({"asimd"}), "aarch64", "DEFAULT", "auto", True)
    assert arm.variant is None and "x86-64" in arm.reason


ZEN4_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: avx2\n"


def test_a_zen4_prefers_the_avx2_variant_unless_told():
    """Zen 4 runs AVX-512 on 256-bit units, where the AVX2 variant measured as fast or faster; Intel's AVX-512 and
    Zen 5 keep the AVX-512 variant; PORTRL_CPU_ISA=avx512 still gets it on a Zen 4."""
    zen4 = isa.cpu_identity(ZEN4_CPUINFO)
    assert zen4 == ("AuthenticAMD", 25) and isa.cpu_identity("flags\t: avx2\n") == ("", -1)
    auto = isa.choose(ZEN4, "x86_64", "AVX512", "auto", True, zen4)
    assert auto.variant == "avx2" and "256-bit units (PORTRL_CPU_ISA=avx512 for it)" in auto.reason
    assert isa.choose(ZEN4, "x86_64", "AVX512", "avx512", True, zen4).variant == "avx512"
    for other in (("GenuineIntel", 6), ("AuthenticAMD", 26)):
        assert isa.choose(ZEN4, "x86_64", "AVX512", "auto", True, other).variant == "avx512"
    # a Zen 3 (same family, no AVX-512) and a torch held to AVX2 are told nothing about AVX-512's width
    assert "256-bit" not in isa.choose(ZEN3, "x86_64", "AVX2", "auto", True, zen4).reason
    assert "256-bit" not in isa.choose(ZEN4, "x86_64", "AVX2", "auto", True, zen4).reason


def test_torch_capability_caps_the_choice():
    """A torch running as AVX2 (ATEN_CPU_CAPABILITY=avx2: an emulated AVX2 host) gets the AVX2 variant on an
    AVX-512 CPU; one running as DEFAULT gets none."""
    avx2 = isa.choose(ZEN4, "x86_64", "AVX2", "auto", True)
    assert avx2.variant == "avx2" and "it runs as AVX2" in avx2.reason
    assert isa.choose(ZEN4, "x86_64", "DEFAULT", "auto", True).variant is None
    assert isa.choose(ZEN4, "x86_64", "AVX2", "avx512", True).variant is None


def test_forcing_a_variant_or_off_and_a_compiler_is_needed():
    forced = isa.choose(ZEN4, "x86_64", "AVX512", "avx2", True)
    assert forced == isa.Choice("avx2", "AVX2+FMA variant (PORTRL_CPU_ISA=avx2)")
    cannot = isa.choose(ZEN3, "x86_64", "AVX2", "avx512", True)
    assert cannot.variant is None and "avx512f" in cannot.reason and "PORTRL_CPU_ISA=avx512" in cannot.reason
    assert isa.choose(ZEN4, "x86_64", "AVX512", "off", True) == isa.Choice(None, "PORTRL_CPU_ISA=off")
    no_cxx = isa.choose(ZEN4, "x86_64", "AVX512", "auto", False)
    assert no_cxx.variant is None and "C++ compiler" in no_cxx.reason


def test_a_bad_setting_is_one_line_naming_the_valid_ones():
    assert isa.setting({}) == "auto" and isa.setting({"PORTRL_CPU_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(UserError) as err:
        isa.setting({"PORTRL_CPU_ISA": "avx3"})
    message = str(err.value)
    assert "\n" not in message and "'avx3'" in message and "auto, avx512, avx2, off" in message


def test_a_bad_setting_stops_kernel_registration_and_fails_the_doctor_line(monkeypatch):
    from portrl.backends.cpu import kernels

    monkeypatch.setenv("PORTRL_CPU_ISA", "sse")
    with pytest.raises(UserError, match="PORTRL_CPU_ISA='sse' is not valid"):
        kernels.register(None)  # validated before anything is registered
    check = kernels_check()
    assert check.status == "fail" and "PORTRL_CPU_ISA" in check.message


def test_cpu_flags_and_the_torch_capability_estimate_read_cpuinfo_and_the_environment():
    text = "processor : 0\nmodel name : Some CPU\nflags : fpu avx2 fma\nprocessor : 1\nflags : fpu avx2 fma\n"
    flags = isa.cpu_flags(text)
    assert flags == {"fpu", "avx2", "fma"}
    assert isa.torch_capability_estimate(flags, {}) == "AVX2"
    assert isa.torch_capability_estimate(ZEN4, {}) == "AVX512"
    assert isa.torch_capability_estimate(ZEN4, {"ATEN_CPU_CAPABILITY": "avx2"}) == "AVX2"
    assert isa.torch_capability_estimate(ZEN4, {"ATEN_CPU_CAPABILITY": "default"}) == "DEFAULT"
    assert isa.torch_capability_estimate(IVY_BRIDGE, {"ATEN_CPU_CAPABILITY": "bogus"}) == "DEFAULT"


def test_the_doctor_line_names_the_variant_and_imports_no_torch():
    code = ("import sys; from portrl.backends.cpu.backend import kernels_check; c = kernels_check(); "
            "print(c.status, c.message); assert 'torch' not in sys.modules, 'doctor imported torch'")
    env = {**os.environ, "PORTRL_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    if isa.missing("avx2", isa.cpu_flags()) or not isa.compiler():
        assert done.stdout.startswith("warn")
    else:
        assert done.stdout.startswith("ok") and "AVX2+FMA variant (PORTRL_CPU_ISA=avx2)" in done.stdout


@pytest.mark.skipif(bool(isa.missing("avx2", isa.cpu_flags())) or not isa.compiler(), reason="needs AVX2 + FMA and g++")
def test_torch_running_as_avx2_chooses_the_avx2_variant_in_a_real_process():
    """ATEN_CPU_CAPABILITY=avx2 (torch reads it at start, hence a process of its own): the choice follows torch."""
    code = "from portrl.backends.cpu import isa; print(isa.chosen().variant)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2"]


def test_the_choice_is_logged_once(monkeypatch):
    monkeypatch.setattr(isa, "_logged", set())
    monkeypatch.setenv("PORTRL_CPU_ISA", "off")
    seen = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    isa.log.addHandler(handler)
    old_level = isa.log.level
    isa.log.setLevel(logging.INFO)
    try:
        for _ in range(3):
            assert isa.chosen() == isa.Choice(None, "PORTRL_CPU_ISA=off")
    finally:
        isa.log.removeHandler(handler)
        isa.log.setLevel(old_level)
    assert seen == ["native CPU kernels: off (PORTRL_CPU_ISA=off); the decode linear takes MKL's packed matmul, "
                    "SwiGLU torch's ops"]


def test_the_benchmarks_host_line_names_the_cpu_and_the_instruction_sets(monkeypatch):
    """benchmarks/_common.host_info (vs_trl's header and results): model, flags, torch's capability, the kernel
    variant and MKL's cap; variables that force them are said."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _common

    monkeypatch.setenv("PORTRL_CPU_ISA", "off")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    info = _common.host_info()
    assert info["portrl_kernels"] == "off" and info["mkl_enable_instructions"] == "AVX2"
    assert set(info["cpu_flags"]) <= set(_common.ISA_FLAGS) and info["cpu_model"]
    line = _common.host_line(info)
    assert line.startswith(f"CPU: {info['cpu_model']} (") and "\n" not in line
    assert "| portrl kernels off | MKL_ENABLE_INSTRUCTIONS=AVX2 | set: PORTRL_CPU_ISA=off" in line
