"""float32 linear layers through oneDNN instead of torch's default GEMM, on
the CPUs where that was measured faster: a thin wrapper over
`torch.ops.mkldnn._linear_pointwise` (the op torch's own compiler emits for
CPU linears) and where it runs.

Why: torch 2.13's `F.linear` runs float32 through MKL's sgemm. On an AMD EPYC
Zen 4 (2 vCPUs, AVX-512) MKL reached 181-203 GFLOP/s on the default model's
prefill shapes at 512 rows (the 576 -> 3072 gate_up the slowest) and 126-194
at 24-256 rows; oneDNN ran the same calls at 209-217 and 134-214: 1.02-1.29x
(bf16 already goes to oneDNN through F.linear: no change there). On the 120
decode linears read from memory it ran 1.18-1.33x F.linear at 16-64 rows, and
dense_gemv stays faster up to its 32 rows. Numbers and command:
benchmarks/results/linear_backends_2026-11-30_zen4.md.

Intel CPUs keep F.linear for float32 weights (plain oneDNN not measured
faster there, nor packed copies of them: below).

Weights packed once. For plain weights oneDNN reorders the weight into its
blocked layout on every call; `torch.ops.mkldnn._reorder_linear_weight` does
that once (what torch's compiler does when it freezes a model). On the same
Zen 4 machine (no AMX) packed bf16 weights ran the default model's shapes
1.13-1.38x as fast as F.linear at 16 rows, 1.18-1.27x at 64 and 1.01-1.03x
at 512 (hot), and its 120 decode linears read from memory 1.3-1.7x at 8-64
rows (one cell of three runs 1.07x); packed float32 weights ran 1.04-1.08x plain oneDNN at 512 rows (hot)
and 1.19-1.37x at 16-64 rows (cold)
(benchmarks/results/linear_backends_2026-12-01_zen4.md); the bf16 offline
workload (64 x 512 -> 128) ran 1.01-1.15x as fast end to end
(benchmarks/results/offline_throughput_2026-12-01_zen4.md).
The packed copy is opaque (only oneDNN reads it) while dense_gemv reads the
plain weight at small batches (faster there), so packing costs a second copy
of every linear weight of the compute dtype: `pack_weights` makes it only
where that copy fits in a quarter of the memory available: on AMD CPUs
without AMX for every weight of the compute dtype; elsewhere (Intel) for
bf16 weights under bf16 compute where AMX runs the GEMMs (the copies serve
calls of up to AMX_BF16_PACKED_MAX_ROWS rows, below) and for 16-bit weights
held under float32 compute (narrow_weights.py), which without a copy are
upcast on every GEMM-sized call (.to() plus a cat: ~36 ms of a 512-token
prefill of the default model). On the 2-vCPU Xeon with AMX (stop 69) the
latter gave the float32 engine (16-bit weights, FP8 KV)
1.17-1.27x output tok/s offline (64 x 512 -> 128; prefill 1.11-1.24x) and
one 512-token prefill 1.07x (same process, alternating engines, 8 of 8
rounds). Copies of float32 weights there: that prefill 1.04x, but offline
0.93-0.97x, and hot GEMMs at 256-8192 rows 0.94-1.04x F.linear (1.13x once):
not made (benchmarks/results/onednn_packed_float32_2026-12-06_xeon_amx.md).
FP8SERVE_ONEDNN_PACKED_WEIGHTS=0 turns it off.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.utils.env_switch import env_switch
from fp8serve.utils.platform import is_amd_cpu
from fp8serve.utils.weight_copies import copy_fits, pack_each_weight_once

logger = logging.getLogger(__name__)


@functools.cache
def is_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN and its pointwise linear op, and the op
    runs for `dtype` on this CPU (oneDNN has no bf16 inner product for a CPU
    without AVX-512: an AVX2-only Zen 3 refuses to create the primitive)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w = torch.ones(2, 8, dtype=dtype), torch.ones(3, 8, dtype=dtype)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except RuntimeError:
        return False


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `onednn_linear` is the faster GEMM for this call: float32
    activations and weights on a CPU where it was measured faster (AMD)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.dim() == 2 and x.dim() >= 1 and is_amd_cpu() and is_available())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32: [..., K] x [N, K] -> [..., N]."""
    if not is_available():
        raise RuntimeError("oneDNN linear is not available in this torch build")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"onednn_linear takes float32 tensors, got x {x.dtype}, weight {weight.dtype}"
                         + ("" if bias is None else f", bias {bias.dtype}"))
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected [..., K] and [N, K]")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# Weight rows upcast per call where the weight is narrower than the
# activations and has no packed copy (8192 x 4096 float32 = 128 MiB at most;
# 18 MiB of SmolLM2's LM head).
UPCAST_ROWS = 8192


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or oneDNN where `applies` says it is faster, or oneDNN on
    `packed` (the layer's weight as `pack_weight` made it) for inputs of its dtype:
    the GEMM for calls that no decode kernel (dense_gemv, amx_linear,
    fp8_linear) took. A weight narrower than x (16-bit under float32 compute)
    without a packed copy is upcast UPCAST_ROWS rows at a time. On CPUs with
    AMX, bf16 calls of more than AMX_BF16_PACKED_MAX_ROWS rows take F.linear
    on the plain weight."""
    if packed is not None and x.dtype == packed.dtype and (
            x.dtype != torch.bfloat16 or x.numel() <= AMX_BF16_PACKED_MAX_ROWS * x.shape[-1]
            or not _amx_linear_available()):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if weight.dtype != x.dtype:
        # A weight stored narrower than the activations (16-bit under float32
        # compute) with no packed copy: upcast (exact) a slice of its rows at
        # a time, never the whole matrix.
        return torch.cat([linear(x, weight[i:i + UPCAST_ROWS].to(x.dtype),
                                 None if bias is None else bias[i:i + UPCAST_ROWS])
                          for i in range(0, weight.shape[0], UPCAST_ROWS)], dim=-1)
    if applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------ packed weights
PACKED_WEIGHTS_ENV = "FP8SERVE_ONEDNN_PACKED_WEIGHTS"
# With AMX, packed bf16 copies serve calls of up to this many rows. The
# default model's shapes on the 2-vCPU Xeon (hot, GFLOP/s F.linear / packed):
# 1.39-1.80x at 64-256 rows (e.g. gate_up 1086 / 1775 at 64, 1956 / 2680 at
# 256); from 384 rows on either one dips by up to 1.8x at some shape and row
# count (o_proj 2424 / 1591 at 512, qkv 2386 / 1548 at 768, o_proj 1537 /
# 3016 at 1024): F.linear there, as before. Prefill steps of one prompt,
# alternating engines: 1.31x at 128 tokens, 1.17x at 256, 1.01x at 512
# (benchmarks/results/onednn_packed_float32_2026-12-06_xeon_amx.md).
AMX_BF16_PACKED_MAX_ROWS = 256


def _amx_linear_available() -> bool:
    from fp8serve.kernels import amx_linear_ops  # it imports cpu_ops, which imports nothing of this module

    return amx_linear_ops.is_available()


PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch packs `dtype` linear weights for oneDNN, and the
    packed weight gives F.linear's result."""
    if dtype not in PACKABLE_DTYPES or not is_available(dtype) or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).to(dtype)
        w = torch.randn(48, 32, generator=g).to(dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-3))
    except RuntimeError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (bf16 or float32) in oneDNN's blocked layout: an opaque
    tensor only `linear(..., packed=)` reads. The batch-size hint hardly
    matters (the same times at hints 16-512 for these shapes; float32 at hint 1
    was slower at 16+ rows); 64 is a decode batch."""
    if weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight takes a 2-D bf16 or float32 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)


def _weight_dtypes_to_pack(compute_dtype: torch.dtype, widen: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """The weight dtypes whose layers get packed copies under `compute_dtype`
    (`widen`: 16-bit dtypes held under float32 compute)."""
    candidates = (compute_dtype, *widen)
    wanted = env_switch(PACKED_WEIGHTS_ENV)
    if wanted is not None:
        return candidates if wanted else ()
    from fp8serve.kernels import amx_linear_ops

    if is_amd_cpu() and not amx_linear_ops.is_available():
        return candidates
    # Other CPUs (Intel): 16-bit weights under float32 compute, which without a
    # copy are upcast on every GEMM-sized call, and bf16 weights under bf16
    # compute where AMX runs the packed GEMMs (up to AMX_BF16_PACKED_MAX_ROWS
    # rows). float32 weights keep F.linear (packed measured 0.94-1.04x at
    # 256-8192 rows hot, 0.93-0.97x offline).
    if compute_dtype == torch.float32:
        return tuple(widen)
    return (compute_dtype,) if compute_dtype == torch.bfloat16 and amx_linear_ops.is_available() else ()


def _served_by_bf16_tiled_gemm(layer: nn.Module, compute_dtype: torch.dtype) -> bool:
    # Under float32 compute a bf16 layer with a packed copy for bf16_tiled_gemm
    # (gemv_packing, which runs first) sends every GEMM-sized batch there
    # (cpu_ops.BF16_TILED_GEMM_MIN_ROWS and up) on AMD: a float32 copy, twice
    # the bytes of the weight, would never be read. On Intel it serves decode
    # batches only and the float32 copy takes the rest
    # (gemv_packing.float32_packing_keeps_onednn).
    from fp8serve.kernels import gemv_packing

    return (compute_dtype == torch.float32 and getattr(layer, "weight_gemv_packed", None) is not None
            and not gemv_packing.float32_packing_keeps_onednn())


def pack_weights(model: nn.Module, compute_dtype: torch.dtype, widen: tuple[torch.dtype, ...] = ()) -> int:
    """Give every linear of `model` whose weight has the compute dtype (bf16
    or float32; layers with a `weight_packed` slot: plain linear layers and
    the LM head) a packed copy of its weight, where this CPU wants it and the
    copies fit in a quarter of the available memory (none for a layer whose
    float32 GEMMs all run bf16_tiled_gemm). Weights of a `widen`
    dtype (16-bit under float32 compute: quantization/narrow_weights.py) are
    packed in the compute dtype (exact); weights of other dtypes are left
    alone: their activations never read a packed copy (an FP8 checkpoint's
    bf16 LM head in a float32 engine runs dense_gemv slices). Returns the
    bytes packed (0 when nothing was)."""
    if compute_dtype not in PACKABLE_DTYPES:
        return 0
    dtypes = _weight_dtypes_to_pack(compute_dtype, widen)
    layers = [m for m in model.modules()
              if hasattr(m, "weight_packed") and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dtype in dtypes and m.weight.dim() == 2 and m.weight.device.type == "cpu"
              and not _served_by_bf16_tiled_gemm(m, compute_dtype)]
    if not layers or not packing_available(compute_dtype):
        return 0
    name = str(compute_dtype).removeprefix("torch.")
    # A tied LM head shares its embedding's weight: count each weight once.
    weights = {id(m.weight): m.weight for m in layers}
    total = sum(w.numel() * compute_dtype.itemsize for w in weights.values())
    if not copy_fits(total, f"oneDNN: {name} weights", logger):
        return 0
    count = pack_each_weight_once(layers, "weight_packed", lambda w: pack_weight(w.to(compute_dtype)))
    logger.info("oneDNN: packed %d %s weights once (%.0f MiB, a second copy: dense_gemv reads the plain one)",
                count, name, total / 2**20)
    return total
