"""`fp8serve bench {serve,sweep,throughput,latency}`."""

from __future__ import annotations

from fp8serve.benchmarks import latency, serve, sweep, throughput


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: serving (serve, sweep) and offline (throughput, latency)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve.register(sub)
    sweep.register(sub)
    throughput.register(sub)
    latency.register(sub)
