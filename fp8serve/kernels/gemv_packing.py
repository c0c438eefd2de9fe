"""Linear weights packed once for the decode GEMVs on blocks of 16 output rows
(dense_gemv_packed.cpp): bf16 weights pair-interleaved for `dense_gemv_packed`,
FP8 (e4m3) codes placed for `fp8_gemv_packed`, which decodes them to bf16 in
registers.

Why: on a CPU with AVX512-BF16 the bf16 decode linears are dot products
whose plain [N, K] rows leave one horizontal sum per output at the end of
every tile (dense_gemv), or go to oneDNN above 32 rows; on the packed layout
every accumulator lane is an output and nothing is left to sum. Measured on
an AMD EPYC Zen 4 (2 vCPUs, no AMX), the default model's 120 decode linears
read from memory ran 1.02-1.39x as fast as dense_gemv at 13-32 rows and
1.05-1.57x as fast as oneDNN's packed weight at 48-256 (its lm_head
1.04-1.46x at 13-256); up to 12 rows the plain rows serve (not clearly slower)
(cpu_ops.GEMV_PACKED_MIN_ROWS / MAX_ROWS; numbers and command:
benchmarks/results/dense_gemv_packed_2026-12-01_zen4.md).

FP8 checkpoints with bf16 compute: the layer's [N, K] codes are what the
fused FP8 kernel (fp8_linear.cpp, float32 FMAs after the decode) and the
prefill path (dequantize + GEMM) read; packed, the same codes run every
decode batch of 1-512 rows 1.1-2.5x as fast (cpu_ops.FP8_GEMV_PACKED_MAX_ROWS),
for 1 byte per weight more.

Under float32 compute (a bf16 checkpoint on a CPU without fast bf16
arithmetic: narrow_weights.py) the same bf16 layout serves float32
activations: bf16_tiled_gemm (cpu/bf16_tiled_gemm.cpp, AVX2 + FMA) turns each
pair into two float32 weights by one shift and one AND and runs 6 x 16
register tiles over a block. The plain linear layers and a bf16 LM head get
the copy there, and it serves all their batches of 3 or more rows, prefills
too (so they get no float32 copy for oneDNN); the head ran 1.35-1.41x
dense_gemv at 12-32 rows and 1.01-1.29x oneDNN's float32 copy at 64-256
(bf16_tiled_gemm_head_2026-12-06_zen2.md). On an AVX2-only Zen 2 EPYC their
decode linears ran 1.09-1.29x as fast as dense_gemv at 12-32 rows and
1.12-1.57x as fast as oneDNN's packed float32 copy at 48-256
(benchmarks/results/bf16_tiled_gemm_2026-12-05_zen2.md), and 1.09-1.18x at
256-2048 (bf16_tiled_gemm_prefill_2026-12-06_zen2.md), so
`float32_packing_applies` on AMD CPUs without AVX-512. On an Intel Ice Lake
Xeon (AVX-512, no bf16 arithmetic: float32 compute), with two panels per
16-lane tile, the decode linears ran 1.20-1.54x dense_gemv at 8-16 rows and
1.52x oneDNN at 24, and decode steps 1.19-1.62x at batches 8-24, but oneDNN's
AVX-512 GEMM wins at prefill sizes (1.22x at 256 rows): there the layers get
the copy for batches of 8-24 rows and keep oneDNN's float32 copy for the rest
(`float32_packing_keeps_onednn`). AMD CPUs with AVX-512 do the same for 8-64
rows (a Zen 4 EPYC under --dtype float32: the decode linears 1.19-1.37x
dense_gemv at 8-32 rows and 1.11-1.16x oneDNN at 64, 0.94-0.96x at 256;
decode steps 1.09-1.24x at batches 8-64: `float32_rows_beside_onednn`).

The packed copy sits beside the plain weight (the embedding lookup of a tied
LM head, linear layers' batches of 1-12 and every other path read the plain
one; the LM head reads its packed copy from one row, 1.05-1.33x there; oneDNN
keeps its own packed copy for prefill), so it costs another copy of each
bf16 linear weight: `pack_gemv_weights` makes it only on AMD CPUs without AMX
(with AMX, amx_linear serves the bf16 decode batches; Intel is not measured)
and only where the copies fit in a quarter of the memory available.
FP8SERVE_GEMV_PACKED_WEIGHTS=0 turns it off, =1 forces it wherever the
kernel is built, with bf16_tiled_gemm serving every float32 batch of 3 or
more rows (on AVX-512 CPUs, auto keeps oneDNN's float32 copy for the batches
past float32_rows_beside_onednn: float32_packing_keeps_onednn).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fp8serve.utils.env_switch import env_switch
from fp8serve.utils.huge_pages import HugePageArena, advise_huge_pages
from fp8serve.utils.platform import is_amd_cpu
from fp8serve.utils.weight_copies import copy_fits, pack_each_weight_once

logger = logging.getLogger(__name__)

PACKED_WEIGHTS_ENV = "FP8SERVE_GEMV_PACKED_WEIGHTS"
BLOCK_ROWS = 16  # output rows per packed block: one 512-bit vector of float32 sums


def _new_buffer(shape: tuple[int, ...], dtype: torch.dtype, arena: HugePageArena | None,
                huge_pages: bool) -> torch.Tensor:
    """A packed copy's buffer: from the arena, or its own, advised before the first write."""
    if arena is not None:
        return arena.empty(shape, dtype)
    out = torch.empty(shape, dtype=dtype)
    if huge_pages:
        advise_huge_pages(out, "weight")
    return out


def packed_bytes(weights) -> int:
    """The arena bytes the packed copies of these [N, K] weights take (bf16 or FP8 codes alike)."""
    return sum(HugePageArena.span(BLOCK_ROWS * packed_shape(*w.shape)[0] * w.shape[1] * w.element_size())
               for w in weights)


def packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """[ceil(N/16), K/2, 16, 2]: the layout `pack_gemv_weight` makes for an [N, K] weight."""
    return (-(-n // BLOCK_ROWS), k // 2, BLOCK_ROWS, 2)


def pack_gemv_weight(weight: torch.Tensor, huge_pages: bool = True, arena: HugePageArena | None = None) -> torch.Tensor:
    """`weight` [N, K] bf16 (K even) as packed[b, p, j, i] = weight[16 b + j, 2 p + i],
    rows past N zero; contiguous: in `arena` when given (the engine's copies,
    `pack_gemv_weights`), else a buffer of its own advised onto 2 MiB pages
    (huge_pages; not for the few rows the greedy screen packs per step)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_gemv_weight takes a 2-D bf16 CPU weight [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    if k % 2 != 0 or n == 0:
        raise ValueError(f"pack_gemv_weight: weight {tuple(weight.shape)} needs N >= 1 and an even K")
    blocks, pairs, _, _ = packed_shape(n, k)
    packed = _new_buffer((blocks, pairs, BLOCK_ROWS, 2), torch.bfloat16, arena, huge_pages)
    padded = weight
    if blocks * BLOCK_ROWS != n:
        padded = torch.zeros(blocks * BLOCK_ROWS, k, dtype=torch.bfloat16)
        padded[:n] = weight
    packed.copy_(padded.reshape(blocks, BLOCK_ROWS, pairs, 2).permute(0, 2, 1, 3))
    return packed


E4M3_DECODE_SCALE = 2.0**8  # fp8_bf16_lut.h decodes e4m3 codes to value * 2^-8


def _fp8_code_positions() -> torch.Tensor:
    """src[pos] = 4 * r + kk: which (row r, k offset kk) of a block's quad
    lands at byte `pos` of its 64-byte vector, so that the kernel's decode
    (bf16_from_codes64: 16-bit lane j of `a` from byte 16 (j / 8) + j % 8, of
    `b` from byte 16 (j / 8) + 8 + j % 8) leaves the pair (kk = 0, 1) of row
    j / 2 in `a` and (kk = 2, 3) in `b`."""
    src = torch.empty(64, dtype=torch.long)
    for j in range(32):
        r, e = divmod(j, 2)
        src[16 * (j // 8) + j % 8] = 4 * r + e
        src[16 * (j // 8) + 8 + j % 8] = 4 * r + 2 + e
    return src


def pack_fp8_gemv_weight(codes: torch.Tensor, weight_scale: torch.Tensor,
                         arena: HugePageArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [N, K] (uint8, K a multiple of 4) and their per-row scales
    [N] float32 as fp8_gemv_packed reads them: codes [ceil(N/16), K/4, 64]
    (dense_gemv_packed.cpp; rows past N are code 0) and the scales times 2^8
    (the decode's scale), zero-padded to [ceil(N/16) * 16]. The codes go in
    `arena` when given (see pack_gemv_weight)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.device.type != "cpu":
        raise ValueError(f"pack_fp8_gemv_weight takes 2-D uint8 e4m3 codes [N, K] on the CPU, got {codes.dtype} "
                         f"{tuple(codes.shape)} on {codes.device}")
    n, k = codes.shape
    if n == 0 or k % 4 != 0:
        raise ValueError(f"pack_fp8_gemv_weight: codes {tuple(codes.shape)} need N >= 1 and K a multiple of 4")
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"pack_fp8_gemv_weight: weight_scale must be float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    blocks = -(-n // BLOCK_ROWS)
    padded = torch.zeros(blocks * BLOCK_ROWS, k, dtype=torch.uint8)
    padded[:n] = codes
    quads = padded.reshape(blocks, BLOCK_ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(blocks, k // 4, 64)
    packed = _new_buffer((blocks, k // 4, 64), torch.uint8, arena, True)
    packed.copy_(quads[:, :, _fp8_code_positions()])
    scale = torch.zeros(blocks * BLOCK_ROWS, dtype=torch.float32)
    scale[:n] = weight_scale * E4M3_DECODE_SCALE
    return packed, scale


def packing_applies() -> bool:
    """Whether this machine and build pack weights for the packed GEMVs (FP8 codes
    also need fp8_gemv_packed in the build: see pack_gemv_weights)."""
    from fp8serve.kernels import amx_linear_ops, cpu_ops

    ops = cpu_ops.load_cpu_ops()
    if ops is None or not bool(ops.dense_gemv_has_packed()):
        return False
    wanted = env_switch(PACKED_WEIGHTS_ENV)
    if wanted is not None:
        return wanted
    return is_amd_cpu() and not amx_linear_ops.is_available()


def _fp8_packing_built() -> bool:
    from fp8serve.kernels import cpu_ops

    ops = cpu_ops.load_cpu_ops()
    return ops is not None and bool(ops.fp8_gemv_has_packed())


def _is_fp8_kernel_layer(m: nn.Module) -> bool:
    """An FP8 linear whose codes the CPU kernel reads ([N, K] uint8 e4m3, [N] float32 scales)."""
    return (getattr(m, "fp8_backend", None) == "cpu_kernel" and m.weight.dtype == torch.uint8
            and m.weight.dim() == 2 and m.weight.shape[1] % 4 == 0)


def pack_gemv_weights(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Give every bf16 linear of a bf16 model (layers with a `weight_gemv_packed`
    slot: plain linear layers and the LM head) a packed copy of its weight,
    and every FP8 linear its codes packed for fp8_gemv_packed, where
    `packing_applies` and the copies fit in a quarter of the memory
    available. Under float32 compute, the bf16 weights of plain linear layers
    only, for bf16_tiled_gemm (`float32_packing_applies`). Returns the bytes
    packed (0 when nothing was)."""
    if compute_dtype == torch.float32:
        return _pack_for_float32_compute(model)
    if compute_dtype != torch.bfloat16:
        return 0
    slots = [m for m in model.modules()
             if hasattr(m, "weight_gemv_packed") and isinstance(getattr(m, "weight", None), torch.Tensor)
             and m.weight.device.type == "cpu"]
    bf16 = [m for m in slots if m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.shape[1] % 2 == 0]
    fp8 = [m for m in slots if _is_fp8_kernel_layer(m)]
    if (not bf16 and not fp8) or not packing_applies():
        return 0
    if not _fp8_packing_built():
        fp8 = []
    weights = {id(m.weight): m.weight for m in bf16 + fp8}  # a tied LM head shares its embedding's weight
    total = packed_bytes(weights.values())
    if not copy_fits(total, "dense_gemv: weights", logger):
        return 0
    # One arena for all, in module (execution) order.
    arena = HugePageArena.allocate(total)
    count = pack_each_weight_once(bf16, "weight_gemv_packed", lambda w: pack_gemv_weight(w, arena=arena))
    for m in fp8:
        m.weight_gemv_packed, m.weight_scale_gemv_packed = pack_fp8_gemv_weight(m.weight, m.weight_scale, arena)
    logger.info("dense_gemv: packed %d bf16 and %d FP8 weights once for decode batches (%.0f MiB, another copy)",
                count, len(fp8), total / 2**20)
    return total


def float32_packing_applies() -> bool:
    """Whether bf16 linear weights under float32 compute get a packed copy for
    bf16_tiled_gemm (cpu/bf16_tiled_gemm.cpp): where the kernels were built
    with it, on AMD CPUs (without AVX-512 for every batch, measured on an
    AVX2-only Zen 2 EPYC; with AVX-512 for decode batches beside oneDNN's
    copy, measured on a Zen 4 EPYC: float32_packing_keeps_onednn) and on
    Intel CPUs with AVX-512 and no AMX (measured on an Ice Lake Xeon, beside
    oneDNN's copy too), or as FP8SERVE_GEMV_PACKED_WEIGHTS says. Intel CPUs
    without AVX-512 are not measured."""
    from fp8serve.kernels import amx_linear_ops, cpu_ops
    from fp8serve.utils.platform import cpu_flags

    wanted = env_switch(PACKED_WEIGHTS_ENV)  # a bad value is an error on any build
    if not cpu_ops.bf16_tiled_gemm_built():
        return False
    if wanted is not None:
        return wanted
    if is_amd_cpu():
        return True
    return "avx512f" in cpu_flags() and not amx_linear_ops.is_available()


def float32_packing_keeps_onednn() -> bool:
    """Whether layers packed for bf16_tiled_gemm under float32 compute also
    keep oneDNN's packed float32 copy, which then takes the batches past
    float32_rows_beside_onednn (and bf16_tiled_gemm those rows alone): on
    CPUs with AVX-512, where oneDNN's 16-lane GEMM ran 1.22x (Ice Lake Xeon,
    benchmarks/results/bf16_tiled_gemm_2026-12-07_icelake.md) and 1.04x
    (Zen 4 EPYC, bf16_tiled_gemm_2026-12-07_zen4.md) as fast as
    bf16_tiled_gemm at 256 rows; not on AMD CPUs without it (AVX2: the tiles
    were the faster at every size measured), nor where
    FP8SERVE_GEMV_PACKED_WEIGHTS=1 forces the copies (that arrangement on any
    CPU: bf16_tiled_gemm for every batch of its rows)."""
    from fp8serve.utils.platform import cpu_flags

    if env_switch(PACKED_WEIGHTS_ENV):
        return False
    return not is_amd_cpu() or "avx512f" in cpu_flags()


def float32_rows_beside_onednn() -> tuple[int, int]:
    """The batches (fewest, most rows) bf16_tiled_gemm serves on a layer that
    keeps oneDNN's float32 copy for the others (float32_packing_keeps_onednn),
    as measured in decode steps per vendor: cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN
    (Intel, 8-24) and BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD (8-64)."""
    from fp8serve.kernels import cpu_ops

    return (cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD if is_amd_cpu()
            else cpu_ops.BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN)


def _pack_for_float32_compute(model: nn.Module) -> int:
    """The bf16 weights of plain linear layers and of the LM head (16-bit
    weights under float32 compute: narrow_weights.py; an FP8 checkpoint's
    bf16 head) packed for bf16_tiled_gemm: batches of 3 or more rows, decode
    and prefill (these layers then get no float32 copy for oneDNN:
    `onednn_linear.pack_weights`). Greedy steps of a few rows still read the
    head's plain rows (its int8 screen, dense_gemv)."""
    from fp8serve.kernels import cpu_ops
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.layers.vocab_embedding import LMHead
    from fp8serve.quantization.unquantized import UnquantizedLinearMethod

    layers = [m for m in model.modules()
              if (isinstance(m, LMHead) or isinstance(m, MergedLinear)
                  and isinstance(m.quant_method, UnquantizedLinearMethod))
              and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.shape[1] % 2 == 0
              and m.weight.device.type == "cpu"]
    if not layers or not float32_packing_applies():
        return 0
    weights = {id(m.weight): m.weight for m in layers}
    total = packed_bytes(weights.values())
    if not copy_fits(total, "bf16_tiled_gemm: weights", logger):
        return 0
    arena = HugePageArena.allocate(total)
    count = pack_each_weight_once(layers, "weight_gemv_packed", lambda w: pack_gemv_weight(w, arena=arena))
    if float32_packing_keeps_onednn():
        lo, hi = float32_rows_beside_onednn()
        rows = f"{lo}-{hi} rows (oneDNN's float32 copy takes larger batches)"
    else:
        rows = f"{cpu_ops.BF16_TILED_GEMM_MIN_ROWS} or more rows"
    logger.info("bf16_tiled_gemm: packed %d bf16 weights once for float32 batches of %s (%.0f MiB, another copy)",
                count, rows, total / 2**20)
    return total

