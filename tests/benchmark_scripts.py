"""Loads a script from benchmarks/ (not a package) as a module for its tests."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def loaded_script(filename: str):
    # As `python benchmarks/X.py` would: the scripts import their sibling bench_common.
    if str(BENCHMARKS_DIR) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS_DIR))
    spec = importlib.util.spec_from_file_location(f"{Path(filename).stem}_under_test", BENCHMARKS_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def run_table(monkeypatch, tmp_path, filename: str, *argv, header: str) -> tuple[str, list[list[str]]]:
    """Runs benchmarks/<filename> main() with argv and --output; returns the
    written markdown and the cells of its table rows (the row starting with
    `header`, the column names, left out)."""
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", [filename, *argv, "--output", str(out)])
    with loaded_script(filename) as script:
        script.main()
    text = out.read_text()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("| ") and not ln.startswith(header)]
    return text, rows


def assert_rejected(monkeypatch, tmp_path, capsys, filename: str, argv: list[str], message: str) -> None:
    """benchmarks/<filename> exits on argv before measuring, naming `message` (the flag) on stderr."""
    import pytest

    with pytest.raises(SystemExit):
        run_table(monkeypatch, tmp_path, filename, *argv, header="|")
    assert message in capsys.readouterr().err
