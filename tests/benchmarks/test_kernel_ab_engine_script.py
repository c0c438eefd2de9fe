"""benchmarks/kernel_ab_engine.py on a tiny bf16 checkpoint: the baseline engine
really runs the baseline build's op (counted in its recorded decode forward),
both engines are timed and give the same tokens, --aa adds an engine on this
tree's source built alone, and bad arguments are rejected before anything is
built."""

from __future__ import annotations

import re

import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama
from fp8serve.kernels import gemv_packing


def test_both_engines_are_timed_with_the_op_swapped(ops, monkeypatch, tmp_path):
    # bf16 weights: under float32 compute the engine keeps them and runs dense_gemv on them at batch 1.
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    text, rows = run_table(monkeypatch, tmp_path, "kernel_ab_engine.py", "--model", str(src),
                           "--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD",
                           "--tokens", "6", "--rounds", "2", "--kv-cache-memory", "16MiB", header="| engine")
    assert [r[0] for r in rows] == ["this tree", "HEAD"]
    assert all(float(r[1]) > 0 for r in rows)
    assert rows[1][3] == "True"  # the same kernel source at HEAD: the same tokens
    assert "A/A" not in text  # no --aa, no third engine
    swapped = int(re.search(r"calls (\d+) fp8serve_base_engine ops", text).group(1))
    assert swapped >= 2 * 4  # every decoder linear of both layers
    assert re.search(r"speedup \(baseline / this tree\): \d+\.\d+x", text)


def test_long_prompts_and_an_fp8_cache(ops, monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    text, rows = run_table(monkeypatch, tmp_path, "kernel_ab_engine.py", "--model", str(src),
                           "--source", "paged_attention.cpp", "--op", "paged_attention_decode_fused",
                           "--baseline-rev", "HEAD", "--kv-cache-dtype", "fp8", "--prompt-len", "40",
                           "--tokens", "6", "--rounds", "2", "--kv-cache-memory", "16MiB", header="| engine")
    assert rows[1][3] == "True"
    assert "KV cache fp8" in text and "prompts of 40 tokens" in text
    assert int(re.search(r"calls (\d+) fp8serve_base_engine ops", text).group(1)) >= 2  # one per layer


def test_prefill_steps_run_the_baseline_op(ops, monkeypatch, tmp_path):
    # No packed bf16 copies: with them (AMD CPUs without AVX-512) the gate_up projections of 12 or
    # more rows take bf16_tiled_gemm's gated form, and silu_and_mul runs only in the pruned last layer.
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "0")
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    text, rows = run_table(monkeypatch, tmp_path, "kernel_ab_engine.py", "--model", str(src),
                           "--source", "layer_ops.cpp", "--op", "silu_and_mul", "--baseline-rev", "HEAD",
                           "--phase", "prefill", "--prompt-len", "40", "--batch", "2", "--prefills", "2",
                           "--rounds", "2", "--kv-cache-memory", "16MiB", "--dtype", "float32", header="| engine")
    assert [r[0] for r in rows] == ["this tree", "HEAD"]
    assert all(float(r[1]) > 0 for r in rows)
    assert rows[1][3] == "True"  # the same kernel source at HEAD: the same first tokens
    assert "--dtype float32" in text
    assert "in engine prefill steps" in text and "| ms / prefill step (median) |" in text
    # 2 rounds x 2 timed prefills x 2 decoder layers, one MLP activation each.
    assert int(re.search(r"looked up its silu_and_mul (\d+) times", text).group(1)) == 2 * 2 * 2


def test_aa_adds_this_trees_source_built_alone(ops, monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    text, rows = run_table(monkeypatch, tmp_path, "kernel_ab_engine.py", "--model", str(src),
                           "--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--aa",
                           "--tokens", "6", "--rounds", "3", "--kv-cache-memory", "16MiB", header="| engine")
    assert [r[0] for r in rows] == ["this tree", "HEAD", "this tree, built alone"]
    assert all(float(r[1]) > 0 for r in rows)
    assert [r[3] for r in rows[1:]] == ["True", "True"]  # one source on every side: one set of tokens
    assert [r[2].split(" (than ")[1] for r in rows] == ["HEAD)", "this tree)", "this tree)"]
    # The built-alone engine's recorded forward calls its own build's op, as the baseline's does.
    assert int(re.search(r"the built-alone engine's (\d+) fp8serve_alone_engine ops", text).group(1)) >= 2 * 4
    assert int(re.search(r"calls (\d+) fp8serve_base_engine ops", text).group(1)) >= 2 * 4
    step = {r[0]: float(r[1]) for r in rows}
    aa = float(re.search(r"A/A \(this tree's source built alone / this tree, the same code\): (\d+\.\d+)x",
                         text).group(1))
    assert aa == pytest.approx(step["this tree, built alone"] / step["this tree"], abs=0.01)
    like = float(re.search(r"like for like \(baseline / this tree's source built alone, both built alone\): "
                           r"(\d+\.\d+)x", text).group(1))
    assert like == pytest.approx(step["HEAD"] / step["this tree, built alone"], abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--rounds", "0"], "--rounds"),
    (["--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--batch", "-1"], "--batch"),
    (["--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--kv-cache-memory", "lots"],
     "--kv-cache-memory"),
    (["--source", "dense_gemv.cpp", "--baseline-rev", "HEAD"], "--op"),
    (["--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--prompt-len", "-3"],
     "--prompt-len"),
    (["--source", "dense_gemv.cpp", "--op", "dense_gemv", "--baseline-rev", "HEAD", "--kv-cache-dtype", "int4"],
     "--kv-cache-dtype"),
    (["--source", "layer_ops.cpp", "--op", "silu_and_mul", "--baseline-rev", "HEAD", "--phase", "prefill"],
     "--phase prefill needs --prompt-len"),
    (["--source", "layer_ops.cpp", "--op", "silu_and_mul", "--baseline-rev", "HEAD", "--prefills", "0"],
     "--prefills"),
    (["--source", "layer_ops.cpp", "--op", "silu_and_mul", "--baseline-rev", "HEAD", "--dtype", "fp4"], "--dtype"),
    (["--source", "paged_attention.cpp", "--op", "paged_attention_decode_fused", "--baseline-rev", "HEAD",
      "--kv-cache-layout", "THD"], "--kv-cache-layout"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "kernel_ab_engine.py", argv, message)


def test_an_op_this_build_lacks_is_an_error(ops, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="--op no_such_op: no such op in torch.ops.fp8serve"):
        run_table(monkeypatch, tmp_path, "kernel_ab_engine.py", "--source", "dense_gemv.cpp", "--op", "no_such_op",
                  "--baseline-rev", "HEAD", header="|")
