"""`--dtype auto` on CPU: bf16 only where the CPU multiplies it natively."""

import pytest
import torch

from fp8serve.utils import platform


@pytest.mark.parametrize(
    "flags, expected",
    [
        (set(), torch.float32),  # AVX2-only: bf16 is emulated, float32 is ~8x faster
        ({"avx2", "fma", "f16c"}, torch.float32),
        ({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16),
    ],
)
def test_auto_compute_dtype_follows_the_cpu(monkeypatch, flags, expected):
    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    assert platform.fastest_cpu_compute_dtype.__wrapped__() == expected


def test_avx512_bf16_alone_is_decided_by_timing(monkeypatch):
    monkeypatch.setattr(platform, "cpu_flags", lambda: {"avx512_bf16"})
    timings = {torch.float32: 100.0, torch.bfloat16: 300.0}
    monkeypatch.setattr(platform, "_matmul_gflops", lambda x, w: timings[x.dtype])
    assert platform.fastest_cpu_compute_dtype.__wrapped__() == torch.bfloat16
    timings[torch.bfloat16] = 110.0  # not clearly faster: keep float32
    assert platform.fastest_cpu_compute_dtype.__wrapped__() == torch.float32


def test_a_disturbed_timing_round_does_not_decide(monkeypatch):
    """Each dtype's best of the alternating rounds counts: bf16 timed slow in
    all but one round (a busy machine) is still bf16, float32 timed slow once
    is still float32's best."""
    monkeypatch.setattr(platform, "cpu_flags", lambda: {"avx512_bf16"})
    rounds = platform.MATMUL_TIMING_ROUNDS
    samples = {torch.float32: [160.0] * (rounds - 1) + [40.0],
               torch.bfloat16: [90.0] * (rounds - 1) + [400.0]}
    calls = {torch.float32: 0, torch.bfloat16: 0}

    def measured(x, w):
        value = samples[x.dtype][calls[x.dtype]]
        calls[x.dtype] += 1
        return value

    monkeypatch.setattr(platform, "_matmul_gflops", measured)
    assert platform.fastest_cpu_compute_dtype.__wrapped__() == torch.bfloat16
    assert calls == {torch.float32: rounds, torch.bfloat16: rounds}


def test_cpu_vendor_reads_proc_cpuinfo():
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    lines = [ln for ln in info.read_text().splitlines() if ln.startswith("vendor_id")] if info.exists() else []
    expected = lines[0].split(":", 1)[1].strip() if lines else ""
    assert platform.cpu_vendor() == expected


def test_cpu_vendor_is_empty_without_cpuinfo(monkeypatch):
    def no_file(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(platform, "open", no_file, raising=False)
    assert platform.cpu_vendor() == ""


def test_is_amd_cpu_follows_the_vendor():
    assert platform.is_amd_cpu() == (platform.cpu_vendor() == "AuthenticAMD")
