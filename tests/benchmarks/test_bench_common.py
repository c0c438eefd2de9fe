"""benchmarks/bench_common.py: the ABBA alternation helper and the probe of CPUs busy with other work."""

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


def test_the_working_trees_source_builds_alone_once_per_namespace(ops):
    """build_kernel_from_tree: this tree's file in a library of its own whose op answers as the
    engine's does; asked again, the same build; a namespace holding a commit's build refuses it."""
    import pytest
    import torch

    with loaded_script("bench_common.py") as common:
        alone = common.build_kernel_from_tree("sampling_ops.cpp", "fp8serve_test_tree")
        assert alone is torch.ops.fp8serve_test_tree
        assert common.build_kernel_from_tree("sampling_ops.cpp", "fp8serve_test_tree") is alone
        logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(7))
        assert torch.equal(alone.greedy_argmax(logits), ops.greedy_argmax(logits))
        with pytest.raises(SystemExit, match="already holds sampling_ops.cpp"):
            common.build_kernel_at_rev("HEAD~1", "sampling_ops.cpp", "fp8serve_test_tree")
        with pytest.raises(SystemExit, match="does not exist in this working tree"):
            common.build_kernel_from_tree("no_such_kernel.cpp", "fp8serve_test_tree")


def test_busy_cpus_counts_other_processes_only(tmp_path):
    """Busy clock ticks of the machine less this process's CPU time, per second of wall time."""
    with loaded_script("bench_common.py"):
        from bench_common import busy_cpus, cpu_busy_by_others

        assert busy_cpus(busy_ticks=150, hz=100, own_seconds=0.5, elapsed=1.0) == 1.0
        assert busy_cpus(busy_ticks=40, hz=100, own_seconds=0.5, elapsed=1.0) == 0.0  # never below 0
        assert busy_cpus(busy_ticks=100, hz=100, own_seconds=0.0, elapsed=0.0) == 0.0
        measured = cpu_busy_by_others(0.05)
        assert measured is None or measured >= 0.0
        assert cpu_busy_by_others(0.01, stat_path=str(tmp_path / "missing")) is None
        bad = tmp_path / "stat"
        bad.write_text("cpu  12 x\n")
        assert cpu_busy_by_others(0.01, stat_path=str(bad)) is None


def test_single_stream_load_warning_trusts_the_measured_cpus_over_the_load_average():
    with loaded_script("single_stream.py") as script:
        assert script.load_warning(0.2, None) == []
        assert "WARNING: the 1-minute load average was 0.80" in script.load_warning(0.8, None)[0]
        assert "WARNING: other processes kept 1.50 CPUs busy" in script.load_warning(0.1, 1.5)[0]
        (note,) = script.load_warning(0.73, 0.02)
        assert "WARNING" not in note and "kept only 0.02 CPUs busy" in note
        assert script.load_warning(0.3, 0.1) == []
