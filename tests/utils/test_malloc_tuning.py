"""malloc_tuning: glibc's mmap and trim thresholds fixed once per process,
skipped where asked (FP8SERVE_MALLOC_TUNING=0) or where the C library is not
glibc, a warning where glibc refuses, a clear error for a bad switch value;
and the CPU engine applies it."""

from __future__ import annotations

import logging

import pytest

from fp8serve.errors import ConfigError
from fp8serve.utils import malloc_tuning


class FakeLibc:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accept else 0

    def gnu_get_libc_version(self) -> bytes:
        return b"2.99"


@pytest.fixture
def fresh(monkeypatch):
    """A process in which the thresholds were never set, with a fake glibc."""
    monkeypatch.setattr(malloc_tuning, "_applied", False)
    monkeypatch.delenv("FP8SERVE_MALLOC_TUNING", raising=False)
    libc = FakeLibc()
    monkeypatch.setattr(malloc_tuning, "_glibc", lambda: libc)
    return libc


def test_sets_both_thresholds_once(fresh):
    assert malloc_tuning.tune_malloc() is True
    assert fresh.calls == [(-3, 32 << 20), (-1, 256 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert malloc_tuning.tune_malloc() is True
    assert len(fresh.calls) == 2, "applied twice"


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_switched_off_leaves_glibc_alone(fresh, monkeypatch, value):
    monkeypatch.setenv("FP8SERVE_MALLOC_TUNING", value)
    assert malloc_tuning.tune_malloc() is False
    assert fresh.calls == []


def test_bad_switch_value_names_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("FP8SERVE_MALLOC_TUNING", "maybe")
    with pytest.raises(ConfigError, match="FP8SERVE_MALLOC_TUNING='maybe': expected auto, 1 or 0"):
        malloc_tuning.tune_malloc()


def test_not_glibc_does_nothing(fresh, monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_glibc", lambda: None)
    assert malloc_tuning.tune_malloc() is False


def test_refused_thresholds_warn(fresh, caplog):
    fresh.accept = False
    with caplog.at_level(logging.WARNING, logger="fp8serve.utils.malloc_tuning"):
        assert malloc_tuning.tune_malloc() is False
    assert "glibc 2.99 refused the malloc thresholds" in caplog.text
    assert malloc_tuning._applied is False


def test_this_machines_glibc_takes_them(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_applied", False)
    monkeypatch.delenv("FP8SERVE_MALLOC_TUNING", raising=False)
    if malloc_tuning._glibc() is None:
        pytest.skip("the C library here is not glibc")
    assert malloc_tuning.tune_malloc() is True


def test_the_cpu_engine_applies_it(fresh, tmp_path):
    from checkpoints import write_tiny_llama

    from fp8serve.engine.llm_engine import LLMEngine

    LLMEngine.from_args(str(write_tiny_llama(tmp_path / "tiny")), dtype="float32", device="cpu",
                        kv_cache_memory=1 << 20, max_model_len=64)
    assert fresh.calls == [(-3, 32 << 20), (-1, 256 << 20)]
