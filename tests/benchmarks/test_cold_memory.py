"""benchmarks/cold_memory.py: the warm/cold timing helper."""

from __future__ import annotations

from benchmark_scripts import loaded_script


def test_warm_cold_flushes_before_every_cold_call():
    with loaded_script("cold_memory.py") as script:
        events: list[str] = []

        class Flush:
            def sum(self):
                events.append("flush")

        def fn():
            events.append("call")

        warm, cold = script.warm_cold(fn, Flush(), calls=4)
    assert warm > 0 and cold > 0
    # 3 untimed calls, 4 warm calls back to back, then 4 cold calls each right after a flush.
    assert events == ["call"] * 7 + ["flush", "call"] * 4

