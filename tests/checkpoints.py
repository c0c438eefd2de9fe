"""Tiny, real Hugging Face checkpoints for tests, and transformers reference outputs.

Every factory writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load offline, laid out exactly like checkpoints on the hub:
`config.json`, `generation_config.json`, `model.safetensors` (or `model-0000X-of-0000Y.safetensors`
+ `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json`.

Facts about transformers 5 that shape these helpers (checked against 5.24):
- config.json carries RoPE as one `rope_parameters` dict (`rope_type`, `rope_theta`, plus the scaling
  fields such as llama3's `factor`/`low_freq_factor`/...); the old top-level `rope_theta` and
  `rope_scaling` keys are still accepted on load. `legacy_rope_config` rewrites to the old style.
- In memory, Mixtral experts are fused (`mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first,
  `mlp.experts.down_proj` [E, H, I]); `save_pretrained` converts them back to the original per-expert
  layout (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`). `write_tiny_mixtral` checks that and
  un-fuses itself if a transformers version ever writes the fused names.
"""

import functools
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TOKENIZER_VOCAB_SIZE = 512
# Long enough for chat tests, short enough that position-limit tests are cheap.
TOKENIZER_MAX_LENGTH = 256

# ChatML, as used by SmolLM2-Instruct: a default system turn when the caller gives none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step, and every step along the way teaches the traveller something new.",
    "Once upon a time there was a small village at the edge of a great forest. The people of the "
    "village were farmers and weavers, and in the evenings they told stories by the fire.",
    "Language models predict the next token in a sequence. During inference the engine keeps the "
    "keys and values of earlier tokens in a cache so that each new token costs little work.",
    "Machine learning systems are trained on large amounts of text. They learn patterns of grammar, "
    "facts about the world, and the styles in which people write letters, poems and reports.",
    "What is the capital of France? The capital of France is Paris. What is the capital of Italy? "
    "The capital of Italy is Rome. Berlin is the capital of Germany.",
    "Hello! How are you today? I am fine, thank you for asking. Would you like to hear a story "
    "about a dragon, a knight, and a princess who rescued them both?",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many documents, alongside dates like "
    "January 1st and quantities like 3.14 or 0.5 percent.",
    "The weather was cold and rainy, so we stayed inside, read our books, drank hot tea and "
    "listened to the wind as it blew through the trees outside the window.",
    "Computers store numbers in binary. Floating point formats such as float32, bfloat16 and "
    "float8 trade precision for speed and memory, which matters for large models.",
    "She opened the door, looked around the quiet room and smiled, because everything was exactly "
    "where she had left it the night before.",
]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The corpus is repeated so that merge counts are far apart; a single pass leaves many ties.
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str(pretty=True)


def make_tokenizer(out_dir) -> None:
    """Writes a deterministic byte-level BPE tokenizer (vocab 512, ChatML specials) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "clean_up_tokenization_spaces": False,
        "model_max_length": TOKENIZER_MAX_LENGTH,
        "chat_template": CHATML_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------------------------------------
# Model factories
# ---------------------------------------------------------------------------------------------



def make_bos_tokenizer(directory):
    """The tests' byte-level BPE with a BOS (<|im_start|>, id 1) put before every text it encodes with
    special tokens, loaded with transformers."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    make_tokenizer(directory)
    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(Path(directory) / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _rope_parameters(rope_theta: float, rope_scaling: dict | None) -> dict:
    params = dict(rope_scaling or {})
    # Old configs spell the type "type"; transformers 5 wants "rope_type".
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(rope_theta)
    return params


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrites every parameter from a private generator, independent of transformers' init.

    The default init (std 0.02) gives near-uniform logits, where a wrong weight barely changes the
    output; std 0.1 gives logits with a spread of about one unit. Norm weights are set near 1
    rather than exactly 1 so that loading them into the wrong place is visible.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(std * noise)


def _as_reference(model, dtype: torch.dtype):
    # Same kernels as load_hf_model, so in-memory and reloaded logits agree bit for bit
    # (sdpa and eager attention differ in the last float32 bits).
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.to(dtype).eval()


def _save(model, out_dir: Path, max_shard_size: str | None, with_tokenizer: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    if with_tokenizer:
        make_tokenizer(out_dir)


def _common_config_kwargs(dtype: torch.dtype) -> dict:
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    return dict(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                initializer_range=0.1, dtype=dtype)


def write_tiny_llama(out_dir, *, max_shard_size: str | None = None, with_tokenizer: bool = True,
                     **model_kwargs) -> Path:
    """Writes build_tiny_llama(**model_kwargs) as a checkpoint directory; returns out_dir."""
    model = build_tiny_llama(**model_kwargs)
    out_dir = Path(out_dir)
    _save(model, out_dir, max_shard_size, with_tokenizer)
    return out_dir


def build_tiny_llama(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random LlamaForCausalLM in `dtype`; rope_scaling takes the HF dict, e.g. llama3's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_theta, rope_scaling),
        **_common_config_kwargs(dtype),
    )
    model = LlamaForCausalLM(config)
    _randomize_(model, seed, config.initializer_range)
    return _as_reference(model, dtype)


def write_tiny_mixtral(out_dir, *, max_shard_size: str | None = None, with_tokenizer: bool = True,
                       **model_kwargs) -> Path:
    """Writes build_tiny_mixtral(**model_kwargs) in the original per-expert on-disk layout."""
    model = build_tiny_mixtral(**model_kwargs)
    out_dir = Path(out_dir)
    _save(model, out_dir, max_shard_size, with_tokenizer)
    fused = [name for name in checkpoint_tensor_names(out_dir)
             if name.endswith((".experts.gate_up_proj", ".experts.down_proj", ".mlp.gate.weight"))]
    if fused:
        tensors = {name: read_tensor(out_dir, name) for name in fused}
        remove_tensors(out_dir, fused)
        add_tensors(out_dir, unfuse_mixtral_experts(tensors))
    return out_dir


def build_tiny_mixtral(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    num_local_experts: int = 4,
    num_experts_per_tok: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    rope_theta: float = 1e6,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random MixtralForCausalLM in `dtype` (experts fused in memory, as transformers 5 has them)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_theta, None),
        **_common_config_kwargs(dtype),
    )
    model = MixtralForCausalLM(config)
    _randomize_(model, seed, config.initializer_range)
    return _as_reference(model, dtype)


def unfuse_mixtral_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps transformers 5's fused expert tensors to the original Mixtral names.

    `{p}.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) becomes
    `{p}.block_sparse_moe.experts.{e}.w1.weight` (gate) and `.w3.weight` (up), each [I, H];
    `{p}.mlp.experts.down_proj` [E, H, I] becomes `.w2.weight` [H, I]. Other names pass through,
    with `.mlp.gate.` renamed to `.block_sparse_moe.gate.`.
    """
    out = {}
    for name, tensor in tensors.items():
        prefix = name.rsplit(".experts.", 1)[0].replace(".mlp", ".block_sparse_moe")
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.w1.weight"] = gate[e].contiguous()
                out[f"{prefix}.experts.{e}.w3.weight"] = up[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.w2.weight"] = tensor[e].contiguous()
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = tensor
    return out


def make_bin_only_checkpoint(out_dir, *, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A tiny llama whose weights are only in pytorch_model.bin (torch.save): no safetensors."""
    model = build_tiny_llama(seed=seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
    if with_tokenizer:
        make_tokenizer(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Editing config.json
# ---------------------------------------------------------------------------------------------

DELETE = object()
"""Pass as a value to rewrite_config to remove that key."""


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def rewrite_config(model_dir, **changes) -> dict:
    """Updates config.json with `changes` (a value of DELETE removes the key); returns the result."""
    config = read_config(model_dir)
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    _write_json(Path(model_dir) / "config.json", config)
    return config


def legacy_rope_config(model_dir) -> dict:
    """Rewrites RoPE as top-level `rope_theta` (+ `rope_scaling` unless default), pre-5 style."""
    config = read_config(model_dir)
    params = dict(config.pop("rope_parameters", None) or {})
    if "rope_theta" in params:
        config["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        config["rope_scaling"] = params
    _write_json(Path(model_dir) / "config.json", config)
    return config


def modern_rope_config(model_dir) -> dict:
    """Rewrites RoPE as one `rope_parameters` dict, the way transformers 5 saves it."""
    config = read_config(model_dir)
    rope_theta = config.pop("rope_theta", None)
    rope_scaling = config.pop("rope_scaling", None)
    if rope_theta is not None or rope_scaling is not None:
        params = dict(config.get("rope_parameters") or {})
        params.update(_rope_parameters(rope_theta if rope_theta is not None
                                       else params.get("rope_theta", 10000.0), rope_scaling))
        config["rope_parameters"] = params
    _write_json(Path(model_dir) / "config.json", config)
    return config


def set_quantization_config(model_dir, cfg: dict | None) -> dict:
    """Sets (or, with None, removes) config.json's `quantization_config`."""
    return rewrite_config(model_dir, quantization_config=DELETE if cfg is None else cfg)


# ---------------------------------------------------------------------------------------------
# Editing safetensors
# ---------------------------------------------------------------------------------------------


def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    """Tensor name -> shard file name, or None for a single-file checkpoint."""
    index_path = Path(model_dir) / SAFETENSORS_INDEX
    if not index_path.exists():
        return None
    return json.loads(index_path.read_text())["weight_map"]


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def _write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None):
    metadata = dict(metadata or {})
    metadata.setdefault("format", "pt")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)


def _write_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    """Rewrites the index for `weight_map`, recomputing the sizes transformers records."""
    index_path = Path(model_dir) / SAFETENSORS_INDEX
    metadata = json.loads(index_path.read_text()).get("metadata", {}) if index_path.exists() else {}
    total_size = total_parameters = 0
    for file_name in sorted(set(weight_map.values())):
        # Tiny checkpoints: reading each tensor is cheaper than mapping dtype names to sizes.
        for tensor in _read_file(Path(model_dir) / file_name)[0].values():
            total_size += tensor.nbytes
            total_parameters += tensor.numel()
    metadata["total_size"] = total_size
    if "total_parameters" in metadata:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(index_path, index)


def checkpoint_tensor_names(model_dir) -> list[str]:
    """Every tensor name stored in the directory's safetensors files, sorted."""
    names = []
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def read_tensor(model_dir, name: str) -> torch.Tensor:
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(f"{name!r} is not in {model_dir}")


def load_state_dict(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in _safetensors_files(Path(model_dir)):
        tensors.update(_read_file(path)[0])
    return tensors


def add_tensors(model_dir, tensors: dict[str, torch.Tensor]) -> None:
    """Adds (or replaces) tensors, keeping the shard index consistent.

    A replaced tensor stays in its shard; new tensors go into the last shard, the way an
    exporter that appends scales after the weights would write them.
    """
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    if weight_map is None:
        path = model_dir / SAFETENSORS_SINGLE
        existing, metadata = _read_file(path)
        existing.update(tensors)
        _write_file(path, existing, metadata)
        return
    last_shard = max(weight_map.values())
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        file_name = weight_map.setdefault(name, last_shard)
        by_file.setdefault(file_name, {})[name] = tensor
    for file_name, new in by_file.items():
        existing, metadata = _read_file(model_dir / file_name)
        existing.update(new)
        _write_file(model_dir / file_name, existing, metadata)
    _write_index(model_dir, weight_map)


def remove_tensors(model_dir, names) -> None:
    """Removes tensors (KeyError if one is absent); a shard left empty is deleted."""
    model_dir = Path(model_dir)
    names = set(names)
    weight_map = _weight_map(model_dir)
    if weight_map is None:
        files = {SAFETENSORS_SINGLE: names}
    else:
        files = {}
        for name in names:
            if name not in weight_map:
                raise KeyError(f"{name!r} is not in {model_dir}")
            files.setdefault(weight_map.pop(name), set()).add(name)
    for file_name, drop in files.items():
        existing, metadata = _read_file(model_dir / file_name)
        missing = drop - existing.keys()
        if missing:
            raise KeyError(f"{sorted(missing)} not in {model_dir / file_name}")
        kept = {name: t for name, t in existing.items() if name not in drop}
        if kept or weight_map is None:
            _write_file(model_dir / file_name, kept, metadata)
        else:
            (model_dir / file_name).unlink()
    if weight_map is not None:
        _write_index(model_dir, weight_map)


# ---------------------------------------------------------------------------------------------
# transformers references
# ---------------------------------------------------------------------------------------------


def load_hf_model(model_dir, dtype: torch.dtype = torch.float64):
    """The checkpoint in transformers with eager attention and eager experts, offline, eval mode."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The default MoE path (torch grouped_mm) rejects float64; the eager loop over experts is
    # also the plainest reference.
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager", experts_implementation="eager",
        local_files_only=True)
    return model.eval()


@torch.no_grad()
def hf_logits(model_dir, input_ids: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Reference logits for every position of one sequence. # [len(input_ids), vocab_size]"""
    model = load_hf_model(model_dir, dtype)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0]


@torch.no_grad()
def hf_greedy(model_dir, input_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False,
              dtype: torch.dtype = torch.float64) -> list[int]:
    """Greedy continuation by full re-forward each step (no KV cache, so nothing to get wrong).

    Returns only the new tokens; an EOS token ends generation and is included, unless ignore_eos.
    """
    model = load_hf_model(model_dir, dtype)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids])
    ids = list(input_ids)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        token = int(torch.argmax(logits))
        ids.append(token)
        new_ids.append(token)
        if token in eos_ids and not ignore_eos:
            break
    return new_ids


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
