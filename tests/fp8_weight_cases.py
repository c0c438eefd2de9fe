"""Random FP8 (e4m3) weight cases and their float64 reference, shared by the
FP8-weight linear kernels' tests (tests/kernels/test_fp8_gemm.py,
test_fp8_tiled_gemm.py)."""

from __future__ import annotations

import os

import torch

from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def random_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # no NaN codes: loaders reject them


def make_case(m, n, k, x_dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    w = random_codes(n, k, gen)
    scale = torch.rand(n, generator=gen) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=gen) if with_bias else None
    return x, w, scale, bias


def reference(x, w, scale, bias):
    """float64 output and sum |x| |w| per element (scale of the rounding error)."""
    wd = dequantize_fp8(w, 1.0, FP8_E4M3, torch.float32).double() * scale.double()[:, None]
    out = x.double() @ wd.t()
    if bias is not None:
        out = out + bias.double()
    return out, x.double().abs() @ wd.abs().t()


def assert_close(out, x, w, scale, bias, seed, what):
    ref, magnitude = reference(x, w, scale, bias)
    # float32 accumulation: a few ulps of sum |x||w|. bf16 output (and bf16
    # weights on the dequantize + GEMM path): rounding to 8 significant bits.
    rel = 1e-5 if x.dtype == torch.float32 else 2.0**-7
    bound = rel * (magnitude + ref.abs()) + 1e-6
    err = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    assert bool((err <= bound).all()), (
        f"{what}: seed={seed} max error {err.max().item():.3g}, worst error/bound {(err / bound).max().item():.3g}"
    )
