"""`fp8serve quantize`: the FP8 checkpoint it writes (tiny Llama and Mixtral)
has AutoFP8's layout, every projection's codes are torch's own e4m3 cast of
weight / (amax / 448), and it loads with no flags into an engine whose logits
match transformers running the dequantized weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

from checkpoints import (
    add_tensors,
    checkpoint_tensor_names,
    hf_logits,
    load_state_dict,
    read_tensor,
    write_tiny_llama,
    write_tiny_mixtral,
)
from kv_scale_checkpoints import copy_checkpoint

from fp8serve import LLM
from fp8serve.entrypoints.cli import main

PROJ = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.w[123])\.weight$")
TOKENS = [5, 17, 200, 33, 90, 411, 7, 8, 250, 3, 60, 61, 62]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    out = {}
    for arch, write in (("llama", write_tiny_llama), ("mixtral", write_tiny_mixtral)):
        src = write(root / arch)
        dst = root / f"{arch}-fp8"
        rc = main(["quantize", str(src), "--out", str(dst), "--kv-cache", "--num-tokens", "200", "--seq-len", "64"])
        assert rc == 0
        out[arch] = (src, dst)
    return out


def test_weights_file_has_the_mode_of_the_other_files(quantized):
    """save_file writes through a private 0600 temporary file; the checkpoint's
    files should all follow the umask (another user serving it must read it)."""
    _, dst = quantized["llama"]
    modes = {f.name: f.stat().st_mode & 0o777 for f in dst.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_layout(quantized, arch):
    src, dst = quantized[arch]
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static",
                                          "ignored_layers": ["lm_head"]}
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    source = load_state_dict(src)
    names = set(checkpoint_tensor_names(dst))
    projections = [n for n in source if PROJ.search(n)]
    assert projections
    for name in source:
        t = read_tensor(dst, name)
        if name in projections:
            w = source[name].float()
            scale = read_tensor(dst, name.removesuffix("weight") + "weight_scale")
            assert t.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
            assert float(scale) == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
            expected = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), name
            inp = read_tensor(dst, name.removesuffix("weight") + "input_scale")
            assert inp.dtype == torch.float32 and float(inp) > 0
        else:  # embeddings, norms, lm_head, the router: untouched
            assert torch.equal(t, source[name]), name
    n = cfg["num_hidden_layers"]
    for i in range(n):
        p = f"model.layers.{i}.self_attn"
        assert {f"{p}.k_scale", f"{p}.v_scale"} <= names
        # q/k/v read the same input, so they share one calibrated input scale
        qkv = {float(read_tensor(dst, f"{p}.{x}_proj.input_scale")) for x in "qkv"}
        assert len(qkv) == 1
    assert not [x for x in names if "block_sparse_moe.gate.weight_scale" in x]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_loads_without_flags_and_matches_dequantized_reference(quantized, arch, tmp_path, capsys):
    src, dst = quantized[arch]
    # reference: the source checkpoint with each projection replaced by codes * scale (float32)
    ref = copy_checkpoint(src, tmp_path / "ref")
    deq = {}
    for name in checkpoint_tensor_names(src):
        if PROJ.search(name):
            codes = read_tensor(dst, name).to(torch.float64)
            deq[name] = (codes * read_tensor(dst, name.removesuffix("weight") + "weight_scale").double()).float()
    add_tensors(ref, deq)
    expected = hf_logits(ref, TOKENS).float()
    llm = LLM(str(dst), dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    got = llm.llm_engine.prompt_logits(TOKENS)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    # ... and close to the 16-bit model: FP8 weights move logits a little, not a lot
    full = hf_logits(src, TOKENS).float()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.05
    # the engine reads the KV scales as checkpoint scales with no flags beyond the dtype
    assert main(["scales", str(dst), "--kv-cache-dtype", "fp8", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert all(entry["source"].startswith("checkpoint:") for entry in layers)


def test_dynamic_scheme_writes_no_input_scale(quantized, tmp_path):
    src, _ = quantized["llama"]
    dst = tmp_path / "dyn"
    assert main(["quantize", str(src), "--out", str(dst), "--activation-scheme", "dynamic"]) == 0
    names = checkpoint_tensor_names(dst)
    assert not [n for n in names if n.endswith(("input_scale", "k_scale", "v_scale"))]
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["activation_scheme"] == "dynamic"
    LLM(str(dst), kv_cache_memory="4MiB", max_model_len=64)


def test_refuses_existing_output_and_quantized_input(quantized, capsys):
    src, dst = quantized["llama"]
    assert main(["quantize", str(src), "--out", str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", str(dst), "--out", str(dst) + "-again"]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_arguments_are_checked_before_any_weight_is_written(quantized, tmp_path, capsys):
    """A missing model or a file as MODEL (tracebacks), an --out under a file (a traceback), and a bad
    --seq-len or too short a text (found after the weights were written, naming a hidden directory)."""
    src, _ = quantized["llama"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    one_char = tmp_path / "one.txt"
    one_char.write_text("h")
    out = tmp_path / "out"
    cases = [
        ([str(tmp_path / "nope"), "--out", str(out)], f"model path '{tmp_path / 'nope'}' does not exist"),
        ([str(a_file), "--out", str(out)], "is not a directory (expected a Hugging Face checkpoint directory)"),
        ([str(tmp_path), "--out", str(out)], "config.json not found"),
        ([str(src), "--out", str(a_file / "q")], f"--out {a_file / 'q'}: {a_file} is a file, not a directory"),
        ([str(src), "--out", str(out), "--seq-len", "1000"], "--seq-len 1000 exceeds the model's "
                                                             "max_position_embeddings (256)"),
        ([str(src), "--out", str(out), "--text", str(one_char)], "shorter than 2 tokens"),
    ]
    for argv, words in cases:
        assert main(["quantize", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and ".weights-only" not in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "one.txt"]
    # Weights only (no calibration): no text is needed, so none is read.
    assert main(["quantize", str(src), "--out", str(out), "--activation-scheme", "dynamic",
                 "--text", str(one_char)]) == 0
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_per_channel_scales_in_compressed_tensors_layout(quantized, arch, tmp_path, capsys):
    """--weight-strategy channel: one float32 scale per output row ([out, 1]), llm-compressor's
    compressed-tensors config (FP8_DYNAMIC), KV scales marked by a kv_cache_scheme; it loads with
    no flags and its logits are transformers' on codes x row scales."""
    src, _ = quantized[arch]
    dst = tmp_path / "channel"
    assert main(["quantize", str(src), "--out", str(dst), "--weight-strategy", "channel", "--activation-scheme",
                 "dynamic", "--kv-cache", "--num-tokens", "200", "--seq-len", "64"]) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["kv_cache_scheme"]["type"] == "float"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    source = load_state_dict(src)
    ref = copy_checkpoint(src, tmp_path / "ref")
    deq = {}
    for name in source:
        t = read_tensor(dst, name)
        if not PROJ.search(name):
            assert torch.equal(t, source[name]), name  # embeddings, norms, lm_head, the router
            continue
        w = source[name].float()
        scale = read_tensor(dst, name.removesuffix("weight") + "weight_scale")
        assert t.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
        torch.testing.assert_close(scale, w.abs().amax(dim=1, keepdim=True) / 448, rtol=1e-6, atol=0)
        expected = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), name
        deq[name] = (t.to(torch.float64) * scale.double()).float()
    add_tensors(ref, deq)
    llm = LLM(str(dst), dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    got = llm.llm_engine.prompt_logits(TOKENS)
    torch.testing.assert_close(got, hf_logits(ref, TOKENS).float(), atol=2e-4, rtol=1e-4)
    full = hf_logits(src, TOKENS).float()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.05
    capsys.readouterr()
    assert main(["scales", str(dst), "--kv-cache-dtype", "fp8", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert all(entry["source"].startswith("checkpoint:") for entry in layers)
