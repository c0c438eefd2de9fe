"""`fp8serve quantize`: a 16-bit checkpoint -> an FP8 one (AutoFP8 layout, or
llm-compressor's compressed-tensors layout for per-channel weight scales).

Two passes. First the weights are quantized (per tensor or per output row,
amax / 448) into a dynamic-scheme checkpoint. Then, for static activation scales or --kv-cache,
that FP8 checkpoint is run over calibration text and the input of every
projection and the K/V of every layer are observed, so the scales describe
the activations the FP8 model produces, not the 16-bit model's. The result is
written next to the output and renamed into place only when complete."""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
from pathlib import Path

from fp8serve.tools.calibrate import add_calibration_args, calibration_inputs, format_kv_table

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="write an FP8-weight checkpoint (AutoFP8 layout), optionally with calibrated KV scales",
        description=(
            "Quantize every linear projection (q/k/v/o, gate/up/down, Mixtral w1/w2/w3; not the MoE router) "
            "to float8_e4m3fn with a float32 per-tensor weight_scale (amax/448). With the static activation "
            "scheme, input_scale is calibrated over the text; with --kv-cache, per-layer self_attn.k_scale / "
            "v_scale too. Embeddings, norms and lm_head stay 16-bit. fp8serve loads the result with no flags."
        ),
    )
    add_calibration_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output checkpoint directory (must not exist)")
    p.add_argument("--activation-scheme", default="static", choices=("static", "dynamic"),
                   help="static: calibrated per-tensor input_scale (default); dynamic: none")
    p.add_argument("--weight-strategy", default="tensor", choices=("tensor", "channel"),
                   help="tensor: one weight_scale per projection, AutoFP8 layout (default); channel: one per output "
                        "row, llm-compressor's compressed-tensors layout (FP8_DYNAMIC with --activation-scheme "
                        "dynamic)")
    p.add_argument("--kv-cache", action="store_true", help="also calibrate and write FP8 KV cache scales")
    p.add_argument("--kv-scale-format", default="both", choices=("both", "k_v", "kv"),
                   help="KV scale tensor names: both = k_scale + v_scale + kv_scale = max(k, v) (default); "
                        "k_v = self_attn.k_scale + v_scale only; kv = kv_scale only")
    p.set_defaults(func=run)


def _calibrate(args, fp8_dir: Path, weight_names: list[str], seq_len: int, source, chunks: list[list[int]]):
    """Observed (input amax per engine module, {weight name: module}, KV stats or None)."""
    from fp8serve.calibration.observers import InputAmaxObserver, KVAmaxObserver
    from fp8serve.calibration.runner import build_llm, run_chunks

    llm = build_llm(str(fp8_dir), seq_len=seq_len, dtype=args.dtype, device=args.device,
                    kv_cache_memory=args.kv_cache_memory)
    runner = llm.llm_engine.model_runner
    modules = dict(runner.model.named_modules())
    # The model's own checkpoint-name mapping says which fused module runs each
    # projection: q/k/v all read the input of `qkv_proj`.
    module_of = {w: runner.weights_mapper.map(w)[0].param_name.removesuffix(".weight") for w in weight_names}
    watched = {m: modules[m] for m in sorted(set(module_of.values()))} if args.activation_scheme == "static" else {}
    kv_observer = KVAmaxObserver(runner.attn_layers) if args.kv_cache else None
    with InputAmaxObserver(watched) as inputs:
        if kv_observer:
            kv_observer.attach()
        try:
            n = run_chunks(llm, chunks, "Calibrating")
        finally:
            if kv_observer:
                kv_observer.detach()
    print(f"calibration text: {source.description}, {n} tokens in {len(chunks)} chunks of <= {seq_len}")
    del llm, runner, modules
    gc.collect()
    return inputs.amax, module_of, (kv_observer.stats if kv_observer else None)


def run(args: argparse.Namespace) -> int:
    from fp8serve.calibration.fp8_checkpoint import input_scales, write_fp8_checkpoint
    from fp8serve.calibration.writers import attention_prefixes, check_new_directory, kv_scale_tensors
    from fp8serve.config import read_hf_config
    from fp8serve.errors import UserError

    # Everything the flags decide is checked before the first weight is written.
    out = Path(args.out)
    check_new_directory(out, "--out")
    calibrating = args.activation_scheme == "static" or args.kv_cache
    model, seq_len, source, chunks = calibration_inputs(args, need_text=calibrating)
    src = Path(model)
    cfg, _ = read_hf_config(src)
    if cfg.get("quantization_config"):
        raise UserError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')}); "
                        "quantize the 16-bit checkpoint instead")
    stage1 = out.with_name(f".{out.name}.weights-only")
    staging = out.with_name(f".{out.name}.partial")
    for d in (stage1, staging):
        if d.exists():
            shutil.rmtree(d)
    try:
        weight_names = write_fp8_checkpoint(src, stage1, activation_scheme="dynamic",
                                            weight_strategy=args.weight_strategy)
        extra = {}
        if calibrating:
            amax, module_of, kv_stats = _calibrate(args, stage1, weight_names, seq_len, source, chunks)
            if args.activation_scheme == "static":
                scales, borrowed = input_scales(weight_names, module_of, amax)
                if borrowed:
                    logger.warning("%d projections saw no calibration token (unrouted experts); their input_scale "
                                   "is the largest of their peers', e.g. %s", len(borrowed), borrowed[0])
                extra.update(scales)
                values = [float(t) for t in scales.values()]
                print(f"input_scale: {len(values)} projections, {min(values):.4g}..{max(values):.4g}")
            if kv_stats is not None:
                print(format_kv_table(kv_stats, 1.0))
                prefixes = attention_prefixes(weight_names, len(kv_stats))
                extra.update(kv_scale_tensors(prefixes, [s.k_scale() for s in kv_stats],
                                              [s.v_scale() for s in kv_stats], args.kv_scale_format))
        write_fp8_checkpoint(src, staging, activation_scheme=args.activation_scheme,
                             weight_strategy=args.weight_strategy, extra_tensors=extra, kv_cache=args.kv_cache)
        staging.rename(out)
    finally:
        for d in (stage1, staging):
            if d.exists():
                shutil.rmtree(d)
    print(f"wrote {out}: {len(weight_names)} FP8 projections ({args.weight_strategy} scales), activation scheme "
          f"{args.activation_scheme}"
          f"{', KV cache scales' if args.kv_cache else ''}")
    return 0
