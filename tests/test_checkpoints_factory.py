"""The tiny-checkpoint factories write what transformers itself loads, bit for bit."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import (
    DELETE,
    SAFETENSORS_INDEX,
    add_tensors,
    build_tiny_llama,
    build_tiny_mixtral,
    checkpoint_tensor_names,
    hf_greedy,
    hf_logits,
    legacy_rope_config,
    load_state_dict,
    make_bin_only_checkpoint,
    make_tokenizer,
    modern_rope_config,
    read_config,
    read_tensor,
    remove_tensors,
    rewrite_config,
    set_quantization_config,
    unfuse_mixtral_experts,
    write_tiny_llama,
    write_tiny_mixtral,
)
from safetensors.torch import load_file
from transformers import AutoTokenizer

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPT_IDS = [1, 17, 300, 42, 5, 77, 401, 2, 250, 9, 511, 3]


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _in_memory_logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([input_ids]), use_cache=False).logits[0]


def _index(model_dir) -> dict:
    return json.loads((model_dir / SAFETENSORS_INDEX).read_text())


def _assert_index_consistent(model_dir) -> None:
    index = _index(model_dir)
    on_disk = {}
    total_size = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            on_disk[name] = path.name
            total_size += tensor.nbytes
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == total_size
    assert index["metadata"]["total_parameters"] == sum(
        t.numel() for p in model_dir.glob("*.safetensors") for t in load_file(str(p)).values())


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    make_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = "Hello world! The capital of France is Paris. Émigré naïve 3.14 — ok?"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 512
    assert len(ids) < len(text.encode())  # merges were learned
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml(tmp_path):
    make_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    assert ids[0] == 1 and ids == tokenizer(text)["input_ids"]


def test_tokenizer_is_byte_identical_across_processes(tmp_path):
    make_tokenizer(tmp_path / "here")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from checkpoints import make_tokenizer; "
              "make_tokenizer(sys.argv[2])")
    tests_dir = str(Path(__file__).parent)
    subprocess.run([sys.executable, "-c", script, tests_dir, str(tmp_path / "there")], check=True)
    assert _digest(tmp_path / "here") == _digest(tmp_path / "there")


# --- llama --------------------------------------------------------------------------------------


def test_llama_writes_hf_layout_and_loads_back_identically(tmp_path):
    write_tiny_llama(tmp_path)
    names = checkpoint_tensor_names(tmp_path)
    assert [n for n in names if n.startswith("model.layers.0.")] == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= set(names)
    assert read_tensor(tmp_path, "model.layers.0.self_attn.k_proj.weight").shape == (32, 64)

    expected = _in_memory_logits(build_tiny_llama(), PROMPT_IDS)
    actual = hf_logits(tmp_path, PROMPT_IDS, dtype=torch.float32)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert expected.std() > 0.3  # logits that actually depend on the weights


def test_llama_is_deterministic_and_seed_dependent(tmp_path):
    write_tiny_llama(tmp_path / "a")
    write_tiny_llama(tmp_path / "b")
    write_tiny_llama(tmp_path / "c", seed=1)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a")["model.safetensors"] != _digest(tmp_path / "c")["model.safetensors"]


def test_llama_tied_embeddings_drop_lm_head(tmp_path):
    write_tiny_llama(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in checkpoint_tensor_names(tmp_path)
    assert read_config(tmp_path)["tie_word_embeddings"] is True
    hf_logits(tmp_path, PROMPT_IDS)  # loads without missing-weight complaints about lm_head


def test_llama_bf16(tmp_path):
    write_tiny_llama(tmp_path, dtype=torch.bfloat16)
    assert read_tensor(tmp_path, "model.embed_tokens.weight").dtype == torch.bfloat16
    assert read_config(tmp_path)["dtype"] == "bfloat16"


def test_sharding_writes_an_index(tmp_path):
    write_tiny_llama(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    _assert_index_consistent(tmp_path)
    torch.testing.assert_close(hf_logits(tmp_path, PROMPT_IDS, dtype=torch.float32),
                               _in_memory_logits(build_tiny_llama(), PROMPT_IDS), rtol=0, atol=0)


def test_llama3_rope_scaling_new_and_legacy_config(tmp_path):
    write_tiny_llama(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    config = read_config(tmp_path)
    assert "rope_theta" not in config and "rope_scaling" not in config
    assert config["rope_parameters"] == {**LLAMA3_SCALING, "rope_theta": 500000.0}
    long_ids = [(7 * i) % 509 + 3 for i in range(200)]  # past original_max_position_embeddings
    modern = hf_logits(tmp_path, long_ids)

    legacy = legacy_rope_config(tmp_path)
    assert "rope_parameters" not in legacy
    assert legacy["rope_theta"] == 500000.0 and legacy["rope_scaling"] == LLAMA3_SCALING
    torch.testing.assert_close(hf_logits(tmp_path, long_ids), modern, rtol=0, atol=0)

    # The scaling really is applied: dropping it changes the logits at long positions.
    rewrite_config(tmp_path, rope_scaling=DELETE)
    assert not torch.allclose(hf_logits(tmp_path, long_ids), modern)

    rewrite_config(tmp_path, rope_scaling=LLAMA3_SCALING)
    assert modern_rope_config(tmp_path)["rope_parameters"] == config["rope_parameters"]


def test_legacy_rope_config_default_rope(tmp_path):
    write_tiny_llama(tmp_path)
    assert read_config(tmp_path)["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    expected = hf_logits(tmp_path, PROMPT_IDS)
    legacy = legacy_rope_config(tmp_path)
    assert legacy["rope_theta"] == 10000.0 and "rope_scaling" not in legacy
    torch.testing.assert_close(hf_logits(tmp_path, PROMPT_IDS), expected, rtol=0, atol=0)


def test_hf_greedy_matches_logits_argmax(tmp_path):
    write_tiny_llama(tmp_path)
    new_ids = hf_greedy(tmp_path, PROMPT_IDS, max_new_tokens=5, ignore_eos=True)
    assert len(new_ids) == 5
    logits = hf_logits(tmp_path, PROMPT_IDS + new_ids[:-1])
    assert logits[len(PROMPT_IDS) - 1:].argmax(dim=-1).tolist() == new_ids


# --- mixtral ------------------------------------------------------------------------------------


def test_mixtral_writes_per_expert_layout_and_loads_back_identically(tmp_path):
    write_tiny_mixtral(tmp_path)
    layer0 = [n for n in checkpoint_tensor_names(tmp_path) if n.startswith("model.layers.0.")]
    experts = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
               for e in range(4) for w in ("w1", "w2", "w3")]
    assert layer0 == experts + [
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert read_tensor(tmp_path, experts[0]).shape == (96, 64)  # w1: [intermediate, hidden]
    assert read_tensor(tmp_path, experts[1]).shape == (64, 96)  # w2: [hidden, intermediate]

    expected = _in_memory_logits(build_tiny_mixtral(), PROMPT_IDS)
    torch.testing.assert_close(hf_logits(tmp_path, PROMPT_IDS, dtype=torch.float32), expected,
                               rtol=0, atol=0)
    assert expected.std() > 0.3


def test_unfuse_matches_transformers_on_disk_layout(tmp_path):
    write_tiny_mixtral(tmp_path)
    in_memory = build_tiny_mixtral().state_dict()
    unfused = unfuse_mixtral_experts(in_memory)
    on_disk = load_state_dict(tmp_path)
    assert unfused.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(unfused[name], tensor), name


# --- editing checkpoints ------------------------------------------------------------------------


def test_add_and_remove_tensors_single_file(tmp_path):
    write_tiny_llama(tmp_path)
    scale = torch.tensor(0.5)
    fp8 = torch.ones(4, 4).to(torch.float8_e4m3fn)
    add_tensors(tmp_path, {"model.layers.0.self_attn.k_scale": scale, "extra.fp8": fp8})
    assert torch.equal(read_tensor(tmp_path, "model.layers.0.self_attn.k_scale"), scale)
    assert read_tensor(tmp_path, "extra.fp8").dtype == torch.float8_e4m3fn
    remove_tensors(tmp_path, ["extra.fp8", "model.layers.0.self_attn.k_scale"])
    assert checkpoint_tensor_names(tmp_path) == sorted(build_tiny_llama().state_dict())
    with pytest.raises(KeyError):
        remove_tensors(tmp_path, ["no.such.tensor"])


def test_add_and_remove_tensors_keep_index_consistent(tmp_path):
    write_tiny_llama(tmp_path, max_shard_size="100KB")
    first_shard = _index(tmp_path)["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    new_q = torch.zeros(64, 64)
    add_tensors(tmp_path, {"model.layers.0.self_attn.q_proj.weight": new_q,
                           "model.layers.0.self_attn.kv_scale": torch.tensor(2.0)})
    _assert_index_consistent(tmp_path)
    weight_map = _index(tmp_path)["weight_map"]
    assert weight_map["model.layers.0.self_attn.q_proj.weight"] == first_shard  # replaced in place
    assert "model.layers.0.self_attn.kv_scale" in weight_map
    assert torch.equal(read_tensor(tmp_path, "model.layers.0.self_attn.q_proj.weight"), new_q)

    # Removing every tensor of a shard deletes the shard file.
    lonely = [n for n, f in weight_map.items() if f == first_shard]
    remove_tensors(tmp_path, lonely + ["model.layers.0.self_attn.kv_scale"])
    _assert_index_consistent(tmp_path)
    assert not (tmp_path / first_shard).exists()
    assert not set(lonely) & set(checkpoint_tensor_names(tmp_path))


def test_config_edits(tmp_path):
    write_tiny_llama(tmp_path)
    cfg = {"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "fp8"}
    assert set_quantization_config(tmp_path, cfg)["quantization_config"] == cfg
    assert read_config(tmp_path)["quantization_config"] == cfg
    assert "quantization_config" not in set_quantization_config(tmp_path, None)
    config = rewrite_config(tmp_path, max_position_embeddings=128, head_dim=DELETE)
    assert config["max_position_embeddings"] == 128 and "head_dim" not in config
    assert read_config(tmp_path) == config


def test_bin_only_checkpoint(tmp_path):
    make_bin_only_checkpoint(tmp_path)
    assert (tmp_path / "pytorch_model.bin").exists() and (tmp_path / "config.json").exists()
    assert not list(tmp_path.glob("*.safetensors"))
    state_dict = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert "model.layers.0.self_attn.q_proj.weight" in state_dict
