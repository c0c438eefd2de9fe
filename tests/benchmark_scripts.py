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
