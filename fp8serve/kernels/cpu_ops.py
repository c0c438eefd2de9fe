"""Thin wrappers over the C++ CPU kernels, with shape/dtype checks, a build
step that never breaks the engine, and a plain PyTorch reference.

The extension is compiled once per machine (it targets the build CPU's
instruction set, `-march=native`) into the fp8serve cache directory; `make
setup` triggers the build. Without a compiler the engine logs one warning and
uses the reference path. FP8SERVE_CPU_MARCH overrides the target (e.g.
`x86-64-v3` to check the AVX2 path on an AVX-512 machine, `x86-64` for the
scalar path); each target gets its own build directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from fp8serve.attention.kv_cache_spec import layout_of, read_slots
from fp8serve.utils.platform import is_amd_cpu

logger = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).resolve().parent / "cpu"
# Every .cpp registers its own ops under torch.ops.fp8serve (TORCH_LIBRARY_FRAGMENT).
_SOURCES = sorted(_SRC_DIR.glob("*.cpp"))
_HEADERS = sorted(_SRC_DIR.glob("*.h"))

# The cache storage formats the kernel reads; see paged_attention.cpp.
KV_FORMATS = {"float32": 0, "bfloat16": 1, "float16": 2, "fp8_e4m3": 3, "fp8_e5m2": 4}
# The torch dtype each format is stored in (FP8 as uint8 codes).
KV_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                     "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}
# e4m3 codes are decoded as fp16 bit patterns worth value * 2^-8.
E4M3_DECODE_MULTIPLIER = 256.0


def _march() -> str:
    return os.environ.get("FP8SERVE_CPU_MARCH", "native")


def _build_dir(parallel: bool = True) -> Path:
    from fp8serve.default_model import cache_dir

    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    # And where they are: torch writes the sources' absolute paths into the
    # build's ninja file, so two checkouts of the same sources sharing one
    # directory (benchmarks/tree_ab.py's baseline snapshot beside this tree)
    # would each see the other's commands and rebuild at every start.
    h.update(str(_SRC_DIR).encode())
    h.update(torch.__version__.encode())
    h.update(_march().encode())
    h.update(b"openmp" if parallel else b"serial")
    from fp8serve.utils.platform import cpu_flags

    h.update(" ".join(sorted(cpu_flags())).encode())
    d = cache_dir() / "kernels" / f"cpu_ops_{h.hexdigest()[:16]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """Hold an flock on the build directory while torch builds or loads the
    extension there, and clear torch's own `lock` file first if one is left.
    Why: torch's cpp_extension marks a build in progress with a plain `lock`
    file and waits, forever, for it to disappear; a process killed during the
    first build (Ctrl-C during start-up) leaves it behind and every later
    start hangs silently. An flock dies with its process: whoever holds it is
    the only fp8serve process building here, so a `lock` file it finds is
    stale."""
    with open(build_dir / "fp8serve.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while another process builds here
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("C++ CPU kernels: removing %s, left by a build that was interrupted", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def load_cpu_ops():
    """`torch.ops.fp8serve` once the library is built and loaded, or None
    (with one warning) if it cannot be built."""
    if os.environ.get("FP8SERVE_DISABLE_CPU_KERNELS"):
        logger.info("FP8SERVE_DISABLE_CPU_KERNELS is set: using the PyTorch reference attention")
        return None
    from torch.utils.cpp_extension import load

    # -fopenmp is what makes at::parallel_for parallel: without it ATen's
    # header compiles every parallel_for in the kernels to a serial loop
    # (INTRA_OP_PARALLEL is only defined under _OPENMP). The kernels link the
    # libgomp.so.1 torch already loaded, so they share torch's thread pool and
    # torch.set_num_threads. A compiler without OpenMP gets a serial build.
    attempts = (("-fopenmp",), ())
    for i, omp in enumerate(attempts):
        try:
            build_dir = _build_dir(parallel=bool(omp))
            with _exclusive_build(build_dir):
                load(
                    name="fp8serve_cpu_ops" + ("_serial" if not omp else ""),
                    sources=[str(s) for s in _SOURCES],
                    # fp-contract=off: no silent FMA fusion, so float32 results round
                    # like torch's (the kernels ask for FMAs explicitly where wanted).
                    extra_cflags=["-O3", f"-march={_march()}", "-fopenmp-simd", "-ffp-contract=off", *omp],
                    extra_ldflags=list(omp),
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
            module = torch.ops.fp8serve
            break
        except Exception as e:  # a missing compiler or ninja must not stop the engine
            if i + 1 < len(attempts):
                logger.info("C++ CPU kernels: building with OpenMP failed (%s); trying a single-threaded build",
                            type(e).__name__)
                continue
            logger.warning("C++ CPU kernels unavailable (%s: %s); using the slower PyTorch reference path",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
    if not omp:
        logger.warning("C++ CPU kernels built without OpenMP: they run on one thread")
    if not module.has_avx2():
        logger.info("C++ CPU kernels built without AVX2/FMA/F16C: using their scalar path")
    return module


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size] float32, already scaled
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]: HND or NHD, kv_cache_spec
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, each in [1, max_blocks * block_size]
    kv_format: str,
    out_scale: float,
    *,
    path: str = "best",  # "avx512", "avx2", "scalar" or "bf16dot": force one set of tiles (tests, benchmarks)
    cascade: str = "off",  # "auto" (the engine's rule) or "always": cascade attention over shared blocks
) -> torch.Tensor:  # [num_seqs, num_heads, head_size] float32
    """softmax(q k^T) v * out_scale for one query token per sequence, reading
    K/V from the paged cache in its storage format. The query must already
    carry softmax_scale * k_scale (and 2^8 for e4m3, E4M3_DECODE_MULTIPLIER);
    out_scale carries v_scale (and 2^8 for e4m3).

    `cascade`: sequences whose block tables start with the same blocks have
    that shared prefix attended once for all of them (paged_attention.cpp,
    "cascade attention"); "always" does it for any two or more, "auto" where
    it measured faster (what the engine's entry does unless
    FP8SERVE_CASCADE_ATTENTION=0)."""
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("C++ CPU kernels are not available")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {list(KV_FORMATS)}")
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, key_cache {tuple(key_cache.shape)}, "
                         f"value_cache {tuple(value_cache.shape)}")
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if head_size != key_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"query heads/head_size {tuple(query.shape[1:])} do not match the cache's "
                         f"{num_kv_heads} kv heads of size {key_cache.shape[3]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {num_seqs} sequences")
    storage = KV_STORAGE_DTYPES[kv_format]
    if key_cache.dtype != storage or value_cache.dtype != storage:
        raise TypeError(f"a {kv_format} cache is stored as {storage}, got {key_cache.dtype}/{value_cache.dtype}")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise TypeError(f"block_tables and seq_lens must be int64, got {block_tables.dtype}/{seq_lens.dtype}")
    if layout_of(key_cache) != layout_of(value_cache) or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have one layout (the kernel walks raw block strides)")
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise ValueError("paged_attention_decode is a CPU kernel")
    ops_by_path = {"best": ops.paged_attention_decode, "avx512": ops.paged_attention_decode_avx512,
                   "avx2": ops.paged_attention_decode_avx2, "scalar": ops.paged_attention_decode_scalar,
                   "bf16dot": ops.paged_attention_decode_bf16dot, "amx": ops.paged_attention_decode_amx}
    if path not in ops_by_path:
        raise ValueError(f"unknown path {path!r}; expected one of {list(ops_by_path)}")
    if cascade not in CASCADE_MODES:
        raise ValueError(f"unknown cascade mode {cascade!r}; expected one of {list(CASCADE_MODES)}")
    op = ops_by_path[path]
    q = query.contiguous().float()
    out = torch.empty_like(q)
    if cascade == "off":
        op(out, q, key_cache, value_cache, block_tables.contiguous(), seq_lens.contiguous(),
           KV_FORMATS[kv_format], float(out_scale))
        return out
    if path == "avx512" and not ops.has_avx512():
        raise RuntimeError("this build of the kernels has no AVX-512 tiles")
    if path == "bf16dot" and not decode_bf16_dot_available():
        raise RuntimeError("this build of the kernels has no bf16 dot-product tiles (AVX512-BF16 and AVX512-VBMI)")
    if path == "amx" and not decode_amx_available():
        raise RuntimeError("this process has no AMX decode tiles (an AMX build, and the OS's grant of the tile state)")
    ops.paged_attention_decode_cascade(out, q, key_cache, value_cache, block_tables.contiguous(),
                                       seq_lens.contiguous(), KV_FORMATS[kv_format], float(out_scale),
                                       _DECODE_PATHS[path], CASCADE_MODES[cascade])
    return out


# paged_attention.cpp's Path and CascadeMode numbers.
_DECODE_PATHS = {"scalar": 0, "avx2": 1, "best": 2, "avx512": 3, "bf16dot": 4, "amx": 5}
CASCADE_MODES = {"off": 0, "auto": 1, "always": 2}


def decode_bf16_dot_available() -> bool:
    """Whether the decode attention was built with its bf16 dot-product tiles
    (AVX512-BF16 and AVX512-VBMI): FP8 caches with a bf16 query take them
    (path "bf16dot")."""
    ops = load_cpu_ops()
    return (ops is not None and hasattr(ops, "paged_attention_has_bf16_dot")
            and bool(ops.paged_attention_has_bf16_dot()))


def decode_amx_available() -> bool:
    """Whether the decode attention runs its AMX tiles in this process (an
    AMX build and the OS's grant of the tile data state): FP8 caches with a
    bf16 query take them (path "amx", what the engine's bf16 models run)."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "paged_attention_has_amx") and bool(ops.paged_attention_has_amx())


def paged_attention_decode_ref(query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale):
    """Plain PyTorch reference with the kernel's contract (same pre-scaled
    query, same decode of the stored format, float64 maths)."""
    from fp8serve.quantization.fp8 import dequantize_fp8, fp8_format

    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads

    def decode(x):
        if kv_format.startswith("fp8"):
            v = dequantize_fp8(x, 1.0, fp8_format(kv_format), torch.float32).double()
            return v / E4M3_DECODE_MULTIPLIER if kv_format == "fp8_e4m3" else v
        return x.double()

    out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float64)
    for b in range(num_seqs):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = decode(read_slots(key_cache, slots))  # [n, kvh, d]
        v = decode(read_slots(value_cache, slots))
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[b].double(), k)
        p = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v) * out_scale
    return out.float()


def gather_cache(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size] in kv_format's storage dtype
    slots: torch.Tensor,  # [n] int64
    kv_format: str,
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, num_kv_heads, head_size] in dtype
    """The stored rows at `slots`, decoded at scale 1 to `dtype` (float32, bf16 or fp16) in one
    pass: what reshape_and_cache(..., return_decoded=True) returned when they were written."""
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("C++ CPU kernels are not available")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {list(KV_FORMATS)}")
    if cache.dtype != KV_STORAGE_DTYPES[kv_format]:
        raise TypeError(f"a {kv_format} cache is stored as {KV_STORAGE_DTYPES[kv_format]}, got {cache.dtype}")
    if slots.dtype != torch.int64:
        raise TypeError(f"slots must be int64, got {slots.dtype}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"gather_cache decodes to float32, bfloat16 or float16, not {dtype}")
    out = torch.empty(slots.shape[0], cache.shape[2], cache.shape[3], dtype=dtype)
    ops.gather_cache(cache, slots.contiguous(), KV_FORMATS[kv_format], out)
    return out


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], heads contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]: HND or NHD, kv_cache_spec
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token
    kv_format: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    return_decoded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Convert (FP8: quantize x / scale, saturating, nearest-even) and scatter
    K and V into their slots in one pass. With `return_decoded`, also return
    the stored values read back at scale 1 in key's dtype (what attention over
    the cache will see), for attention over a fresh prefill."""
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("C++ CPU kernels are not available")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown kv_format {kv_format!r}; expected one of {list(KV_FORMATS)}")
    storage = KV_STORAGE_DTYPES[kv_format]
    if key_cache.dtype != storage or value_cache.dtype != storage:
        raise TypeError(f"a {kv_format} cache is stored as {storage}, got {key_cache.dtype}/{value_cache.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    key_out = torch.empty(key.shape, dtype=key.dtype) if return_decoded else None
    value_out = torch.empty(value.shape, dtype=value.dtype) if return_decoded else None
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous(), KV_FORMATS[kv_format],
                          float(k_scale), float(v_scale), key_out, value_out)
    return (key_out, value_out) if return_decoded else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dim of a 2-D x (rows contiguous)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    load_cpu_ops().rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x; x = rms_norm(residual) * weight."""
    load_cpu_ops().fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for a 2-D x of width 2d."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    load_cpu_ops().silu_and_mul(out, x)
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """In place rotate-half RoPE of query [T, H, D] and key [T, Hkv, D]
    (heads contiguous, any token stride) with cos/sin [max_position, D/2]."""
    load_cpu_ops().rotary_embedding(positions, query, key, cos, sin)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.max(logits, dim=-1).indices for [num_rows, vocab] float32 CPU
    logits (first index of the maximum; the first NaN wins), one C++ pass
    (sampling_ops.cpp); any other input, or no kernels, goes to torch."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and load_cpu_ops() is not None):
        return load_cpu_ops().greedy_argmax(logits)
    return greedy_argmax_ref(logits)


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """The reference `greedy_argmax` is tested against."""
    return logits.max(dim=-1).indices


def sample_tokens_applies(logits: torch.Tensor) -> bool:
    """Whether `sample_tokens` takes these (processed, float32) logits."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and 0 < logits.shape[1] < 2**31 and logits.stride(1) == 1 and load_cpu_ops() is not None)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of [rows, vocab] float32 logits: temperature, top-k
    (<= 0: off), top-p, min-p, then the inverse CDF of the kept tokens at the
    row's uniform u (float64 in [0, 1)). -2 for rows with temperature <
    SAMPLING_EPS (greedy: not sampled), -1 for rows the kernel leaves to the
    torch path (a NaN, or no finite maximum). See random_sampling.cpp."""
    exclude = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    return load_cpu_ops().sample_tokens(logits, *_row_params(temperature, top_k, top_p, min_p, u), exclude)[0]


def sample_tokens_excluding(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor,
                            exclude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` where row r draws without token exclude[r] (< 0: none),
    and that token's probability under the row's kept distribution (float64;
    0 where none): speculative decoding's rejection step for a drafted token.
    A row that keeps only its excluded token returns it (probability 1)."""
    return tuple(load_cpu_ops().sample_tokens(logits, *_row_params(temperature, top_k, top_p, min_p, u),
                                              exclude.to(torch.int64).contiguous()))


def _row_params(temperature, top_k, top_p, min_p, u) -> tuple[torch.Tensor, ...]:
    """The per-row parameters in the dtypes and layout the kernel reads (a no-op
    for SamplingMetadata's own tensors)."""
    return (temperature.to(torch.float32).contiguous(), top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(), min_p.to(torch.float32).contiguous(),
            u.to(torch.float64).contiguous())


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_fused_cpu_ops(x: torch.Tensor) -> bool:
    """Whether the fused C++ layer ops (RMSNorm, SiluAndMul, RoPE) serve `x`:
    a CPU tensor of a float dtype they take, with the kernels built.
    FP8SERVE_DISABLE_CPU_KERNELS turns them off with the rest."""
    return x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and load_cpu_ops() is not None


@functools.cache
def _has_bf16_dot() -> bool:
    """Whether the built dense_gemv multiplies bf16 x bf16 with AVX512-BF16."""
    ops = load_cpu_ops()
    return ops is not None and bool(ops.dense_gemv_has_bf16_dot())


@functools.cache
def _has_amx() -> bool:
    from fp8serve.kernels import amx_linear_ops  # it imports this module

    return amx_linear_ops.is_available()


def dense_gemv_max_rows(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
    """The most activation rows `dense_gemv` takes for these dtypes (0: none),
    where it was measured faster than the alternative. Measured on the
    default model's 120 decode linears with cold weights (2-vCPU Xeon, AMX;
    benchmarks/results/dense_gemv_2026-11-30.md): bf16 weights 2.0x / 1.8x /
    1.7x / 1.1x at M = 1 / 2 / 4 / 8 (torch's bf16 GEMV reads ~9 GB/s), but
    0.9x / 0.66x at M = 12 / 16 (16 FMAs per weight make the AVX2 loop
    compute-bound where AMX is not); float32 weights 1.06x at M = 1-2,
    1.55x at M = 4-8, 1.44x / 1.13x at M = 12 / 16. With AVX512-BF16 dot
    products (bf16 x bf16 on such CPUs) bf16 reached 1.66x at M = 8, 1.10x at
    12 and 0.88x at 16 (run 3 of that file); alternating calls gave medians of
    1.25x / 1.17x / 1.11x at M = 9 / 10 / 12 and 0.94x at 16: those builds take
    bf16 x bf16 up to 12 rows. That 0.94x was against torch's GEMM on AMX; on
    a CPU without AMX (AMD Zen 4, where torch's bf16 GEMM read 9-11 GB/s at
    these rows) the dot products ran 1.30-1.36x as fast as F.linear at
    M = 12-16, so CPUs without AMX take bf16 x bf16 up to 16 rows (with AMX,
    amx_linear serves 8-64 rows before this is asked). On that AMD machine,
    with the L2 prefetch of stop 20, dense_gemv still beat F.linear at
    M = 24 / 32: 1.46 / 1.26x (bf16 x bf16) and 1.44 / 1.30x (float32)
    (benchmarks/results/dense_gemv_2026-11-30_stop20_zen4.md), so AMD CPUs
    take up to 32 rows (all the kernel takes) with float32 weights and with
    bf16 x bf16 dot products.

    bf16 weights with float32 activations (an FP8 checkpoint's bf16 LM head
    in a float32 engine) run the float32 loop with one shift more per weight
    and half its bytes, and the alternative there is no bf16 GEMM but
    F.linear on float32 upcasts of the weight: they take the float32
    weights' rows. Measured on the AVX2-only Zen 3 EPYC (that head, 49152 x
    576, cold): 2.8-6.7x the upcast path at M = 16-32
    (benchmarks/results/lm_head_2026-12-02_zen3.md). fp16 weights (F16C
    conversions instead of shifts) take the same rows."""
    if x_dtype == torch.float32 and weight_dtype in (torch.float32, torch.bfloat16, torch.float16):
        return 32 if is_amd_cpu() else 16
    if x_dtype == torch.bfloat16 and weight_dtype == torch.bfloat16:
        if _has_bf16_dot():
            return 12 if _has_amx() else 32 if is_amd_cpu() else 16
        return 8
    return 0


def dense_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense_gemv` beats the alternative for this call (see
    dense_gemv_max_rows)."""
    if x.device.type != "cpu" or x.dim() != 2 or weight.dim() != 2 or not weight.is_contiguous():
        return False
    return 1 <= x.shape[0] <= dense_gemv_max_rows(x.dtype, weight.dtype) and load_cpu_ops() is not None


# The rows dense_gemv_packed serves (where a layer has the packed copy). Measured on
# the default model's 120 decode linears and its lm_head, weights read from
# memory (AMD EPYC Zen 4, benchmarks/results/dense_gemv_packed_2026-12-01_zen4.md):
# up to 12 rows two runs disagreed (the packed layout 0.88-0.97x of the plain
# rows' dense_gemv on the linears in one, 0.91-1.16x in the other), so the
# plain rows keep them; at 13-32 rows the packed layout ran 1.02-1.39x
# (linears) and 1.26-1.46x (lm_head) as fast as dense_gemv, and at 48-256 rows
# 1.04-1.57x as fast as oneDNN on its own packed weight (the path above 32
# rows). At 512 rows the lm_head ran 0.89x in one run, and at prefill sizes
# (8192 rows) oneDNN ran 1.13-1.22x as fast: those keep oneDNN.
GEMV_PACKED_MIN_ROWS = 13
GEMV_PACKED_MAX_ROWS = 256
# The LM head (49152 x 576 on the default model) as the engine runs it, cold,
# with its float32 logits (dense_gemv + .float() against dense_gemv_packed_float_out,
# 40 ABBA rounds, twice): 1.05x at 1-2 rows, 1.13-1.33x at 4-12. It reads its
# packed copy from one row.
LM_HEAD_PACKED_MIN_ROWS = 1


def dense_gemv_packed_applies(x: torch.Tensor, packed: torch.Tensor | None,
                              min_rows: int = GEMV_PACKED_MIN_ROWS) -> bool:
    """Whether `dense_gemv_packed` serves x against a layer's packed copy
    (`weight_gemv_packed`, None where the engine made none)."""
    return (packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and min_rows <= x.shape[0] <= GEMV_PACKED_MAX_ROWS)


def dense_gemv_packed(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None, *,
                      float_out: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias), bf16, from the weight's packed copy
    (gemv_packing.pack_gemv_weight); n = weight.shape[0]. float_out: float32
    holding the same bf16-rounded values (`.float()` of the bf16 result, in
    the same pass: the LM head). See dense_gemv_packed.cpp."""
    ops = load_cpu_ops()
    return (ops.dense_gemv_packed_float_out if float_out else ops.dense_gemv_packed)(x, packed, n, bias)


def dense_gemv_packed_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, n: int,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u for [g, u] = x @ weight.T (+ bias), weight [n, K] the bf16 [gate; up] rows of a
    gate_up projection and `packed` its packed copy: [M, n / 2] bf16, the bits `dense_gemv_packed`
    then `silu_and_mul` give, in one kernel (cpu/dense_gemv_packed.cpp). n / 2 must be a multiple
    of 16 (the gate's and the up's rows whole blocks of the packed copy)."""
    return load_cpu_ops().dense_gemv_packed_silu_and_mul(x, packed, n, bias)


# The rows bf16_tiled_gemm serves: float32 x of at least this many rows
# against a bf16 weight's packed copy (a bf16 checkpoint under float32
# compute, on the AVX2 CPUs where gemv_packing packs for it), decode batches
# and prefills alike. The default model's 120 decode linears read from memory
# (AVX2-only Zen 2 EPYC, ABBA rounds,
# benchmarks/results/bf16_tiled_gemm_2026-12-05_zen2.md): 0.80-0.85x
# dense_gemv at 8 rows, 1.02x at 10, 1.09x at 12 and 16 (1.14x at 16 in the
# first run), 1.12-1.29x at 17-32; 1.12-1.57x oneDNN's packed float32 weight
# at 48-256. At prefill rows see benchmarks/results/bf16_tiled_gemm_prefill_2026-12-06_zen2.md.
# Since the kernel prefetches the next weight panel it runs 1.05-1.46x
# dense_gemv at 3-11 rows too, but whole decode steps did not follow then (1.02x
# at batch 4, 0.95x at 8: bf16_tiled_gemm_min_rows_2026-12-06_zen2.md): a tile
# of 1-3 rows waited on the FMA latency. Since its tiles of 1-3 rows keep more
# accumulators (tiled_gemm_tail_tiles_2026-12-06_zen2.md), decode steps at batch
# 3-10 ran 1.05-1.27x with it (1.14x at 8); at 2 rows the linears alone still run
# 0.89-0.91x dense_gemv (bf16_tiled_gemm_min_rows_2026-12-06_zen2_stop66.md).
BF16_TILED_GEMM_MIN_ROWS = 3
# The rows it serves where the layer also has oneDNN's packed float32 copy
# (Intel CPUs: gemv_packing.float32_packing_keeps_onednn). Measured on an Intel
# Xeon (Ice Lake: AVX-512, no bf16 arithmetic;
# benchmarks/results/bf16_tiled_gemm_2026-12-07_icelake.md), the default
# model's 120 decode linears read from memory, ABBA rounds: with the AVX-512
# builds' two-panel tiles 0.98x dense_gemv at 3 rows, 1.20x at 8, 1.42-1.54x at
# 12-16; against oneDNN 1.52x at 24, 1.34x at 32, 1.17x at 64, 0.82x at 256.
# Whole decode steps (FP8 cache, ~512 tokens, against dense_gemv up to 16 rows
# and oneDNN above): 1.19x at batch 8, 1.62x at 16, 1.42x at 24; 32 and up
# were not measured in engine steps, so oneDNN keeps them.
BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN = (8, 24)
# The same on AMD CPUs with AVX-512 (gemv_packing.float32_rows_beside_onednn).
# Measured on a Zen 4 EPYC (2 vCPUs, AVX512-BF16: float32 compute only where
# asked for, --dtype float32; benchmarks/results/bf16_tiled_gemm_2026-12-07_zen4.md):
# the 120 decode linears from memory 1.19-1.37x dense_gemv at 8-32 rows,
# 1.25-1.27x oneDNN at 32, 1.11-1.16x at 64, 0.99x at 128, 0.94-0.96x at 256
# (two runs); whole decode steps (FP8 cache, ~512 tokens) 1.09-1.24x at
# batches 8-64 (two runs), against dense_gemv up to 32 rows and oneDNN above.
BF16_TILED_GEMM_ROWS_BESIDE_ONEDNN_AMD = (8, 64)


@functools.cache
def bf16_tiled_gemm_built() -> bool:
    """Whether the C++ kernels were built with bf16_tiled_gemm (AVX2 + FMA)."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "bf16_tiled_gemm_available") and bool(ops.bf16_tiled_gemm_available())


def bf16_tiled_gemm_rows(onednn_packed: torch.Tensor | None) -> tuple[int, int | None]:
    """(fewest, most) rows `bf16_tiled_gemm` serves on a layer with its packed
    copy (most None: no bound): every batch of BF16_TILED_GEMM_MIN_ROWS or more
    where it is the layer's only GEMM copy, this CPU's rows beside oneDNN
    (gemv_packing.float32_rows_beside_onednn) where `onednn_packed` (the
    layer's `weight_packed`) is there for the rest."""
    if onednn_packed is None:
        return BF16_TILED_GEMM_MIN_ROWS, None
    from fp8serve.kernels import gemv_packing

    return gemv_packing.float32_rows_beside_onednn()


def bf16_tiled_gemm_applies(x: torch.Tensor, packed: torch.Tensor | None,
                            onednn_packed: torch.Tensor | None = None) -> bool:
    """Whether `bf16_tiled_gemm` serves x against a layer's packed copy
    (`weight_gemv_packed`, None where the engine made none); `onednn_packed`:
    the layer's `weight_packed` (bf16_tiled_gemm_rows)."""
    if packed is None or x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        return False
    lo, hi = bf16_tiled_gemm_rows(onednn_packed)
    return lo <= x.shape[0] and (hi is None or x.shape[0] <= hi) and bf16_tiled_gemm_built()


def bf16_tiled_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, x float32, from a bf16 weight's packed
    copy (gemv_packing.pack_gemv_weight); n = weight.shape[0]. See
    cpu/bf16_tiled_gemm.cpp."""
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()  # exact: a 16-bit checkpoint's bias
    return load_cpu_ops().bf16_tiled_gemm(x.contiguous(), packed, n, bias)


def bf16_tiled_gemm_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, n: int,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u for [g, u] = x @ weight.T (+ bias), weight [n, K] the bf16 [gate; up] rows of a
    gate_up projection and `packed` its packed copy: [M, n / 2] float32, what `bf16_tiled_gemm` then
    `silu_and_mul` give, in one kernel (cpu/bf16_tiled_gemm.cpp)."""
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    return load_cpu_ops().bf16_tiled_gemm_silu_and_mul(x.contiguous(), packed, n, bias)


# The rows fp8_gemv_packed serves (FP8 layers with a packed copy, bf16 x).
# Measured like the above (120 decode linears from memory, e4m3 codes,
# benchmarks/results/dense_gemv_packed_2026-12-01_zen4.md): 1.13-1.46x the
# fused FP8 kernel at 1-2 rows, 1.8-2.5x at 4-16 (where that kernel decodes to
# float32 and runs FMAs), 1.5-2.1x the dequantize + GEMM path at 24-64 and
# 1.1-1.3x at 128-512.
FP8_GEMV_PACKED_MAX_ROWS = 512


def fp8_gemv_packed_applies(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether `fp8_gemv_packed` serves x against an FP8 layer's packed codes
    (`weight_gemv_packed`, None where the engine made none)."""
    return (packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and 1 <= x.shape[0] <= FP8_GEMV_PACKED_MAX_ROWS)


def fp8_gemv_packed(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (codes * weight_scale).T (+ bias) in bf16 from an FP8 layer's packed
    codes and scales (gemv_packing.pack_fp8_gemv_weight); n = the layer's
    output size. See dense_gemv_packed.cpp."""
    return load_cpu_ops().fp8_gemv_packed(x, packed, scale, n, bias)


# dense_gemv's row walks (dense_gemv.cpp `Walk`): how a call streams the weight rows.
DENSE_GEMV_WALKS = {"auto": 0, "interleaved": 1, "sequential": 2}


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               path: str = "best", walk: str = "auto") -> torch.Tensor:
    """x @ weight.T (+ bias) for M <= 32 rows, float32, bf16 or fp16 weights (fp16: float32 x only),
    accumulated in float32 and returned in x's dtype. path="fma" keeps the
    float32-FMA loop where the build would use AVX512-BF16 dot products
    (bf16 x and weights), for tests and benchmarks. walk: "auto" (sequential
    at M <= 2 on AMD CPUs, interleaved otherwise), or force "interleaved" or
    "sequential" (M <= 2), for tests and benchmarks."""
    ops = load_cpu_ops()
    if path not in ("best", "fma"):
        raise ValueError(f"unknown path {path!r}; expected 'best' or 'fma'")
    if walk not in DENSE_GEMV_WALKS:
        raise ValueError(f"unknown walk {walk!r}; expected one of {list(DENSE_GEMV_WALKS)}")
    if walk == "auto":
        return (ops.dense_gemv if path == "best" else ops.dense_gemv_fma)(x, weight, bias)
    if walk == "sequential" and x.dim() == 2 and x.shape[0] > 2:
        raise ValueError(f"the sequential walk takes at most 2 rows, got {x.shape[0]}")
    return ops.dense_gemv_walk(x, weight, bias, path == "best", DENSE_GEMV_WALKS[walk])


def dense_gemv_auto_walk(m: int) -> str:
    """The walk dense_gemv takes at `m` rows on this CPU ("interleaved" or "sequential")."""
    return "sequential" if load_cpu_ops().dense_gemv_auto_walk(m) == 2 else "interleaved"
