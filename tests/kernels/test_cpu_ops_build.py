"""The kernel tests skip where the C++ kernels cannot be built (no compiler).
On a machine that has a compiler, a kernel that no longer compiles must fail
here instead of turning every kernel test into a skip."""

import os
import shutil

import pytest

from fp8serve.kernels.cpu_ops import load_cpu_ops


def test_kernels_build_where_a_compiler_exists():
    if os.environ.get("FP8SERVE_DISABLE_CPU_KERNELS"):
        pytest.skip("FP8SERVE_DISABLE_CPU_KERNELS is set")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    assert load_cpu_ops() is not None, (
        f"a C++ compiler exists ({compiler}) but the kernels did not build: "
        "see the WARNING from fp8serve.kernels.cpu_ops for the compiler error"
    )
