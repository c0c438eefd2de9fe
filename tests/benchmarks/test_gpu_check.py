"""benchmarks/gpu_check.sh runs only on a lent GPU machine, where a broken
script costs scarce device time: here it must at least parse, and every test
file and script it names must exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_gpu_check_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_check_names_existing_files():
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/]+\.py)\b", text))
    assert {"benchmarks/kv_saturation_engine.py", "benchmarks/gpu_fp8_numerics.py"} <= named
    assert any(p.startswith("tests/") for p in named)
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"gpu_check.sh names files that do not exist: {missing}"


def test_every_cuda_test_module_is_in_gpu_check():
    """A test marked cuda in a file gpu_check.sh does not run would never run anywhere."""
    text = SCRIPT.read_text()
    this = Path(__file__).resolve()
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                     if p.resolve() != this and "pytest.mark.cuda" in p.read_text())
    assert modules, "no test is marked cuda"
    assert [m for m in modules if m not in text] == []
