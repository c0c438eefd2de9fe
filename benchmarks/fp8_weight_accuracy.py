#!/usr/bin/env python
"""What FP8 weights cost in accuracy: per-tensor scales (AutoFP8's `fp8` layout)
against per-channel scales (llm-compressor's compressed-tensors FP8_DYNAMIC),
both written from the same 16-bit checkpoint by `fp8serve quantize`'s writer.

Every configuration teacher-forces the same tokens in the engine with the same
compute dtype and an unquantized KV cache; the reference is the 16-bit
checkpoint itself. Reported per configuration: mean KL(ref || cfg) per token,
top-1 agreement, perplexity and its change (fp8serve.calibration.metrics), and
the bytes of the quantized projections' weights and scales.

    python benchmarks/fp8_weight_accuracy.py                     # the built-in model, built-in text
    python benchmarks/fp8_weight_accuracy.py --model DIR --text eval.txt --num-tokens 8192
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, describe_machine, emit_table, machine_info, require_positive  # noqa: E402

STRATEGIES = {"per tensor (fp8)": "tensor", "per channel (compressed-tensors)": "channel"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="16-bit checkpoint (default: the built-in model)")
    p.add_argument("--text", default=None, help="evaluation text (default: the built-in calibration sample)")
    p.add_argument("--num-tokens", type=int, default=2048, help="tokens of text to run (default 2048)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per teacher-forced chunk (default 512)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype of every configuration (default float32: a clean comparison)")
    p.add_argument("--output", type=Path, default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    require_positive(p, args, "num_tokens", "seq_len")
    if args.num_tokens < 2 or args.seq_len < 2:
        p.error("--num-tokens and --seq-len must be >= 2")
    return args


def _weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of FP8 weight codes, bytes of their weight_scale tensors) in the checkpoint."""
    import math

    from safetensors import safe_open

    sizes = {"F8_E4M3": 1, "F32": 4, "BF16": 2, "F16": 2}
    codes = scales = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                nbytes = math.prod(piece.get_shape()) * sizes.get(piece.get_dtype(), 0)
                if name.endswith(".weight") and piece.get_dtype() == "F8_E4M3":
                    codes += nbytes
                elif name.endswith(".weight_scale"):
                    scales += nbytes
    return codes, scales


def _logits(model_dir: str, chunks, args, label: str):
    import torch

    from fp8serve.calibration.runner import build_llm, iter_prompt_logits

    llm = build_llm(model_dir, seq_len=args.seq_len, dtype=args.dtype)
    out = [logits.float().clone() for _, logits in iter_prompt_logits(llm, chunks, label)]
    del llm
    gc.collect()
    return torch.cat(out) if out else None, out


def main(argv=None) -> None:
    args = parse_args(argv)
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint
    from fp8serve.calibration.metrics import KLStats
    from fp8serve.calibration.text import load_text, token_chunks
    from fp8serve.default_model import ensure_default_model
    from fp8serve.engine.tokenizer import load_tokenizer

    src = Path(args.model) if args.model else Path(ensure_default_model())
    source = load_text(args.text)
    chunks = token_chunks(load_tokenizer(str(src)), source.text, args.num_tokens, args.seq_len)
    if not chunks:
        sys.exit("the text is shorter than 2 tokens")
    _, reference = _logits(str(src), chunks, args, "16-bit reference")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8serve-weight-accuracy-") as tmp:
        for label, strategy in STRATEGIES.items():
            fp8_dir = Path(tmp) / strategy
            write_fp8_checkpoint(src, fp8_dir, activation_scheme="dynamic", weight_strategy=strategy)
            _, logits = _logits(str(fp8_dir), chunks, args, label)
            stats = KLStats()
            for chunk, ref, got in zip(chunks, reference, logits):
                stats.update(ref, got, chunk)
            codes, scales = _weight_bytes(fp8_dir)
            rows.append((label, stats, codes, scales))

    lines = [f"# FP8 weights: per-tensor against per-channel scales ({src.name})", "",
             f"command: `{command_line(argv)}`", ""]
    lines += describe_machine(machine_info())
    lines += ["", f"text: {source.description}; {sum(len(c) for c in chunks)} tokens in {len(chunks)} chunks of "
                  f"<= {args.seq_len}; compute dtype {args.dtype}; KV cache unquantized; reference: {src.name} as "
                  f"it is (ppl {rows[0][1].ppl_ref:.4f})", "",
              "| weights | KL mean | top-1 % | ppl | ppl change | FP8 codes MiB | scales KiB |",
              "|---|---|---|---|---|---|---|"]
    for label, s, codes, scales in rows:
        lines.append(f"| {label} | {s.kld_mean:.3e} | {s.top1_agreement:.2f} | {s.ppl:.4f} | "
                     f"{100 * s.ppl_rel_change:+.3f}% | {codes / 2**20:.1f} | {scales / 2**10:.1f} |")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
