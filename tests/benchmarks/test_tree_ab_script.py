"""benchmarks/tree_ab.py on a tiny checkpoint against HEAD: each side is timed in processes
that import that side's fp8serve (the baseline's from a snapshot of its files in the cache
directory, unpacked once), the table has a row per batch size, and bad arguments are rejected
before anything is unpacked. The C++ kernels are off here (FP8SERVE_DISABLE_CPU_KERNELS):
building the snapshot's own copy would take minutes; the mechanics are the same."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from benchmark_scripts import assert_rejected, loaded_script, run_table
from checkpoints import write_tiny_llama
from fp8serve.kernels import cpu_ops

REPO = Path(__file__).resolve().parents[2]


def _kernels_off_in_children(monkeypatch) -> None:
    """FP8SERVE_DISABLE_CPU_KERNELS for the measuring processes. load_cpu_ops caches its first
    answer for the process, and this process's table header asks it: asked first here, with the
    switch set, it would answer None to every later test."""
    cpu_ops.load_cpu_ops()
    monkeypatch.setenv("FP8SERVE_DISABLE_CPU_KERNELS", "1")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def _repo_state() -> tuple[str, str]:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout

    return git("worktree", "list", "--porcelain"), git("status", "--porcelain", "--untracked-files=all")


def test_both_trees_are_timed_in_their_own_processes(monkeypatch, tmp_path):
    _kernels_off_in_children(monkeypatch)
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    before = _repo_state()
    text, rows = run_table(monkeypatch, tmp_path, "tree_ab.py", "--model", str(src), "--baseline-rev", "HEAD",
                           "--batch-sizes", "1,3", "--prompt-len", "12", "--tokens", "4", "--repeats", "1",
                           "--rounds", "2", "--kv-cache-memory", "16MiB", header="| batch")
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        ours, theirs, ratio = float(r[1]), float(r[2]), float(r[3].rstrip("x"))
        assert ours > 0 and theirs > 0
        assert ratio == pytest.approx(theirs / ours, rel=0.01)
        assert r[4] in ("0 of 2", "1 of 2", "2 of 2")
        assert r[5] == "True"  # HEAD's code is this tree's (kernels off on both sides): the same greedy tokens
        assert r[6] == "True"  # and each side's two processes agree with each other
    assert "This tree vs HEAD (" in text and "2 processes per side" in text and "C++ kernels off" in text
    tree = tmp_path / "cache" / "tree_ab" / _head()
    assert f"baseline files: {tree}" in text
    assert (tree / ".complete").is_file() and (tree / "fp8serve" / "__init__.py").is_file()
    assert _repo_state() == before  # the repository itself is untouched: no worktree, no new file


def test_a_snapshot_is_unpacked_once(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    with loaded_script("tree_ab.py") as script:
        tree = script.snapshot(_head())
        (tree / "left by the first run").touch()
        assert script.snapshot(_head()) == tree
        assert (tree / "left by the first run").exists()  # found, not unpacked again
        (tree / ".complete").unlink()  # as a run killed while unpacking leaves it
        assert script.snapshot(_head()) == tree
        assert not (tree / "left by the first run").exists() and (tree / ".complete").is_file()


def test_a_failing_measuring_process_names_its_tree(monkeypatch, tmp_path):
    _kernels_off_in_children(monkeypatch)
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match=f"the measuring process for {REPO} failed"):
        run_table(monkeypatch, tmp_path, "tree_ab.py", "--model", str(tmp_path / "missing"), "--baseline-rev", "HEAD",
                  "--batch-sizes", "1", "--rounds", "1", header="| batch")


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "1"], "--baseline-rev is required"),
    (["--baseline-rev", "no-such-rev-anywhere"], "--baseline-rev no-such-rev-anywhere: not a commit"),
    (["--baseline-rev", "HEAD", "--rounds", "0"], "--rounds"),
    (["--baseline-rev", "HEAD", "--tokens", "-2"], "--tokens"),
    (["--baseline-rev", "HEAD", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["--baseline-rev", "HEAD", "--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
    (["--baseline-rev", "HEAD", "--dtype", "fp4"], "--dtype"),
    (["--baseline-rev", "HEAD", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert_rejected(monkeypatch, tmp_path, capsys, "tree_ab.py", argv, message)
    assert not (tmp_path / "cache" / "tree_ab").exists()


def test_half_unpacked_leftovers_are_removed_once_stale(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "tree_ab"
    stale, fresh = root / ".0123456789ab_killed", root / ".0123456789ab_running"
    for d in (stale, fresh):
        (d / "tree").mkdir(parents=True)
    an_hour_and_more_ago = time.time() - 3700
    os.utime(stale, (an_hour_and_more_ago, an_hour_and_more_ago))
    with loaded_script("tree_ab.py") as script:
        tree = script.snapshot(_head())
    assert not stale.exists()  # a killed run's leftover
    assert fresh.is_dir()  # may be another run's, unpacking now
    assert (tree / ".complete").is_file()
    assert sorted(p.name for p in root.iterdir()) == sorted([fresh.name, _head()])


@pytest.mark.parametrize("ours, theirs, expected", [
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], "True"),
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], "False (request 1, token 1)"),
    ([[1, 2, 3], [4, 5, 6]], [[7, 2, 3], [4, 9, 6]], "False (request 0, token 0)"),
    ([[1, 2, 3]], [[1, 2]], "False (request 0, token 2)"),
    ([[1, 2, 3]], [[1, 2, 3], [4]], "False (1 requests against 2)"),
])
def test_where_the_sides_tokens_part(ours, theirs, expected):
    with loaded_script("tree_ab.py") as script:
        assert script.first_difference(ours, theirs) == expected


@pytest.mark.parametrize("tokens_by_side, expected", [
    ([[[[1, 2]], [[1, 2]]], [[[3]], [[3]]]], "True"),
    ([[[[1, 2]], [[1, 9]]], [[[3]], [[3]]]], "False"),  # this tree's second process parted from its first
    ([[[[1, 2]], [[1, 2]]], [[[3]], [[4]]]], "False"),
    ([[[[1, 2]]], [[[3]]]], "- (one process a side)"),  # --rounds 1: nothing to compare, so no verdict
])
def test_whether_each_sides_processes_agree(tokens_by_side, expected):
    with loaded_script("tree_ab.py") as script:
        assert script.processes_agree(tokens_by_side) == expected
