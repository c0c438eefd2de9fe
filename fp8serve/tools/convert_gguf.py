"""`fp8serve convert-gguf`: dequantize a GGUF file into a directory the engine can load."""

from __future__ import annotations

import argparse

from fp8serve.errors import UserError


# Names rather than torch dtypes so that registering the subcommand does not import torch.
_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-gguf",
        help="convert a GGUF file into a Hugging Face safetensors directory",
        description=(
            "Dequantize a GGUF model file (for example a llama.cpp Q4 file) and write config.json, "
            "model.safetensors, the tokenizer and its chat template into DIR."
        ),
    )
    parser.add_argument("gguf", metavar="FILE", help="the .gguf file to convert")
    parser.add_argument("--out", metavar="DIR", required=True, help="directory to write; created if missing")
    parser.add_argument(
        "--dtype", choices=_DTYPE_NAMES, default="bfloat16", help="dtype of the written weights (default: bfloat16)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: torch and the converter are only needed once this subcommand is chosen.
    import torch

    from fp8serve.default_model import NotAGgufError, convert_gguf

    try:
        out_dir = convert_gguf(args.gguf, args.out, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, NotAGgufError) as error:
        raise UserError(str(error)) from error
    print(out_dir)
    return 0
