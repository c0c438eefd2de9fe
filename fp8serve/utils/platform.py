"""Facts about the machine we run on, measured rather than assumed."""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from fp8serve.utils import cgroup
from fp8serve.utils.memory import format_bytes

logger = logging.getLogger(__name__)


def _meminfo_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_memory_bytes() -> int:
    """Memory this process can still take: the machine's MemAvailable, or
    less where its control group (a container's --memory) allows less."""
    avail = _meminfo_available_bytes()
    limit = cgroup.memory_limit()
    if limit is not None and limit.available_bytes < avail:
        logger.info("memory: the cgroup limit binds (%s limit, %s used, in %s), not the machine's %s available",
                    format_bytes(limit.limit_bytes), format_bytes(limit.usage_bytes), limit.group,
                    format_bytes(avail))
        return limit.available_bytes
    return avail


def configure_cpu_threads() -> int:
    """Caps torch's intra-op threads at the CPUs this process can use: its
    affinity mask and its cgroup CPU quota (torch counts the host's cores,
    and more OpenMP threads than CPUs spin at every barrier while the quota
    throttles them). An explicit OMP_NUM_THREADS, or a lower count already
    set, is left alone. Returns the thread count in effect."""
    current = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ:
        return current
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or current
    quota = cgroup.cpu_quota()
    usable = cgroup.usable_cpus(affinity, quota)
    if current > usable:
        torch.set_num_threads(usable)
        logger.info("torch threads %d -> %d (%d CPUs in the affinity mask, cgroup CPU quota %s; "
                    "OMP_NUM_THREADS overrides)", current, usable, affinity,
                    "none" if quota is None else f"{quota:g}")
        return usable
    return current


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel", ...), "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def is_amd_cpu() -> bool:
    """Whether this is an AMD CPU: some kernel choices were measured on AMD only (read once per process)."""
    return cpu_vendor() == "AuthenticAMD"


# Interleaved timing rounds behind `--dtype auto` on AVX512-BF16 CPUs without
# AMX; each dtype's best round counts. A single timing of each (~6 ms of bf16
# calls) once picked float32 for an engine on the Zen 4 EPYC, where bf16
# measures ~2.5x float32 (398 vs 167 GFLOP/s): its prefill GEMMs ran at
# float32's 200 GFLOP/s, 617 ms for 512 tokens against 315 ms at the next
# start. A pause of a few ms in that timing is enough to flip the choice.
MATMUL_TIMING_ROUNDS = 5


def _matmul_gflops(x: torch.Tensor, w: torch.Tensor) -> float:
    """GFLOP/s of three `F.linear(x, w)` calls (one round of the timing)."""
    n = 3
    t = time.perf_counter()
    for _ in range(n):
        F.linear(x, w)
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] * n / (time.perf_counter() - t) / 1e9


def _best_matmul_gflops(rounds: int = MATMUL_TIMING_ROUNDS) -> dict[torch.dtype, float]:
    """Best GFLOP/s of float32 and bf16 `F.linear` over `rounds` alternating rounds."""
    # The shape of one SmolLM2 MLP projection over a 256-token prefill.
    x = torch.randn(256, 576)
    w = torch.randn(1536, 576)
    operands = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for xd, wd in operands.values():
        F.linear(xd, wd)  # first calls: oneDNN's primitive creation and allocations, not timed
    best = dict.fromkeys(operands, 0.0)
    for _ in range(rounds):
        for dtype, (xd, wd) in operands.items():
            best[dtype] = max(best[dtype], _matmul_gflops(xd, wd))
    return best


@functools.cache
def fastest_cpu_compute_dtype() -> torch.dtype:
    """float32 unless this CPU multiplies bf16 natively and measurably faster.

    On AVX2-only CPUs bf16 matmul is emulated and ~8x slower than float32;
    with AMX it is several times faster. With AVX512-BF16 alone the answer
    depends on the chip, so we time both (best of MATMUL_TIMING_ROUNDS
    alternating rounds, about 60-100 ms)."""
    flags = cpu_flags()
    if not ({"amx_bf16", "avx512_bf16"} & flags):
        logger.info("dtype auto -> float32 (this CPU has no native bf16 matmul; float32 is faster here)")
        return torch.float32
    if "amx_bf16" in flags:
        # AMX tiles: bf16 matmul is ~6x float32 (measured on a 2-vCPU Xeon VM);
        # no need to time it, and a timing on a busy machine could mislead.
        logger.info("dtype auto -> bfloat16 (this CPU has AMX bf16 matrix units)")
        return torch.bfloat16
    best = _best_matmul_gflops()
    f32, bf16 = best[torch.float32], best[torch.bfloat16]
    choice = torch.bfloat16 if bf16 > 1.2 * f32 else torch.float32
    logger.info("dtype auto -> %s (measured matmul: float32 %.0f GFLOP/s, bfloat16 %.0f GFLOP/s)",
                str(choice).removeprefix("torch."), f32, bf16)
    return choice
