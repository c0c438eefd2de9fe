"""Typed engine configuration, validated once at construction.

`ModelConfig` reads a Hugging Face `config.json` itself (not through
transformers' AutoConfig) so that a missing or wrong field produces an error
naming the file and the field, and so that both RoPE spellings are accepted:
transformers 5 writes `rope_parameters`, older checkpoints `rope_theta` and
`rope_scaling`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8serve.errors import ConfigError
from fp8serve.utils.memory import format_bytes, parse_size
from fp8serve.utils import platform

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# vLLM's --dtype values (half = float16, float = float32).
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# `auto` means "the compute dtype"; `fp8` is an alias of `fp8_e4m3` (seed PR).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM")


def _require(cfg: dict, key: str, path: Path, kind: type | tuple[type, ...] = int) -> Any:
    if key not in cfg:
        raise ConfigError(f"{path}: required field '{key}' is missing")
    value = cfg[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{path}: field '{key}' must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _positive_int(cfg: dict, key: str, path: Path, default: int | None = None) -> int:
    """An integer field >= 1; `default` when absent (None: required)."""
    if cfg.get(key) is None and default is not None:
        return default
    value = _require(cfg, key, path)
    if value < 1:
        raise ConfigError(f"{path}: field '{key}' must be an integer >= 1, got {value!r}")
    return value


def _positive_float(cfg: dict, key: str, path: Path, default: float, where: str = "") -> float:
    """A finite number > 0 (ints allowed); `default` when absent."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{path}: field '{where}{key}' must be a finite number > 0, got {value!r}")
    return float(value)


# HF's names of the activation Llama and Mixtral use; no other is built.
_SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" | "linear" | "llama3"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict, path: Path) -> "RopeConfig":
        params = cfg.get("rope_parameters")
        if params is None:
            scaling = cfg.get("rope_scaling") or {}
            if not isinstance(scaling, dict):
                raise ConfigError(f"{path}: field 'rope_scaling' must be an object, got {scaling!r}")
            params = dict(scaling)
            params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"{path}: rope type '{rope_type}' is not supported (supported: default, linear, llama3)"
            )
        if not isinstance(params, dict):
            raise ConfigError(f"{path}: field 'rope_parameters' must be an object, got {params!r}")
        where = "rope_parameters." if cfg.get("rope_parameters") is not None else "rope_scaling."
        theta = _positive_float(params, "rope_theta", path, _positive_float(cfg, "rope_theta", path, 10000.0), where)
        original = params.get("original_max_position_embeddings")
        if original is not None:
            original = _positive_int(params, "original_max_position_embeddings", path)
        rope = cls(
            rope_type=rope_type,
            theta=theta,
            factor=_positive_float(params, "factor", path, 1.0, where),
            low_freq_factor=_positive_float(params, "low_freq_factor", path, 1.0, where),
            high_freq_factor=_positive_float(params, "high_freq_factor", path, 4.0, where),
            original_max_position_embeddings=original,
        )
        if rope_type == "llama3" and rope.original_max_position_embeddings is None:
            raise ConfigError(f"{path}: llama3 rope scaling needs 'original_max_position_embeddings'")
        return rope


@dataclass(frozen=True)
class ModelArchConfig:
    """The numbers a decoder-only Llama/Mixtral model is built from."""

    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    quantization_config: dict | None = None
    checkpoint_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def from_dict(cls, cfg: dict, path: Path) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{path}: architecture {archs or '(none)'} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = _positive_int(cfg, "hidden_size", path)
        heads = _positive_int(cfg, "num_attention_heads", path)
        kv_heads = _positive_int(cfg, "num_key_value_heads", path, default=heads)
        if cfg.get("head_dim") is not None:
            head_dim = _positive_int(cfg, "head_dim", path)
        elif hidden % heads:
            raise ConfigError(f"{path}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
                              "when there is no head_dim field")
        else:
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ConfigError(
                f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in _SILU_NAMES:
            raise ConfigError(f"{path}: hidden_act {act!r} is not supported (supported: silu; Llama and Mixtral "
                              "use it)")
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        if not isinstance(dtype_name, str) or not isinstance(getattr(torch, dtype_name, None), torch.dtype):
            raise ConfigError(f"{path}: field 'torch_dtype' / 'dtype' must name a torch dtype (e.g. \"bfloat16\"), "
                              f"got {dtype_name!r}")
        arch_cfg = cls(
            architecture=arch,
            model_type=cfg.get("model_type", "llama"),
            hidden_size=hidden,
            num_hidden_layers=_positive_int(cfg, "num_hidden_layers", path),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive_int(cfg, "intermediate_size", path),
            vocab_size=_positive_int(cfg, "vocab_size", path),
            rms_norm_eps=_positive_float(cfg, "rms_norm_eps", path, 1e-6),
            max_position_embeddings=_positive_int(cfg, "max_position_embeddings", path, default=2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(cfg, path),
            num_local_experts=int(cfg.get("num_local_experts", 0)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
            quantization_config=cfg.get("quantization_config"),
            checkpoint_dtype=_DTYPES.get(str(dtype_name), torch.bfloat16),
        )
        qc = arch_cfg.quantization_config
        if qc is not None and not isinstance(qc, dict):
            # Checked here, before transformers reads config.json for the tokenizer and fails on it
            # with an AttributeError about `to_dict`.
            raise ConfigError(f"{path}: quantization_config must be a JSON object, got {type(qc).__name__}")
        if arch == "MixtralForCausalLM":
            if arch_cfg.num_local_experts < 1:
                raise ConfigError(f"{path}: required field 'num_local_experts' is missing or < 1")
            if not 1 <= arch_cfg.num_experts_per_tok <= arch_cfg.num_local_experts:
                raise ConfigError(
                    f"{path}: num_experts_per_tok must be in [1, num_local_experts], "
                    f"got {arch_cfg.num_experts_per_tok}"
                )
        return arch_cfg


def read_hf_config(model_dir: str | os.PathLike) -> tuple[dict, Path]:
    """Parse `<model_dir>/config.json` with errors that name the path."""
    path = Path(model_dir)
    if not path.exists():
        raise ConfigError(f"model path '{model_dir}' does not exist")
    if not path.is_dir():
        raise ConfigError(f"model path '{model_dir}' is not a directory (expected a Hugging Face checkpoint directory)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found (expected a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    if cfg.get("quantization_config") is None and cfg.get("compression_config") is not None:
        # Older compressed-tensors checkpoints (llm-compressor before mid-2024) name the block
        # compression_config; vLLM reads it where quantization_config is absent. Moved, not
        # copied: a checkpoint written from this dict (calibrate --out-checkpoint) has one block.
        logger.info("%s: reading compression_config as the quantization_config (older compressed-tensors "
                    "checkpoints name it so)", cfg_path)
        cfg["quantization_config"] = cfg.pop("compression_config")
    return cfg, cfg_path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got '{device}'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"--dtype {dtype} is not supported (choices: {', '.join(DTYPE_CHOICES)})")
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError(f"--dtype '{dtype}' is not supported (choices: {', '.join(DTYPE_CHOICES)})")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.float32
    return platform.fastest_cpu_compute_dtype()


def _json_object(value: dict | str | None, flag: str) -> dict | None:
    """A flag's JSON object text (or a dict from the Python API) as a dict; ConfigError naming the flag."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} must be a JSON object such as '{{\"temperature\": 0.7}}', got {value!r} "
                          f"({e})") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    return parsed


def _tokenizer_dir(tokenizer) -> str:
    """--tokenizer checked before anything loads: a directory holding tokenizer files."""
    from fp8serve.engine.tokenizer import TOKENIZER_FILES

    path = Path(str(tokenizer)).expanduser()
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "no such directory"
        raise ConfigError(f"--tokenizer {str(tokenizer)!r}: {what} (a local directory with "
                          f"{' or '.join(TOKENIZER_FILES)}; nothing is downloaded)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"--tokenizer {str(tokenizer)!r}: the directory has none of {', '.join(TOKENIZER_FILES)}")
    return str(path)


def check_quantization_flag(quantization: str, hf_quant_config: dict | None, cfg_path: Path) -> str | None:
    """--quantization checked against the checkpoint's own quantization_config, as vLLM checks it, so that a
    command line means the same in both engines: a checkpoint that declares a method is read by that method,
    a flag naming another is refused, one naming the same is redundant. The result keeps the field's
    meaning: set only when the weights are quantized at load."""
    if not hf_quant_config:
        return quantization
    method = hf_quant_config.get("quant_method")
    if method == quantization:
        logger.info("--quantization %s: %s already declares quant_method %r; its weights are read as they are",
                    quantization, cfg_path, method)
        return None
    declared = (f"declares quantization_config.quant_method {method!r}" if method
                else "has a quantization_config without a quant_method")
    raise ConfigError(f"--quantization {quantization} does not match the checkpoint: {cfg_path} {declared}. "
                      "A checkpoint with a quantization_config is read by its own method: drop --quantization "
                      "(FP8 weights made at load are for 16/32-bit checkpoints without one)")


@dataclass
class ModelConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    device: str = "auto"
    seed: int = 0
    # vLLM's --tokenizer: a directory with the tokenizer files, where the checkpoint ships
    # none (or another); None: the model's directory. Local only: no hub here.
    tokenizer: str | None = None
    # vLLM's --quantization: "fp8" quantizes a 16/32-bit checkpoint's weights at load
    # (quantization/fp8_online.py); None: the checkpoint's own weights. A flag that names the
    # checkpoint's own quant_method is redundant and reads back as None; another is refused.
    quantization: str | None = None
    # vLLM's --generation-config ("auto": the model's generation_config.json gives the
    # default temperature / top_p / ...; "vllm": none; or a directory) and
    # --override-generation-config: engine/generation_defaults.py.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # Always run the model eagerly: no recorded decode or prefill forwards (vLLM's
    # --enforce-eager, which turns off its CUDA graphs; see decode_capture.py
    # and prefill_capture.py).
    enforce_eager: bool = False
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask for per
    # position (each costs a top-k over the vocabulary and a detokenized entry); -1 = the
    # vocabulary size. Resolved to a count in __post_init__.
    max_logprobs: int = 20
    # Filled in __post_init__.
    arch: ModelArchConfig = field(init=False)
    hf_config: dict = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)
    # SamplingParams fields -> defaults for requests that leave them unset (from the above).
    default_sampling_params: dict = field(init=False)

    def __post_init__(self) -> None:
        # A string such as "false" would otherwise read as true.
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"--seed must be an integer in [-2^63, 2^64) (default 0), got {self.seed!r}")
        if self.quantization is not None:
            from fp8serve.quantization.registry import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                raise ConfigError(f"--quantization {self.quantization!r} is not supported (supported: "
                                  f"{', '.join(QUANTIZATION_METHODS)}; FP8 checkpoints need no flag)")
        self.model = str(self.model)
        if self.tokenizer is not None:
            self.tokenizer = _tokenizer_dir(self.tokenizer)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be an integer >= 0, or -1 for the whole vocabulary (default 20), "
                              f"got {self.max_logprobs!r}")
        self.hf_config, cfg_path = read_hf_config(self.model)
        self.arch = ModelArchConfig.from_dict(self.hf_config, cfg_path)
        if self.max_logprobs == -1:
            self.max_logprobs = self.arch.vocab_size
        if self.quantization is not None:
            self.quantization = check_quantization_flag(self.quantization, self.arch.quantization_config, cfg_path)
        from fp8serve.engine.generation_defaults import default_sampling_params

        self.default_sampling_params = default_sampling_params(self.model, self.generation_config,
                                                               self.override_generation_config)
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device, self.arch.checkpoint_dtype)
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be a positive integer, got {self.max_model_len!r}")
        elif self.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings ({limit}) "
                f"in {cfg_path}"
            )

    @property
    def dtype_name(self) -> str:
        return str(self.torch_dtype).removeprefix("torch.")


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    # Bytes for the KV cache of all layers; None = a fraction of free memory.
    kv_cache_memory: int | str | None = None
    calculate_kv_scales: bool = False
    quantization_param_path: str | None = None
    # Reuse the K/V of earlier requests' identical prompt prefixes (engine/block_manager.py).
    enable_prefix_caching: bool = False
    num_blocks: int | None = None  # set by the model runner after sizing

    def __post_init__(self) -> None:
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two >= 1, got {self.block_size!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ConfigError(
                f"--kv-cache-dtype '{self.kv_cache_dtype}' is not supported "
                f"(choices: {', '.join(KV_CACHE_DTYPE_CHOICES)})"
            )
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if isinstance(self.kv_cache_memory, str):
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as e:
                raise ConfigError(f"--kv-cache-memory: {e}") from None
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be > 0, got {self.kv_cache_memory}")
        if self.quantization_param_path is not None and not Path(self.quantization_param_path).is_file():
            what = "is a directory, not a file" if Path(self.quantization_param_path).is_dir() else "not found"
            raise ConfigError(f"--quantization-param-path: '{self.quantization_param_path}' {what} (expected a "
                              "JSON file of per-layer KV scales)")

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_CACHE_DTYPES

    def storage_dtype_name(self, compute_dtype: torch.dtype) -> str:
        """The KV dtype in words: `auto` resolved to the compute dtype."""
        if self.kv_cache_dtype == "auto":
            return str(compute_dtype).removeprefix("torch.")
        return self.kv_cache_dtype


# --max-num-batched-tokens when chunked prefill is on and the flag is not given
# (vLLM's V0 default for chunked prefill): see engine/scheduler.py for what a
# step of this many tokens costs here.
DEFAULT_CHUNKED_PREFILL_TOKENS = 512


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    # Split long prefills into chunks and run them in the same steps as the
    # running sequences' decodes (engine/scheduler.py).
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ConfigError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (max(DEFAULT_CHUNKED_PREFILL_TOKENS, self.max_num_seqs)
                                           if self.enable_chunked_prefill else max(self.max_model_len, 4096))
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.enable_chunked_prefill:
            # Every running sequence's decode token counts against the budget.
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least --max-num-seqs "
                    f"({self.max_num_seqs}) with --enable-chunked-prefill: each running sequence's decode "
                    f"takes one token of every step's budget"
                )
            if self.max_num_batched_tokens < 2:
                # A chunk never leaves a prompt one token to compute (that would
                # read as a decode: Scheduler._chunk), so a budget of 1 could
                # never finish a prompt of two or more tokens.
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least 2 with "
                    f"--enable-chunked-prefill: a prefill chunk never leaves a prompt one token to compute"
                )
        # Without chunked prefill a whole prompt is one prefill, so the token
        # budget must hold the longest prompt the engine accepts.
        elif self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than --max-model-len "
                f"({self.max_model_len}); raise it, lower --max-model-len, or add --enable-chunked-prefill"
            )


# Speculative decoding methods that need no second model (vLLM's names).
SPECULATIVE_METHODS = ("ngram",)
# A verify pass computes 1 + num_speculative_tokens positions of a sequence;
# beyond this many drafts the pass costs more than the tokens it can win here.
MAX_NUM_SPECULATIVE_TOKENS = 16
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size")


@dataclass
class SpeculativeConfig:
    """vLLM's --speculative-config for n-gram (prompt lookup) drafts: after
    each token, the longest suffix of the sequence of prompt_lookup_max down
    to prompt_lookup_min tokens is looked up earlier in the sequence and the
    num_speculative_tokens tokens that followed it there are proposed; one
    forward pass then checks them all (fp8serve/spec_decode/). Defaults as in
    vLLM: both lookup bounds 5 when neither is given, else the given one.
    disable_by_batch_size (vLLM's field): no drafts are proposed while at
    least this many requests are running or waiting (a big batch's step is
    compute-bound here, where rejected drafts cost time); None: no limit."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        where = "--speculative-config"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"{where}: method {self.method!r} is not supported (choices: "
                              f"{', '.join(SPECULATIVE_METHODS)}; draft models are not)")
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError(f"{where}: 'num_speculative_tokens' is required (the drafts proposed per step, "
                              f"1-{MAX_NUM_SPECULATIVE_TOKENS})")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ConfigError(f"{where}: 'num_speculative_tokens' must be an integer in "
                              f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{where}: '{name}' must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"{where}: 'prompt_lookup_min' ({self.prompt_lookup_min}) must not exceed "
                              f"'prompt_lookup_max' ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From the flag's JSON text, a dict (LLM(speculative_config=...)), or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config must be a JSON object such as "
                                  f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r} ({e})') from None
        if not isinstance(value, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported field(s) {unknown} (supported: "
                              f"{', '.join(_SPECULATIVE_KEYS)})")
        return cls(**value)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"--tensor-parallel-size {self.tensor_parallel_size} is not supported: fp8serve runs on one device"
            )


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def create(
        cls,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        device: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        kv_cache_memory: int | str | None = None,
        calculate_kv_scales: bool = False,
        quantization_param_path: str | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        quantization: str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict | str | None = None,
        tokenizer: str | None = None,
        max_logprobs: int = 20,
    ) -> "EngineConfig":
        if model is None:
            from fp8serve.default_model import ensure_default_model

            model = str(ensure_default_model())
        parallel_config = ParallelConfig(tensor_parallel_size)
        spec_config = SpeculativeConfig.parse(speculative_config)
        cache_config = CacheConfig(
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            calculate_kv_scales=calculate_kv_scales,
            quantization_param_path=quantization_param_path,
            enable_prefix_caching=enable_prefix_caching,
        )
        model_config = ModelConfig(model, dtype=dtype, max_model_len=max_model_len, device=device, seed=seed,
                                   enforce_eager=enforce_eager, quantization=quantization, tokenizer=tokenizer,
                                   max_logprobs=max_logprobs,
                                   generation_config=generation_config,
                                   override_generation_config=_json_object(override_generation_config,
                                                                           "--override-generation-config"))
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        return cls(model_config, cache_config, scheduler_config, parallel_config, spec_config)

    def default_kv_cache_memory(self) -> int:
        """A quarter of the memory available now (CPU), or 90% of free device
        memory minus what is already held (CUDA)."""
        dev = self.model_config.torch_device
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return int(free * 0.9)
        avail = platform.available_memory_bytes()
        budget = avail // 4
        logger.info("--kv-cache-memory not given: using %s (a quarter of %s available)",
                    format_bytes(budget), format_bytes(avail))
        return budget
