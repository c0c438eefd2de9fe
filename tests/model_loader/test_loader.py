"""Loading a checkpoint that is damaged or incomplete fails with one line that
names the file and the tensor, never with a traceback or with a model that
silently runs on leftover memory."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import write_tiny_llama
from fp8serve.entrypoints.llm import LLM
from fp8serve.errors import ConfigError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("loader") / "llama")


@pytest.fixture
def copy_dir(llama_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(llama_dir, d)
    return d


def _load(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)


def _edit_tensors(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
def test_a_missing_part_of_a_fused_parameter_is_named(copy_dir, name):
    """q/k/v and gate/up land in one fused parameter each: losing one of them
    must not leave its rows as allocated while the others load."""
    _edit_tensors(copy_dir, lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=f"checkpoint is missing tensors for {name}"):
        _load(copy_dir)


def test_a_wrongly_shaped_shard_names_the_file_and_the_checkpoint_tensor(copy_dir):
    name = "model.layers.1.self_attn.q_proj.weight"
    _edit_tensors(copy_dir, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(ConfigError) as e:
        _load(copy_dir)
    msg = str(e.value)
    assert str(copy_dir / "model.safetensors") in msg and f"tensor '{name}'" in msg and "has shape" in msg


def test_an_integer_tensor_is_refused(copy_dir):
    name = "model.layers.0.mlp.down_proj.weight"
    _edit_tensors(copy_dir, lambda t: t.update({name: torch.ones_like(t[name], dtype=torch.int32)}))
    with pytest.raises(ConfigError, match=f"tensor '{name}' has dtype torch.int32; expected a floating-point"):
        _load(copy_dir)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_safetensors_file_is_named(copy_dir, damage):
    path = copy_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "garbage": bytes(range(256)) * 8}[damage])
    with pytest.raises(ConfigError, match=f"{path}: not a readable safetensors file"):
        _load(copy_dir)


def test_the_intact_copy_loads(copy_dir):
    """The edits above are what fails, not the copy."""
    assert _load(copy_dir).generate("hi", use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("weight_map, words", [
    ('["model.safetensors"]', "'weight_map' must be an object of tensor name -> file name, got list"),
    ('{"a": 5}', "'weight_map' must be an object of tensor name -> file name, got dict"),
    ('{"a": "model-00009.safetensors"}', "lists shard(s) that do not exist"),
])
def test_a_broken_index_is_named(copy_dir, weight_map, words):
    """A weight_map that is a list was an AttributeError traceback (found by probing)."""
    (copy_dir / "model.safetensors.index.json").write_text(f'{{"metadata": {{}}, "weight_map": {weight_map}}}')
    with pytest.raises(ConfigError, match="model.safetensors.index.json") as info:
        _load(copy_dir)
    assert words in str(info.value)
