"""`fp8serve` command line: one subcommand per module, each with `register()`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fp8serve.errors import UserError
from fp8serve.logger import configure_default_logging, set_level

# module, in the order `fp8serve --help` lists them
_COMMANDS = [
    "fp8serve.entrypoints.generate",
    "fp8serve.tools.convert_gguf",
]
_OPTIONAL_COMMANDS = [
    "fp8serve.tools.scales",
    "fp8serve.tools.calibrate",
    "fp8serve.tools.quantize",
    "fp8serve.tools.eval_kv",
    "fp8serve.tools.compare",
    "fp8serve.entrypoints.openai.serve",
    "fp8serve.benchmarks.cli",
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8serve",
        description="LLM inference and serving with an FP8 KV cache and calibrated per-layer scales.",
    )
    # FP8SERVE_LOGGING_LEVEL (vLLM's VLLM_LOGGING_LEVEL; the Python API reads it
    # too) or its older spelling FP8SERVE_LOG_LEVEL sets the default.
    env_level = os.environ.get("FP8SERVE_LOGGING_LEVEL") or os.environ.get("FP8SERVE_LOG_LEVEL") or "INFO"
    parser.add_argument("--log-level", default=env_level.upper(), type=str.upper,
                        choices=list(LOG_LEVELS))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS + _OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if name in _OPTIONAL_COMMANDS and e.name and name.startswith(e.name):
                continue
            raise
        module.register(sub)
    return parser


def setup_logging(level: str) -> None:
    configure_default_logging()
    set_level(level)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.log_level not in LOG_LEVELS:  # a bad environment value (argparse checks the flag's)
        parser.error(f"FP8SERVE_LOGGING_LEVEL / FP8SERVE_LOG_LEVEL: {args.log_level!r} is not one of "
                     f"{', '.join(LOG_LEVELS)}")
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
