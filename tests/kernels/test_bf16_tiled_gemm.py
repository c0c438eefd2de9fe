"""bf16_tiled_gemm (cpu/bf16_tiled_gemm.cpp): float32 activations against a
bf16 weight's packed copy, checked against float64; which layers get the
copy under float32 compute (gemv_packing) and which rows the linear layers
send to it. Data is fresh on every run; a failure prints its seed."""

from __future__ import annotations

import os

import pytest
import torch

import gated_reference
from gated_reference import SAME_BITS_AS_TWO_STEPS
from thread_counts import at_one_and
from tiny_layers import tiny_bf16_model

from fp8serve.errors import ConfigError
from fp8serve.kernels import cpu_ops, gemv_packing
from fp8serve.utils import weight_copies

ops = cpu_ops.load_cpu_ops()
pytestmark = pytest.mark.skipif(not cpu_ops.bf16_tiled_gemm_built(),
                                reason="bf16_tiled_gemm needs the C++ kernels built with AVX2 and FMA")


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_case(m: int, n: int, k: int, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    return x, w, bias


def assert_close(out, x, w, bias, seed, what):
    """float32 sums along k against float64 on the same bf16 weights: a few
    ulps of sum |x| |w| per output."""
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref = ref + bias.double()
    magnitude = x.double().abs() @ w.double().abs().t()
    bound = 1e-5 * (magnitude + ref.abs()) + 1e-6
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32 and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    assert bool((err <= bound).all()), (
        f"{what}: seed={seed} max error {err.max().item():.3g}, worst error/bound {(err / bound).max().item():.3g}")


# (M, N, K): M short of, at and past whole 6-row tiles, and past one block
# of packed rows (264: prefills), with last tiles of every height (1-3 rows
# take more accumulator sets: an odd number of k pairs leaves a pair over);
# N a multiple of 16 and not (a partial last panel, N < 16); K = 2 (one pair)
# up to the default model's down projection, and past one K block (4096: a
# second block that adds to the first, three blocks of unequal size).
CASES = [(1, 16, 2), (5, 7, 8), (6, 48, 64), (17, 37, 96), (24, 1, 576), (64, 130, 576), (43, 33, 1536),
         (256, 19, 202), (300, 40, 100), (13, 35, 4098), (280, 17, 8196), (7, 16, 12290), (8, 24, 30),
         (15, 20, 10), (2, 16, 6), (9, 33, 578)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m, n, k", CASES)
def test_matches_float64_reference(m, n, k, with_bias):
    seed = fresh_seed()
    x, w, bias = make_case(m, n, k, with_bias, seed)
    out = ops.bf16_tiled_gemm(x, gemv_packing.pack_gemv_weight(w), n, bias)
    assert_close(out, x, w, bias, seed, f"M={m} N={n} K={k}")


@pytest.mark.parametrize("threads", [1, 2, 3])
# panels split; rows split; few of both; rows split past a row block with two K blocks
@pytest.mark.parametrize("m, n, k", [(40, 512, 320), (200, 20, 320), (2, 40, 320), (290, 20, 4100)])
def test_any_thread_count_gives_the_same_bits(m, n, k, threads):
    """Threads split the panels (wide N) or the row tiles (narrow N); each
    output's sums run in the same order either way."""
    seed = fresh_seed()
    x, w, bias = make_case(m, n, k, True, seed)
    packed = gemv_packing.pack_gemv_weight(w)
    one, many = at_one_and(threads, lambda: ops.bf16_tiled_gemm(x, packed, n, bias))
    assert torch.equal(one, many), f"seed={seed}: {threads} threads differ from one"
    assert_close(many, x, w, bias, seed, f"{threads} threads")


def test_empty_batch():
    packed = gemv_packing.pack_gemv_weight(torch.randn(24, 10).bfloat16())
    assert ops.bf16_tiled_gemm(torch.randn(0, 10), packed, 24, None).shape == (0, 24)


@pytest.mark.parametrize("case, message", [
    ("x_bf16", "x must be a contiguous float32"),
    ("packed_float", "packed must be a contiguous bf16 \\[ceil\\(N/16\\), K/2, 16, 2\\]"),
    ("k_mismatch", "x is \\[5, 18\\] but packed holds K = 16"),
    ("n_too_big", "n = 33 does not fit packed's 2 blocks of 16 rows"),
    ("n_too_small", "n = 16 does not fit packed's 2 blocks"),
    ("bias_bf16", "bias must be a contiguous float32 \\[N\\] tensor, N = 24"),
])
def test_rejects_bad_inputs(case, message):
    x, w, n, bias = torch.randn(5, 16), torch.randn(24, 16).bfloat16(), 24, None
    packed = gemv_packing.pack_gemv_weight(w)
    if case == "x_bf16":
        x = x.bfloat16()
    elif case == "packed_float":
        packed = packed.float()
    elif case == "k_mismatch":
        x = torch.randn(5, 18)
    elif case == "n_too_big":
        n = 33
    elif case == "n_too_small":
        n = 16
    elif case == "bias_bf16":
        bias = torch.ones(24, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        ops.bf16_tiled_gemm(x, packed, n, bias)


# The gated form (bf16_tiled_gemm_silu_and_mul): the two steps' bits where silu_and_mul runs its 8-lane loop
# (gated_reference.SAME_BITS_AS_TWO_STEPS), float64's answer everywhere.


def two_steps(x, packed, n, bias):
    return cpu_ops.silu_and_mul(ops.bf16_tiled_gemm(x, packed, n, bias))


def assert_gated_close(out, x, w, bias, seed, what):
    """Against float64 silu(g) * u, with g and u's float32 error bounds (assert_close's)
    carried through."""
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref = ref + bias.double()
    gated_reference.assert_gated_close(out, ref, x.double().abs() @ w.double().abs().t(), seed, what)


# (M, d, K): d = n / 2 whole panels (the fused loop) up to the default model's 1536, past one block
# of packed rows (300); d not a multiple of 16 and K past one K block (the two steps in the op).
GATED_CASES = [(1, 16, 2), (12, 32, 64), (17, 48, 576), (64, 1536, 576), (300, 64, 100), (13, 24, 96),
               (5, 3, 8), (7, 16, 4098)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m, d, k", GATED_CASES)
def test_gated_form_is_the_gemm_then_silu_and_mul(m, d, k, with_bias):
    seed = fresh_seed()
    x, w, bias = make_case(m, 2 * d, k, with_bias, seed)
    x *= 0.3
    if bias is not None:
        bias[: d : 5] -= 100.0  # gates below -80: silu_and_mul's exact branch for their 8-lane groups
    packed = gemv_packing.pack_gemv_weight(w)
    out = ops.bf16_tiled_gemm_silu_and_mul(x, packed, 2 * d, bias)
    assert_gated_close(out, x, w, bias, seed, f"M={m} d={d} K={k}")
    gated_reference.assert_two_steps_result(out, two_steps(x, packed, 2 * d, bias), seed, f"M={m} d={d} K={k}")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m, d", [(40, 256), (200, 16), (2, 48)])  # pairs split; rows split; few of both
def test_gated_form_any_thread_count_gives_the_same_bits(m, d, threads):
    seed = fresh_seed()
    x, w, bias = make_case(m, 2 * d, 320, True, seed)
    packed = gemv_packing.pack_gemv_weight(w)
    one, many = at_one_and(threads, lambda: ops.bf16_tiled_gemm_silu_and_mul(x, packed, 2 * d, bias))
    assert torch.equal(one, many), f"seed={seed}: {threads} threads differ from one"


def test_gated_form_rejects_bad_inputs():
    x, w = torch.randn(5, 16), torch.randn(34, 16).bfloat16()
    packed = gemv_packing.pack_gemv_weight(w)
    with pytest.raises(RuntimeError, match="n = 33: a gate_up projection has an even number of rows"):
        ops.bf16_tiled_gemm_silu_and_mul(x, gemv_packing.pack_gemv_weight(w[:33]), 33, None)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        ops.bf16_tiled_gemm_silu_and_mul(x.double(), packed, 34, None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 \\[N\\] tensor, N = 34"):
        ops.bf16_tiled_gemm_silu_and_mul(x, packed, 34, torch.ones(32))
    assert ops.bf16_tiled_gemm_silu_and_mul(torch.randn(0, 16), packed, 34, None).shape == (0, 17)


def merged_linear(output_sizes, w, bias):
    """A MergedLinear (float32 compute) holding weight w (bf16: kept at 16 bits) and bias."""
    from fp8serve.layers.linear import MergedLinear

    layer = MergedLinear(w.shape[1], output_sizes, bias=bias is not None, params_dtype=torch.float32)
    layer.quant_method.weight_dtype = w.dtype if w.dtype != torch.float32 else None
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer


def record_tiled_calls(monkeypatch):
    """([rows of each bf16_tiled_gemm call], the real op): the op as the
    layers reach it (cpu_ops.bf16_tiled_gemm), wrapped to record its rows."""
    calls = []
    real = cpu_ops.bf16_tiled_gemm
    monkeypatch.setattr(cpu_ops, "bf16_tiled_gemm",
                        lambda x, p, n, b=None: calls.append(x.shape[0]) or real(x, p, n, b))
    return calls, real


def test_float32_compute_packs_the_bf16_linears_and_head(monkeypatch):
    """Under float32 compute the bf16 linear layers and the bf16 LM head (50
    rows: 4 blocks of 16) get the packed copy; float32 layers do not."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.float32) == 64 * 32 * 2 + 64 * 32 * 2
    assert torch.equal(model.qkv.weight_gemv_packed, gemv_packing.pack_gemv_weight(model.qkv.weight))
    assert torch.equal(model.head.weight_gemv_packed, gemv_packing.pack_gemv_weight(model.head.weight))
    assert model.f32.weight_gemv_packed is None


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_layers_send_their_rows_to_it(monkeypatch, with_bias):
    """With the packed copy, float32 batches of BF16_TILED_GEMM_MIN_ROWS rows
    or more (decode batches and prefills) run bf16_tiled_gemm (its bits);
    fewer rows keep dense_gemv; the bound is a row breakpoint of the layer."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    seed = fresh_seed()
    _, w, bias = make_case(1, 64, 64, with_bias, seed)
    layer = merged_linear([40, 24], w, bias)
    model = torch.nn.Sequential(layer)
    assert gemv_packing.pack_gemv_weights(model, torch.float32) > 0
    lo = cpu_ops.BF16_TILED_GEMM_MIN_ROWS
    assert lo in layer.quant_method.row_breakpoints(layer, torch.float32)
    calls, real = record_tiled_calls(monkeypatch)
    for m in (lo - 1, lo, 256, 257, 600):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(seed + m))
        out = layer(x)
        assert_close(out, x, w, bias, seed, f"M={m}")
        if m >= lo:
            assert torch.equal(out, real(x, layer.weight_gemv_packed, 64, bias)), f"seed={seed} M={m}"
    assert calls == [lo, 256, 257, 600]


def test_layers_with_the_copy_get_no_float32_copy(monkeypatch):
    """Their float32 GEMMs all run bf16_tiled_gemm: oneDNN packs only the
    rest (float32 layers), and every layer without the bf16 copy when there
    is none."""
    from fp8serve.kernels import onednn_linear

    if not onednn_linear.packing_available(torch.float32):
        pytest.skip("oneDNN cannot pack float32 weights here")
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    for tiled in ("1", "0"):
        monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, tiled)
        model = tiny_bf16_model()
        gemv_packing.pack_gemv_weights(model, torch.float32)
        onednn_linear.pack_weights(model, torch.float32, widen=(torch.bfloat16,))
        assert (model.qkv.weight_gemv_packed is not None) == (tiled == "1")
        for layer in (model.qkv, model.head):
            assert (layer.weight_packed is None) == (tiled == "1"), f"{gemv_packing.PACKED_WEIGHTS_ENV}={tiled}"
        assert model.f32.weight_packed is not None


def test_auto_is_amd_and_intel_with_avx512_and_no_amx(monkeypatch):
    """Where the copy is made by default, whether oneDNN keeps its float32
    copy beside it (AVX-512 CPUs) or not (AVX2 AMD CPUs, and wherever =1
    forces the copies), and the rows it then serves (by vendor)."""
    from fp8serve.kernels import amx_linear_ops

    monkeypatch.delenv(gemv_packing.PACKED_WEIGHTS_ENV, raising=False)
    cases = ((True, {"avx2"}, False, True, False), (True, {"avx2", "avx512f"}, False, True, True),
             (False, {"avx2"}, False, False, True), (False, {"avx2", "avx512f"}, False, True, True),
             (False, {"avx2", "avx512f"}, True, False, True))
    for amd, flags, amx, wanted, keeps in cases:
        monkeypatch.setattr(gemv_packing, "is_amd_cpu", lambda amd=amd: amd)
        monkeypatch.setattr("fp8serve.utils.platform.cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(amx_linear_ops, "is_available", lambda amx=amx: amx)
        assert gemv_packing.float32_packing_applies() is wanted, (amd, flags, amx)
        assert gemv_packing.float32_packing_keeps_onednn() is keeps, (amd, flags, amx)
        assert gemv_packing.float32_rows_beside_onednn() == (
            cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD if amd else cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN)
    assert cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN == (8, 24)
    assert cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD == (8, 64)
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    assert gemv_packing.float32_packing_applies() is True
    assert gemv_packing.float32_packing_keeps_onednn() is False
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "0")
    assert gemv_packing.float32_packing_applies() is False
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.float32) == 0 and model.qkv.weight_gemv_packed is None


@pytest.mark.parametrize("amd", [False, True], ids=["intel", "amd"])
def test_on_avx512_decode_batches_run_it_and_larger_ones_keep_onednns_copy(monkeypatch, amd):
    """AVX-512 and no AMX, auto: the bf16 linears and the LM head get the
    packed copy and keep oneDNN's float32 copy; batches of this vendor's rows
    (BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN on Intel, ..._AMD on AMD) run
    bf16_tiled_gemm (its bits), fewer and more rows do not; both bounds are
    row breakpoints."""
    from fp8serve.kernels import amx_linear_ops, onednn_linear

    if not onednn_linear.packing_available(torch.float32):
        pytest.skip("oneDNN cannot pack float32 weights here")
    monkeypatch.delenv(gemv_packing.PACKED_WEIGHTS_ENV, raising=False)
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    monkeypatch.setattr(gemv_packing, "is_amd_cpu", lambda: amd)
    monkeypatch.setattr("fp8serve.utils.platform.cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    monkeypatch.setattr(amx_linear_ops, "is_available", lambda: False)
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.float32) > 0
    assert onednn_linear.pack_weights(model, torch.float32, widen=(torch.bfloat16,)) > 0
    lo, hi = cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD if amd else cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN
    for layer in (model.qkv, model.head):
        assert layer.weight_gemv_packed is not None and layer.weight_packed is not None
    breakpoints = model.qkv.quant_method.row_breakpoints(model.qkv, torch.float32)
    assert lo in breakpoints and hi + 1 in breakpoints
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    calls, real = record_tiled_calls(monkeypatch)
    for m in (lo - 1, lo, hi, hi + 1, 3 * hi):
        x = torch.randn(m, 32, generator=g)
        for name, layer in (("qkv", model.qkv), ("head", model.head)):
            out = layer(x)
            assert_close(out, x, layer.weight, None, seed, f"{name} M={m}")
            if lo <= m <= hi:
                assert torch.equal(out, real(x, layer.weight_gemv_packed, layer.weight.shape[0])), f"seed={seed}"
    assert calls == [lo, lo, hi, hi], calls


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "sometimes")
    with pytest.raises(ConfigError, match="FP8SERVE_GEMV_PACKED_WEIGHTS='sometimes': expected auto, 1 or 0"):
        gemv_packing.pack_gemv_weights(tiny_bf16_model(), torch.float32)


def test_skips_when_the_copy_does_not_fit(monkeypatch, caplog):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    monkeypatch.setattr(weight_copies, "available_memory_bytes", lambda: 2 * model.qkv.weight.nbytes)
    with caplog.at_level("INFO", logger="fp8serve.kernels.gemv_packing"):
        assert gemv_packing.pack_gemv_weights(model, torch.float32) == 0
    assert model.qkv.weight_gemv_packed is None
    assert "bf16_tiled_gemm: weights not packed: the copy needs" in caplog.text


def test_lm_head_runs_it_and_its_greedy_screen_agrees(monkeypatch):
    """A bf16 head under float32 compute: BF16_TILED_GEMM_MIN_ROWS or more rows
    run bf16_tiled_gemm on its packed copy (its bits), fewer keep dense_gemv; the screen's
    logits of a few vocabulary rows (`logits_of_rows`) equal the full
    logits' bit for bit on either path."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.float32) > 0
    head = model.head
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    calls, real = record_tiled_calls(monkeypatch)
    vocab_rows = torch.tensor([3, 0, 49, 17])
    lo = cpu_ops.BF16_TILED_GEMM_MIN_ROWS
    for m in (lo - 1, lo, 40):
        x = torch.randn(m, 32, generator=g)
        logits = head(x)
        assert_close(logits, x, head.weight, None, seed, f"head M={m}")
        few = head.logits_of_rows(x)
        assert few is not None and torch.equal(few(vocab_rows), logits[:, vocab_rows]), f"seed={seed} M={m}"
    assert calls == [lo, lo, 40, 40], calls  # the full head and the screen's rows, each on the kernel


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_an_mlp_gate_up_takes_the_gated_form_where_the_gemm_would_run(monkeypatch, with_bias):
    """SiluAndMul.of_projection on a bf16 [gate, up] layer with the packed copy: rows that
    bf16_tiled_gemm would serve run its gated form (the two steps' bits on AVX2 builds), fewer
    rows the layer and then the activation; a layer without the copy always the latter."""
    from fp8serve.layers.activation import SiluAndMul

    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    act = SiluAndMul()
    seed = fresh_seed()
    _, w, bias = make_case(1, 64, 64, with_bias, seed)
    layer = merged_linear([32, 32], w, bias)
    plain = merged_linear([32, 32], w.float(), bias)  # float32 weights: no packed copy
    assert gemv_packing.pack_gemv_weights(torch.nn.Sequential(layer, plain), torch.float32) > 0
    assert plain.weight_gemv_packed is None
    calls = gated_reference.record_rows(monkeypatch, cpu_ops, "bf16_tiled_gemm_silu_and_mul")
    lo = cpu_ops.BF16_TILED_GEMM_MIN_ROWS
    for m in (lo - 1, lo, 300):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(seed + m)) * 0.3
        out = act.of_projection(layer, x)
        assert_gated_close(out, x, w, bias, seed, f"M={m}")
        if SAME_BITS_AS_TWO_STEPS:
            assert torch.equal(out, act(layer(x))), f"seed={seed} M={m}"
        assert torch.equal(act.of_projection(plain, x), act(plain(x))), f"seed={seed} M={m}"
    assert calls == [lo, 300]
