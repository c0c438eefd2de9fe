"""The float64 reference of a gated form (a tiled GEMM's gate_up projection and SiLU-and-mul in one
kernel), shared by tests/kernels/test_bf16_tiled_gemm.py and test_fp8_tiled_gemm.py, and a recorder of
the rows that reach a gated op (those and test_dense_gemv_packed.py)."""

from __future__ import annotations

import torch

from fp8serve.utils.platform import cpu_flags

# silu_and_mul runs the gated forms' 8-lane loop on builds without AVX-512, so there a fused result
# has the two steps' bits; with AVX-512 its 16-lane loop rounds its reciprocal differently.
SAME_BITS_AS_TWO_STEPS = "avx512f" not in cpu_flags()


def assert_gated_close(out, ref, magnitude, seed, what):
    """out [M, d] against float64 silu(g) * u for [g, u] = ref [M, 2d] (the projection in float64,
    bias included), with g and u's float32 error bounds (1e-5 of magnitude + |ref|, magnitude the
    sum of |x| |w| per output) carried through: |silu'| <= 1.1."""
    d = ref.shape[1] // 2
    bound_gu = 1e-5 * (magnitude + ref.abs()) + 1e-6
    g, u = ref[:, :d], ref[:, d:]
    silu = g * torch.sigmoid(g)
    want = silu * u
    bound = 1.1 * u.abs() * bound_gu[:, :d] + silu.abs() * bound_gu[:, d:] + 1e-5 * want.abs() + 1e-6
    err = (out.double() - want).abs()
    assert out.dtype == torch.float32 and out.shape == want.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    assert bool((err <= bound).all()), (
        f"{what}: seed={seed} max error {err.max().item():.3g}, worst error/bound {(err / bound).max().item():.3g}")


def assert_two_steps_result(out, two_steps, seed, what):
    """A gated form's result against the two steps' (the projection, then silu_and_mul): the same bits
    where SAME_BITS_AS_TWO_STEPS, else within float32 rounding of silu's reciprocal."""
    if SAME_BITS_AS_TWO_STEPS:
        assert torch.equal(out, two_steps), (
            f"seed={seed} {what}: max diff {(out - two_steps).abs().max().item():.3g}")
    else:
        torch.testing.assert_close(out, two_steps, rtol=1e-6, atol=1e-6, msg=f"seed={seed} {what}")


def record_rows(monkeypatch, module, name: str) -> list[int]:
    """The rows of every call of the gated op `module.name` (x, packed, n, bias), the real op still run:
    which row counts reach a kernel's gated form."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda x, p, n, b=None: calls.append(x.shape[0]) or real(x, p, n, b))
    return calls
