"""gemv_packing: the packed layout, which layers get a copy, and when."""

from __future__ import annotations

import pytest
import torch

from tiny_layers import tiny_bf16_model

from fp8serve.errors import ConfigError
from fp8serve.kernels import cpu_ops, gemv_packing
from fp8serve.utils import weight_copies

_ops = cpu_ops.load_cpu_ops()
needs_kernel = pytest.mark.skipif(_ops is None or not bool(_ops.dense_gemv_has_packed()),
                                  reason="dense_gemv_packed needs the C++ kernels built for AVX512-BF16")


@pytest.mark.parametrize("n,k", [(35, 6), (32, 576), (1, 2)])
def test_pack_gemv_weight_layout(seed, n, k):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    p = gemv_packing.pack_gemv_weight(w)
    blocks = -(-n // 16)
    assert p.shape == (blocks, k // 2, 16, 2) == gemv_packing.packed_shape(n, k) and p.is_contiguous()
    for b, pair, j, i in [(0, 0, 0, 0), (blocks - 1, k // 2 - 1, (n - 1) % 16, 1), (0, k // 2 - 1, 0, 1)]:
        assert torch.equal(p[b, pair, j, i], w[16 * b + j, 2 * pair + i])
    # Every element, and zeros past N.
    full = p.permute(0, 2, 1, 3).reshape(blocks * 16, k)
    assert torch.equal(full[:n], w) and not full[n:].any()


def test_pack_gemv_weight_rejects_bad_input():
    with pytest.raises(ValueError, match=r"2-D bf16 CPU weight \[N, K\], got torch.float32"):
        gemv_packing.pack_gemv_weight(torch.ones(4, 8))
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(8,\)"):
        gemv_packing.pack_gemv_weight(torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\(4, 7\) needs N >= 1 and an even K"):
        gemv_packing.pack_gemv_weight(torch.ones(4, 7, dtype=torch.bfloat16))


@needs_kernel
def test_pack_gemv_weights_packs_bf16_layers_once_and_they_read_it(monkeypatch):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    packed = gemv_packing.pack_gemv_weights(model, torch.bfloat16)
    # The tied head and its embedding share one copy (50 rows padded to 64).
    assert packed == 64 * 32 * 2 + 64 * 32 * 2
    assert model.head.weight_gemv_packed is not None and model.f32.weight_gemv_packed is None
    assert torch.equal(model.qkv.weight_gemv_packed, gemv_packing.pack_gemv_weight(model.qkv.weight))
    calls = []
    real = cpu_ops.dense_gemv_packed
    monkeypatch.setattr(cpu_ops, "dense_gemv_packed",
                        lambda x, p, n, b=None, **kw: calls.append(n) or real(x, p, n, b, **kw))
    x = torch.randn(80, 32).bfloat16()  # a batch the packed copy serves (past amx_linear's 8-64 rows on AMX CPUs)
    torch.testing.assert_close(model.qkv(x).double(), x.double() @ model.qkv.weight.double().t(),
                               rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(model.head(x).double(), x.double() @ model.embed.weight.double().t(),
                               rtol=2**-7, atol=1e-2)
    assert calls == [64, 50]  # qkv, then the tied head, both from their packed copies
    model.qkv(x[:4])  # a small batch: the plain rows' dense_gemv (or F.linear), not the packed copy
    assert calls == [64, 50]
    model.head(x[:1])  # the LM head reads its packed copy from one row
    assert calls == [64, 50, 50]


@pytest.mark.parametrize("setting", ["0", "off"])
def test_pack_gemv_weights_off(monkeypatch, setting):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, setting)
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.bfloat16) == 0
    assert model.qkv.weight_gemv_packed is None and model.head.weight_gemv_packed is None


def test_pack_gemv_weights_not_for_fp16_compute(monkeypatch):
    """bf16 compute packs for the bf16 GEMVs, float32 compute for bf16_tiled_gemm
    (tests/kernels/test_bf16_tiled_gemm.py); fp16 compute has no packed kernel."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.float16) == 0
    assert model.qkv.weight_gemv_packed is None


def test_auto_is_amd_without_amx(monkeypatch):
    from fp8serve.kernels import amx_linear_ops

    monkeypatch.delenv(gemv_packing.PACKED_WEIGHTS_ENV, raising=False)
    built = type("Ops", (), {"dense_gemv_has_packed": lambda self: True})()
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: built)
    for amd, amx, wanted in ((True, False, True), (True, True, False), (False, False, False)):
        monkeypatch.setattr(gemv_packing, "is_amd_cpu", lambda amd=amd: amd)
        monkeypatch.setattr(amx_linear_ops, "is_available", lambda amx=amx: amx)
        assert gemv_packing.packing_applies() is wanted, (amd, amx)
    # A build without the kernel never packs, whatever the environment says.
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    not_built = type("Ops", (), {"dense_gemv_has_packed": lambda self: False})()
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: not_built)
    assert gemv_packing.packing_applies() is False


@needs_kernel
def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "sometimes")
    with pytest.raises(ConfigError, match="FP8SERVE_GEMV_PACKED_WEIGHTS='sometimes': expected auto, 1 or 0"):
        gemv_packing.pack_gemv_weights(tiny_bf16_model(), torch.bfloat16)


@needs_kernel
def test_skips_when_the_copy_does_not_fit(monkeypatch, caplog):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    monkeypatch.setattr(weight_copies, "available_memory_bytes", lambda: 4 * model.embed.weight.nbytes)
    with caplog.at_level("INFO", logger="fp8serve.kernels.gemv_packing"):
        assert gemv_packing.pack_gemv_weights(model, torch.bfloat16) == 0
    assert model.qkv.weight_gemv_packed is None
    assert "dense_gemv: weights not packed: the copy needs" in caplog.text


@pytest.mark.parametrize("n,k", [(35, 8), (16, 576), (1, 4)])
def test_pack_fp8_gemv_weight_layout(seed, n, k):
    """Undo the byte placement of the kernel's decode: row j // 2 of a block
    has k-pair (4q, 4q + 1) in `a` lane j and (4q + 2, 4q + 3) in `b` lane j,
    a's lane j from byte 16 (j // 8) + j % 8, b's from that + 8."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
    scale = torch.rand(n, generator=g)
    packed, packed_scale = gemv_packing.pack_fp8_gemv_weight(codes, scale)
    blocks = -(-n // 16)
    assert packed.shape == (blocks, k // 4, 64) and packed.dtype == torch.uint8 and packed.is_contiguous()
    rebuilt = torch.zeros(blocks * 16, k, dtype=torch.uint8)
    for b in range(blocks):
        for q in range(k // 4):
            for j in range(32):
                row = 16 * b + j // 2
                rebuilt[row, 4 * q + j % 2] = packed[b, q, 16 * (j // 8) + j % 8]
                rebuilt[row, 4 * q + 2 + j % 2] = packed[b, q, 16 * (j // 8) + 8 + j % 8]
    assert torch.equal(rebuilt[:n], codes) and not rebuilt[n:].any()
    assert torch.equal(packed_scale[:n], scale * 256) and not packed_scale[n:].any()


def test_pack_fp8_gemv_weight_rejects_bad_input():
    with pytest.raises(ValueError, match=r"2-D uint8 e4m3 codes \[N, K\] on the CPU, got torch.float32"):
        gemv_packing.pack_fp8_gemv_weight(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match=r"\(4, 6\) need N >= 1 and K a multiple of 4"):
        gemv_packing.pack_fp8_gemv_weight(torch.zeros(4, 6, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[4\], got torch.float32 \(3,\)"):
        gemv_packing.pack_fp8_gemv_weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(3))


@pytest.mark.skipif(_ops is None or not bool(_ops.fp8_gemv_has_packed()),
                    reason="fp8_gemv_packed needs the C++ kernels built for AVX512-BF16 and AVX512-VBMI")
def test_fp8_checkpoint_layers_read_their_packed_codes(tmp_path, monkeypatch, seed):
    """An FP8 checkpoint through the real loader, bf16 compute, packing on:
    every FP8 linear gets its own codes and per-shard scales packed, and its
    forward (now fp8_gemv_packed) is the decoded weight's product within the
    bound of the kernel's float32 sums and one bf16 rounding."""
    from checkpoints import write_tiny_llama
    from kv_scale_checkpoints import quantize_to_fp8_checkpoint

    from fp8serve import LLM
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8

    fp8_dir = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(write_tiny_llama(tmp_path / "base"), fp8_dir, tmp_path / "ref")
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    calls = []
    real = cpu_ops.fp8_gemv_packed
    monkeypatch.setattr(cpu_ops, "fp8_gemv_packed", lambda *a: calls.append(a[3]) or real(*a))
    llm = LLM(str(fp8_dir), dtype="bfloat16", kv_cache_memory="4MiB")
    linears = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, MergedLinear)]
    assert linears and all(m.weight.dtype == torch.uint8 and m.weight_gemv_packed is not None for m in linears)
    g = torch.Generator().manual_seed(seed)
    for m in linears:
        x = torch.randn(20, m.input_size, generator=g).bfloat16()
        w = dequantize_fp8(m.weight, 1.0, FP8_E4M3, torch.float64) * m.weight_scale.double()[:, None]
        ref = x.double() @ w.t()
        bound = (m.input_size + 2) * 2.0**-24 * (x.double().abs() @ w.abs().t()) * 1.01 + 2.0**-8 * ref.abs() * 1.01
        assert ((m(x).double() - ref).abs() <= bound).all(), f"seed={seed}: {m.prefix}"
    assert len(calls) >= len(linears)


@needs_kernel
@pytest.mark.parametrize("huge", ["1", "0"])
def test_pack_gemv_weights_put_the_copies_in_one_arena(monkeypatch, huge):
    """Every copy in one buffer on 2 MiB pages (made one at a time they came from reused heap pages
    that madvise does not make huge); with huge pages off, buffers of their own. Same bits either way."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    monkeypatch.setenv("FP8SERVE_WEIGHT_HUGE_PAGES", huge)
    model = tiny_bf16_model()
    assert gemv_packing.pack_gemv_weights(model, torch.bfloat16) > 0
    copies = [model.qkv.weight_gemv_packed, model.head.weight_gemv_packed]
    for layer, copy in zip((model.qkv, model.head), copies):
        assert torch.equal(copy, gemv_packing.pack_gemv_weight(layer.weight, huge_pages=False))
    storages = {c.untyped_storage().data_ptr() for c in copies}
    if huge == "0":
        assert len(storages) == 2
    elif huge_pages_refused():
        pytest.skip("madvise(MADV_HUGEPAGE) refused here: no arena")
    else:
        assert len(storages) == 1 and copies[0].data_ptr() % (2 * 1024 * 1024) == 0
        assert copies[1].data_ptr() == copies[0].data_ptr() + copies[0].numel() * 2  # in module order


def huge_pages_refused() -> bool:
    from fp8serve.utils.huge_pages import HugePageArena

    return HugePageArena.allocate(64) is None
