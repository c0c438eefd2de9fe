"""`fp8serve bench {serve,sweep}`."""

from __future__ import annotations

from fp8serve.benchmarks import serve, sweep


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="serving benchmarks (serve, sweep)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve.register(sub)
    sweep.register(sub)
