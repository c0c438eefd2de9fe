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

Intel CPUs keep F.linear: not measured there.

bf16 weights packed once. For plain bf16 weights oneDNN reorders the
weight into its blocked layout on every call; `torch.ops.mkldnn.
_reorder_linear_weight` does that once (what torch's compiler does when it
freezes a model). On the same Zen 4 machine (no AMX) the packed weights ran
the default model's shapes 1.13-1.38x as fast as F.linear at 16 rows,
1.18-1.27x at 64 and 1.01-1.03x at 512 (hot), and its 120 decode linears
read from memory 1.35-1.6x at 8-64 rows
(benchmarks/results/linear_backends_2026-12-01_zen4.md); the offline
workload (64 x 512 -> 128) ran 1.01-1.15x as fast end to end
(benchmarks/results/offline_throughput_2026-12-01_zen4.md).
The packed copy is opaque (only oneDNN reads it) while dense_gemv reads the
plain weight at 1-24 rows (faster there), so packing costs a second copy of every bf16
linear weight: `pack_bf16_weights` makes it only where that copy fits in a
quarter of the memory available, on AMD CPUs without AMX (with AMX,
amx_linear serves the decode batches; Intel is not measured).
FP8SERVE_ONEDNN_PACKED_WEIGHTS=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.errors import ConfigError
from fp8serve.utils.platform import available_memory_bytes, is_amd_cpu

logger = logging.getLogger(__name__)


@functools.cache
def is_available() -> bool:
    """Whether this torch has oneDNN and its pointwise linear op (and the op runs)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w = torch.ones(2, 8), torch.ones(3, 8)
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or oneDNN where `applies` says it is faster, or oneDNN on
    `packed` (the layer's weight as `pack_weight` made it) for bf16 inputs:
    the GEMM for calls that no decode kernel (dense_gemv, amx_linear,
    fp8_linear) took."""
    if packed is not None and x.dtype == torch.bfloat16:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------ packed bf16 weights
PACKED_WEIGHTS_ENV = "FP8SERVE_ONEDNN_PACKED_WEIGHTS"
# From this many rows a packed bf16 weight beats dense_gemv's bf16 dot
# products: the 120 decode linears read from memory on the Zen 4 guest took
# 25.7 / 24.6 ms packed vs 28.0 / 27.5 ms in dense_gemv at 32 rows, and
# 20.9 / 21.4 vs 19.9 / 20.9 at 24 (two runs of benchmarks/linear_backends.py,
# benchmarks/results/linear_backends_2026-12-01_zen4.md).
PACKED_OVER_GEMV_MIN_ROWS = 25


def prefers_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a linear call should take the packed weight even where
    dense_gemv would take it: bf16 rows of at least PACKED_OVER_GEMV_MIN_ROWS."""
    return (packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] >= PACKED_OVER_GEMV_MIN_ROWS)


@functools.cache
def packing_available() -> bool:
    """Whether this torch packs bf16 linear weights for oneDNN, and the packed
    weight gives F.linear's result."""
    if not is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).bfloat16()
        w = torch.randn(48, 32, generator=g).bfloat16()
        out = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-3))
    except RuntimeError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] bf16 in oneDNN's blocked layout: an opaque tensor only
    `linear(..., packed=)` reads. The batch-size hint hardly matters (the same
    times at hints 1-512 for these shapes); 64 is a decode batch."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight takes a 2-D bf16 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)


def _packing_wanted() -> bool:
    value = os.environ.get(PACKED_WEIGHTS_ENV, "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    if value != "auto":
        raise ConfigError(f"environment variable {PACKED_WEIGHTS_ENV}={value!r}: expected auto, 1 or 0")
    from fp8serve.kernels import amx_linear_ops

    return is_amd_cpu() and not amx_linear_ops.is_available()


def pack_bf16_weights(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Give every bf16 linear of `model` (layers with a `weight_packed`
    slot: plain linear layers and the LM head) a packed copy of its weight,
    where this CPU wants it and the copies fit in a quarter of the available
    memory. Only under bf16 compute: float32 activations never read a packed
    bf16 weight (a float32 model may keep a checkpoint's bf16 LM head).
    Returns the bytes packed (0 when nothing was)."""
    if compute_dtype != torch.bfloat16:
        return 0
    layers = [m for m in model.modules()
              if hasattr(m, "weight_packed") and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.device.type == "cpu"]
    if not layers or not _packing_wanted() or not packing_available():
        return 0
    # A tied LM head shares its embedding's weight: count each weight once.
    weights = {id(m.weight): m.weight for m in layers}
    total = sum(w.nbytes for w in weights.values())
    budget = available_memory_bytes() // 4
    if total > budget:
        logger.info("oneDNN: bf16 weights not packed: a packed copy needs %.0f MiB, over a quarter of the memory "
                    "available (%.0f MiB)", total / 2**20, budget / 2**20)
        return 0
    packed: dict[int, torch.Tensor] = {}
    for m in layers:
        if id(m.weight) not in packed:
            packed[id(m.weight)] = pack_weight(m.weight)
        m.weight_packed = packed[id(m.weight)]
    logger.info("oneDNN: packed %d bf16 weights once (%.0f MiB, a second copy: dense_gemv reads the plain one)",
                len(packed), total / 2**20)
    return total
