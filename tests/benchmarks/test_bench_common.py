"""benchmarks/bench_common.py: the ABBA alternation helper."""

from __future__ import annotations

from benchmark_scripts import loaded_script


def test_alternate_reverses_the_order_every_other_round_and_takes_medians():
    with loaded_script("bench_common.py") as common:
        order: list[str] = []
        values = {"a": iter([5.0, 1.0, 3.0, 100.0]), "b": iter([2.0, 2.0, 9.0, 4.0])}

        def measure(name):
            def run():
                order.append(name)
                return next(values[name])
            return run

        medians = common.alternate({"a": measure("a"), "b": measure("b")}, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert medians == {"a": 4.0, "b": 3.0}


def test_a_baseline_build_is_made_once_per_namespace(ops):
    """An op takes one registration per process (a second aborts it): the
    same source in the same namespace again returns the first build, even from
    a freshly loaded copy of the module, if it is of the same commit; another
    commit of it is an error."""
    import pytest
    import torch

    with loaded_script("bench_common.py") as common:
        first = common.build_kernel_at_rev("HEAD", "sampling_ops.cpp", "fp8serve_test_once")
        assert first is torch.ops.fp8serve_test_once
    with loaded_script("bench_common.py") as common:
        assert common.build_kernel_at_rev("HEAD", "sampling_ops.cpp", "fp8serve_test_once") is first
        with pytest.raises(SystemExit, match="already holds sampling_ops.cpp"):
            common.build_kernel_at_rev("HEAD~1", "sampling_ops.cpp", "fp8serve_test_once")
