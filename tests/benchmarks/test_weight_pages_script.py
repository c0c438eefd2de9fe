"""benchmarks/weight_pages.py: bad values refused naming the flag; the smaps reading on a made-up
file; the before-the-arena copies hold the same bits in buffers of their own; and a small run on
the default model (where this machine packs weights) with both tables filled and the same tokens."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import assert_rejected, loaded_script, run_table
from fp8serve.kernels import cpu_ops, gemv_packing


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--batch-sizes", "4,0"], "--batch-sizes: expected sizes >= 1, got '4,0'"),
])
def test_bad_values_are_refused(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "weight_pages.py", argv, message)


def test_huge_page_bytes_reads_the_mappings_holding_the_tensors(tmp_path):
    a, b = torch.empty(1000, dtype=torch.uint8), torch.empty(10, dtype=torch.float32)
    pa, pb = a.data_ptr(), b.data_ptr()
    smaps = tmp_path / "smaps"
    # a's mapping (2048 kB huge), b's (none) and one holding neither (4096 kB huge, not counted).
    smaps.write_text(
        f"{pa - 4096:x}-{pa + 8192:x} rw-p 00000000 00:00 0\nRss:  12 kB\nAnonHugePages:   2048 kB\n"
        f"{pb - 64:x}-{pb + 4096:x} rw-p 00000000 00:00 0\nRss:  4 kB\nAnonHugePages:      0 kB\n"
        f"1000-2000 rw-p 00000000 00:00 0\nAnonHugePages:   4096 kB\n")
    with loaded_script("weight_pages.py") as script:
        assert script.huge_page_bytes([a, b], str(smaps)) == (1040, 2048 * 1024)
        assert script.huge_page_bytes([b], str(smaps)) == (40, 0)
        assert script.huge_page_bytes([a, a], str(smaps)) == (2000, 2048 * 1024)  # one mapping counted once


def test_copies_one_buffer_each_keep_the_bits(seed):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(3, 5, 16, 2, generator=g).bfloat16(), torch.randint(0, 255, (2, 4, 64), generator=g,
                                                                          dtype=torch.uint8)]
    with loaded_script("weight_pages.py") as script:
        copies = script.copies_one_buffer_each(ts)
    for t, c in zip(ts, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert copies[0].untyped_storage().data_ptr() != copies[1].untyped_storage().data_ptr()


SMALL = ["--batch-sizes", "13", "--tokens", "2", "--rounds", "2", "--kv-cache-memory", "128MiB"]


def test_nothing_to_compare_is_a_clear_exit(monkeypatch, tmp_path):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "0")
    monkeypatch.setenv("FP8SERVE_SCREENED_ARGMAX", "0")
    with pytest.raises(SystemExit, match="made no packed weight copies and no greedy screen"):
        run_table(monkeypatch, tmp_path, "weight_pages.py", *SMALL, header="|")


@pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="no C++ kernels: no packed copies, no greedy screen")
def test_small_run(monkeypatch, tmp_path):
    text, _ = run_table(monkeypatch, tmp_path, "weight_pages.py", *SMALL, header="|")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| ")]
    pages = {r[0]: r for r in rows if r[0] in ("arenas (the engine's)", "one buffer each (before)")}
    assert len(pages) == 2
    assert pages["arenas (the engine's)"][1] == pages["one buffer each (before)"][1]  # the same bytes
    assert float(pages["arenas (the engine's)"][1]) > 0
    (timed,) = [r for r in rows if r[0] == "13"]
    assert float(timed[1]) > 0 and float(timed[2]) > 0 and timed[3].endswith("x")
    assert timed[4] in ("0 of 2", "1 of 2", "2 of 2") and timed[5] == "True"
