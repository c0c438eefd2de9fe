"""bf16 linear weights packed once for `dense_gemv_packed`, the decode GEMV
on pair-interleaved blocks of 16 output rows (dense_gemv_packed.cpp).

Why: on a CPU with AVX512-BF16 the bf16 decode linears are dot products
whose plain [N, K] rows leave one horizontal sum per output at the end of
every tile (dense_gemv), or go to oneDNN above 32 rows; on the packed layout
every accumulator lane is an output and nothing is left to sum. Measured on
an AMD EPYC Zen 4 (2 vCPUs, no AMX), the default model's 120 decode linears
read from memory ran 1.02-1.13x as fast as dense_gemv at 13-32 rows and
1.05-1.27x as fast as oneDNN's packed weight at 48-256 (its lm_head
1.05-1.34x); up to 12 rows the plain rows stay faster and serve those
(cpu_ops.GEMV_PACKED_MIN_ROWS / MAX_ROWS; numbers and command:
benchmarks/results/dense_gemv_packed_2026-12-01_zen4.md).

The packed copy sits beside the plain weight (the embedding lookup of a tied
LM head, batches of 1-12 and every other path read the plain one, and oneDNN
keeps its own packed copy for prefill), so it costs another copy of each
bf16 linear weight: `pack_gemv_weights` makes it only on AMD CPUs without AMX
(with AMX, amx_linear serves the bf16 decode batches; Intel is not measured)
and only where the copies fit in a quarter of the memory available.
FP8SERVE_GEMV_PACKED_WEIGHTS=0 turns it off, =1 forces it wherever the
kernel is built.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from fp8serve.errors import ConfigError
from fp8serve.utils.huge_pages import advise_huge_pages
from fp8serve.utils.platform import available_memory_bytes, is_amd_cpu

logger = logging.getLogger(__name__)

PACKED_WEIGHTS_ENV = "FP8SERVE_GEMV_PACKED_WEIGHTS"
BLOCK_ROWS = 16  # output rows per packed block: one 512-bit vector of float32 sums


def packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """[ceil(N/16), K/2, 16, 2]: the layout `pack_gemv_weight` makes for an [N, K] weight."""
    return (-(-n // BLOCK_ROWS), k // 2, BLOCK_ROWS, 2)


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] bf16 (K even) as packed[b, p, j, i] = weight[16 b + j, 2 p + i],
    rows past N zero; contiguous, on 2 MiB pages where Linux grants them."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_gemv_weight takes a 2-D bf16 CPU weight [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    if k % 2 != 0 or n == 0:
        raise ValueError(f"pack_gemv_weight: weight {tuple(weight.shape)} needs N >= 1 and an even K")
    blocks, pairs, _, _ = packed_shape(n, k)
    packed = torch.empty(blocks, pairs, BLOCK_ROWS, 2, dtype=torch.bfloat16)
    advise_huge_pages(packed, "weight")  # before the first write, as the weights' own arena
    padded = weight
    if blocks * BLOCK_ROWS != n:
        padded = torch.zeros(blocks * BLOCK_ROWS, k, dtype=torch.bfloat16)
        padded[:n] = weight
    packed.copy_(padded.reshape(blocks, BLOCK_ROWS, pairs, 2).permute(0, 2, 1, 3))
    return packed


def _packing_wanted() -> bool | None:
    """True / False when the environment forces it, None for the CPU's own choice."""
    value = os.environ.get(PACKED_WEIGHTS_ENV, "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    if value != "auto":
        raise ConfigError(f"environment variable {PACKED_WEIGHTS_ENV}={value!r}: expected auto, 1 or 0")
    return None


def packing_applies() -> bool:
    """Whether this machine and build pack bf16 weights for dense_gemv_packed."""
    from fp8serve.kernels import amx_linear_ops, cpu_ops

    ops = cpu_ops.load_cpu_ops()
    if ops is None or not bool(ops.dense_gemv_has_packed()):
        return False
    wanted = _packing_wanted()
    if wanted is not None:
        return wanted
    return is_amd_cpu() and not amx_linear_ops.is_available()


def pack_gemv_weights(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Give every bf16 linear of a bf16 model (layers with a `weight_gemv_packed`
    slot: plain linear layers and the LM head) a packed copy of its weight,
    where `packing_applies` and the copies fit in a quarter of the memory
    available. Returns the bytes packed (0 when nothing was)."""
    if compute_dtype != torch.bfloat16:
        return 0
    layers = [m for m in model.modules()
              if hasattr(m, "weight_gemv_packed") and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.device.type == "cpu"
              and m.weight.shape[1] % 2 == 0]
    if not layers or not packing_applies():
        return 0
    weights = {id(m.weight): m.weight for m in layers}  # a tied LM head shares its embedding's weight
    total = sum(BLOCK_ROWS * packed_shape(*w.shape)[0] * w.shape[1] * 2 for w in weights.values())
    budget = available_memory_bytes() // 4
    if total > budget:
        logger.info("dense_gemv: bf16 weights not packed: the copy needs %.0f MiB, over a quarter of the memory "
                    "available (%.0f MiB)", total / 2**20, budget / 2**20)
        return 0
    packed: dict[int, torch.Tensor] = {}
    for m in layers:
        if id(m.weight) not in packed:
            packed[id(m.weight)] = pack_gemv_weight(m.weight)
        m.weight_gemv_packed = packed[id(m.weight)]
    logger.info("dense_gemv: packed %d bf16 weights once for decode batches of 13-256 (%.0f MiB, another copy)",
                len(packed), total / 2**20)
    return total
