"""benchmarks/prefill_attention.py --baseline-rev: this tree's kernel side by side with a build of it
from git, outputs compared bit for bit; bad arguments rejected."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmark_scripts import loaded_script

REPO = Path(__file__).resolve().parents[2]


def source_is_committed(path: str) -> bool:
    """Whether `path` in this tree is as committed at HEAD (false outside a git checkout)."""
    try:
        r = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=REPO, capture_output=True)
    except OSError:  # no git here
        return False
    return r.returncode == 0


def test_baseline_from_git_runs_side_by_side(ops, tmp_path):
    out = tmp_path / "table.md"
    with loaded_script("prefill_attention.py") as script:
        assert script.main(["--dtypes", "float32", "--cells", "2x40,1x17", "--min-time", "0.001", "--rounds", "2",
                            "--baseline-rev", "HEAD", "--output", str(out)]) == 0
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| float32")]
    assert [r.split("|")[2].strip() for r in rows] == ["2x40", "1x17"]
    identical = [r.rstrip(" |").rsplit("|", 1)[1].strip() for r in rows]
    assert set(identical) <= {"yes", "no"}
    if source_is_committed("fp8serve/kernels/cpu/prefill_attention.cpp"):  # the same source: the same bits
        assert identical == ["yes", "yes"], rows
    assert all(float(r.split("|")[5].strip().rstrip("x")) > 0 for r in rows)


def test_baseline_over_a_cached_context(ops, tmp_path):
    """--context: the context form of both builds, new tokens after that many cached keys."""
    out = tmp_path / "table.md"
    with loaded_script("prefill_attention.py") as script:
        assert script.main(["--dtypes", "bfloat16", "--cells", "1x20,2x7", "--context", "150", "--min-time", "0.001",
                            "--rounds", "2", "--baseline-rev", "HEAD", "--output", str(out)]) == 0
    text = out.read_text()
    assert "continue 150 cached keys" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| bfloat16")]
    assert [r.split("|")[2].strip() for r in rows] == ["1x20", "2x7"]
    if source_is_committed("fp8serve/kernels/cpu/prefill_attention.cpp"):
        assert all(r.rstrip(" |").rsplit("|", 1)[1].strip() == "yes" for r in rows), rows


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                          (["--dtypes", "int8"], "unknown dtype 'int8'"),
                                          (["--context", "64"], "without --baseline-rev"),
                                          (["--context", "-1", "--baseline-rev", "HEAD"], "--context takes")])
def test_rejects_bad_arguments(bad, message, capsys):
    with loaded_script("prefill_attention.py") as script, pytest.raises(SystemExit) as e:
        script.main(bad)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
