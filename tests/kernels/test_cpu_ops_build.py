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


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path, caplog):
    """torch's cpp_extension waits forever for its `lock` file to go; one left by a killed
    build must not hang the next start."""
    import logging

    from fp8serve.kernels.cpu_ops import _exclusive_build

    (tmp_path / "lock").touch()
    with caplog.at_level(logging.WARNING, logger="fp8serve.kernels.cpu_ops"), _exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert any("left by a build that was interrupted" in m for m in caplog.messages)


def test_builds_in_one_directory_take_turns(tmp_path):
    """While one process builds (holding the flock, torch's `lock` file present), another waits
    instead of treating that live `lock` as stale."""
    import threading
    import time

    from fp8serve.kernels.cpu_ops import _exclusive_build

    events = []
    inside = threading.Event()

    def first():
        with _exclusive_build(tmp_path):
            (tmp_path / "lock").touch()  # torch's marker of a build in progress
            inside.set()
            time.sleep(0.3)
            events.append("first done")
            (tmp_path / "lock").unlink()

    t = threading.Thread(target=first)
    t.start()
    inside.wait(5)
    with _exclusive_build(tmp_path):
        events.append("second in")
    t.join()
    assert events == ["first done", "second in"]


def test_a_checkout_elsewhere_with_the_same_sources_builds_in_its_own_directory(tmp_path, monkeypatch):
    """torch writes the sources' absolute paths into the build's ninja file: two checkouts of
    the same sources sharing one build directory would rebuild each other's library at every
    start, so the directory's key includes where the sources are."""
    from fp8serve.kernels import cpu_ops

    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "cache"))
    dirs = []
    for checkout in ("a", "b", "a"):
        src = tmp_path / checkout / "cpu"
        src.mkdir(parents=True, exist_ok=True)
        (src / "k.cpp").write_text("int k() { return 1; }\n")
        (src / "k.h").write_text("int k();\n")
        monkeypatch.setattr(cpu_ops, "_SRC_DIR", src)
        monkeypatch.setattr(cpu_ops, "_SOURCES", [src / "k.cpp"])
        monkeypatch.setattr(cpu_ops, "_HEADERS", [src / "k.h"])
        dirs.append(cpu_ops._build_dir())
    assert dirs[0] != dirs[1]  # the same bytes in another place
    assert dirs[0] == dirs[2]  # the same place again: the same directory, nothing to rebuild
