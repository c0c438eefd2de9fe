"""Typed configs: each bad value fails once, at construction, with an error naming the field."""

import json
import shutil

import pytest
import torch
from checkpoints import DELETE, legacy_rope_config, modern_rope_config, rewrite_config, write_tiny_llama

from fp8serve.config import (
    KV_CACHE_DTYPE_CHOICES,
    SUPPORTED_ARCHITECTURES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    RopeConfig,
    SchedulerConfig,
)
from fp8serve.errors import ConfigError, UserError
from fp8serve.utils.memory import parse_size

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


# -------------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 * 1024**2),
        ("2GiB", 2 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        (1024, 1024),
        ("1KiB", 1024),
        ("64kb", 64_000),
        (" 3 MiB ", 3 * 1024**2),
        ("2gib", 2 * 1024**3),
        ("0.5GiB", 512 * 1024**2),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "GiB", "1.5.5GB", "-1GiB", "12 parsecs", "1e9", "2 GiB free"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="cannot parse size") as e:
        parse_size(text)
    assert f"'{text}'" in str(e.value)


# ------------------------------------------------------------------------------- CacheConfig


def test_cache_config_defaults():
    cc = CacheConfig()
    assert (cc.block_size, cc.kv_cache_dtype, cc.kv_cache_memory) == (16, "auto", None)
    assert not cc.is_fp8
    assert cc.storage_dtype_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("value", ["false", 0, None])
def test_enable_prefix_caching_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="enable_prefix_caching") as e:
        CacheConfig(enable_prefix_caching=value)
    assert repr(value) in str(e.value)
    assert CacheConfig().enable_prefix_caching is False
    assert CacheConfig(enable_prefix_caching=True).enable_prefix_caching is True


@pytest.mark.parametrize("block_size", [0, -16, 3, 24, 16.0, "16"])
def test_cache_config_rejects_bad_block_size(block_size):
    with pytest.raises(ConfigError, match="--block-size") as e:
        CacheConfig(block_size=block_size)
    assert repr(block_size) in str(e.value)


def test_unknown_kv_cache_dtype_lists_the_choices():
    with pytest.raises(ConfigError) as e:
        CacheConfig(kv_cache_dtype="int4")
    msg = str(e.value)
    assert "--kv-cache-dtype" in msg and "'int4'" in msg
    for choice in KV_CACHE_DTYPE_CHOICES:
        assert choice in msg


@pytest.mark.parametrize("name, resolved", [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_fp8_kv_cache_dtypes(name, resolved):
    cc = CacheConfig(kv_cache_dtype=name)
    assert cc.kv_cache_dtype == resolved
    assert cc.is_fp8
    assert cc.storage_dtype_name(torch.float32) == resolved


def test_kv_cache_memory_parsing_and_errors():
    assert CacheConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 * 1024**2
    assert CacheConfig(kv_cache_memory=4096).kv_cache_memory == 4096
    with pytest.raises(ConfigError, match="--kv-cache-memory.*'lots'"):
        CacheConfig(kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="--kv-cache-memory must be > 0"):
        CacheConfig(kv_cache_memory="0GiB")


def test_quantization_param_path_must_exist(tmp_path):
    missing = tmp_path / "scales.json"
    with pytest.raises(ConfigError, match="--quantization-param-path.*scales.json"):
        CacheConfig(quantization_param_path=str(missing))
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        CacheConfig(quantization_param_path=str(tmp_path))


def test_config_errors_are_user_errors():
    # The CLI prints UserErrors as one line without a traceback.
    assert issubclass(ConfigError, UserError)


# --------------------------------------------------------------------------- SchedulerConfig


def test_scheduler_config_defaults_budget_to_at_least_max_model_len():
    assert SchedulerConfig(max_model_len=256).max_num_batched_tokens == 4096
    assert SchedulerConfig(max_model_len=8192).max_num_batched_tokens == 8192


def test_max_num_batched_tokens_below_max_model_len_says_what_to_change():
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048)
    msg = str(e.value)
    assert "--max-num-batched-tokens (512)" in msg and "--max-model-len (2048)" in msg
    assert "raise it, lower --max-model-len, or add --enable-chunked-prefill" in msg
    SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048)  # equal is fine


def test_chunked_prefill_budget_holds_a_decode_per_sequence_and_may_be_below_max_model_len():
    with pytest.raises(ConfigError, match=r"--max-num-batched-tokens \(4\) must be at least --max-num-seqs \(8\)"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=32, enable_chunked_prefill=True)
    # Without chunked prefill the budget must hold a whole prompt; the message names the flag that lifts that.
    with pytest.raises(ConfigError, match="--enable-chunked-prefill"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=32)
    assert SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=32,
                           enable_chunked_prefill=True).max_num_batched_tokens == 16
    assert SchedulerConfig(max_model_len=8192, enable_chunked_prefill=True).max_num_batched_tokens == 512
    assert SchedulerConfig(max_num_seqs=1024, max_model_len=8192,
                           enable_chunked_prefill=True).max_num_batched_tokens == 1024
    # A budget of 1 would stall a prompt with two tokens left for good (found by a fuzzer).
    with pytest.raises(ConfigError, match=r"--max-num-batched-tokens \(1\) must be at least 2"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=32, enable_chunked_prefill=True)
    assert SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2, max_model_len=32,
                           enable_chunked_prefill=True).max_num_batched_tokens == 2
    with pytest.raises(ConfigError, match="enable_chunked_prefill must be True or False"):
        SchedulerConfig(enable_chunked_prefill="yes")
    with pytest.raises(ConfigError, match="--max-num-batched-tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0, max_model_len=32, enable_chunked_prefill=True)


def test_max_num_seqs_must_be_positive():
    with pytest.raises(ConfigError, match="--max-num-seqs must be >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)


# ---------------------------------------------------------------------------- ParallelConfig


def test_parallel_config():
    assert ParallelConfig().tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 is not supported"):
        ParallelConfig(2)


# ------------------------------------------------------------------------------- ModelConfig


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama"), max_position_embeddings=256)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_enforce_eager_must_be_a_bool(llama_dir, value):
    """--enforce-eager is a switch; a string like "false" must not read as true."""
    with pytest.raises(ConfigError, match="enforce_eager") as e:
        ModelConfig(str(llama_dir), enforce_eager=value)
    assert repr(value) in str(e.value)
    assert ModelConfig(str(llama_dir), enforce_eager=True).enforce_eager is True


@pytest.fixture
def model_dir(llama_dir, tmp_path):
    """A private copy of the tiny llama's config.json (ModelConfig reads nothing else)."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d / "config.json")
    return d


def model_config(path, **kwargs) -> ModelConfig:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    return ModelConfig(str(path), **kwargs)


def test_model_config_reads_the_checkpoint(model_dir):
    mc = model_config(model_dir)
    a = mc.arch
    assert a.architecture == "LlamaForCausalLM"
    assert (a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads) == (64, 2, 4, 2)
    assert (a.head_dim, a.vocab_size, a.max_position_embeddings) == (16, 512, 256)
    assert mc.max_model_len == 256
    assert mc.torch_dtype == torch.float32 and mc.torch_device == torch.device("cpu")
    assert model_config(model_dir, max_model_len=32).max_model_len == 32


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=f"model path '{missing}' does not exist"):
        model_config(missing)


def test_model_path_is_a_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match="is not a directory"):
        model_config(f)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        model_config(tmp_path)


def test_invalid_json(model_dir):
    (model_dir / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError) as e:
        model_config(model_dir)
    assert str(model_dir / "config.json") in str(e.value) and "not valid JSON" in str(e.value)


def test_config_json_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        model_config(model_dir)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers",
                                   "intermediate_size", "vocab_size"])
def test_missing_required_field_names_field_and_file(model_dir, field):
    rewrite_config(model_dir, **{field: DELETE})
    with pytest.raises(ConfigError) as e:
        model_config(model_dir)
    msg = str(e.value)
    assert f"'{field}'" in msg and "missing" in msg
    assert str(model_dir / "config.json") in msg


def test_wrongly_typed_field_names_field(model_dir):
    rewrite_config(model_dir, hidden_size="64")
    with pytest.raises(ConfigError, match="field 'hidden_size' must be int, got '64'"):
        model_config(model_dir)


def test_unsupported_architecture_lists_the_supported_ones(model_dir):
    rewrite_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError) as e:
        model_config(model_dir)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "not supported" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_missing_architectures(model_dir):
    rewrite_config(model_dir, architectures=DELETE)
    with pytest.raises(ConfigError, match=r"\(none\) is not supported"):
        model_config(model_dir)


def test_heads_must_be_a_multiple_of_kv_heads(model_dir):
    rewrite_config(model_dir, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\).*num_key_value_heads \(3\)"):
        model_config(model_dir)


@pytest.mark.parametrize("field, value, words", [
    ("num_hidden_layers", 0, "'num_hidden_layers' must be an integer >= 1, got 0"),
    ("num_hidden_layers", -1, "'num_hidden_layers' must be an integer >= 1, got -1"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be an integer >= 1, got 0"),
    ("max_position_embeddings", 0, "'max_position_embeddings' must be an integer >= 1, got 0"),
    ("head_dim", -16, "'head_dim' must be an integer >= 1, got -16"),
    ("rms_norm_eps", "x", "'rms_norm_eps' must be a finite number > 0, got 'x'"),
    ("rms_norm_eps", 0, "'rms_norm_eps' must be a finite number > 0, got 0"),
    ("rope_theta", "abc", "'rope_theta' must be a finite number > 0, got 'abc'"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported (supported: silu"),
    ("torch_dtype", "float99", "must name a torch dtype (e.g. \"bfloat16\"), got 'float99'"),
    ("quantization_config", ["fp8"], "quantization_config must be a JSON object, got list"),
])
def test_out_of_range_fields_name_the_field_and_file(model_dir, field, value, words):
    """A value the model cannot be built from is config.json's error, not a failure
    later on (a tensor shape, a float() of a string, a silently ignored activation)."""
    rewrite_config(model_dir, **{field: value})
    with pytest.raises(ConfigError) as e:
        model_config(model_dir)
    assert words in str(e.value) and str(model_dir / "config.json") in str(e.value)


def test_rope_parameters_fields_are_checked(model_dir):
    rewrite_config(model_dir, rope_parameters={"rope_type": "default", "rope_theta": -1.0})
    with pytest.raises(ConfigError, match=r"'rope_parameters.rope_theta' must be a finite number > 0, got -1.0"):
        model_config(model_dir)
    rewrite_config(model_dir, rope_parameters=DELETE, rope_scaling="linear")
    with pytest.raises(ConfigError, match=r"field 'rope_scaling' must be an object, got 'linear'"):
        model_config(model_dir)
    rewrite_config(model_dir, rope_scaling=DELETE, rope_theta="abc")
    with pytest.raises(ConfigError, match=r"field 'rope_theta' must be a finite number > 0, got 'abc'"):
        model_config(model_dir)


def test_hidden_size_must_split_into_heads_without_head_dim(model_dir):
    rewrite_config(model_dir, hidden_size=66, head_dim=DELETE)
    with pytest.raises(ConfigError, match=r"hidden_size \(66\) must be a multiple of num_attention_heads \(4\)"):
        model_config(model_dir)


def test_silu_spellings_and_absent_activation_are_accepted(model_dir):
    for act in ("silu", "swish", DELETE):
        rewrite_config(model_dir, hidden_act=act)
        assert model_config(model_dir).arch.hidden_size == 64


def test_max_model_len_above_max_position_embeddings(model_dir):
    with pytest.raises(ConfigError) as e:
        model_config(model_dir, max_model_len=257)
    msg = str(e.value)
    assert "--max-model-len 257" in msg and "max_position_embeddings (256)" in msg
    assert model_config(model_dir, max_model_len=256).max_model_len == 256


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_max_model_len_must_be_a_positive_int(model_dir, bad):
    with pytest.raises(ConfigError, match="--max-model-len must be a positive integer"):
        model_config(model_dir, max_model_len=bad)


def test_bad_dtype_and_device(model_dir):
    with pytest.raises(ConfigError, match="--dtype 'int8' is not supported"):
        model_config(model_dir, dtype="int8")
    for seed in (None, "1", 1.5, 2**64):
        with pytest.raises(ConfigError, match="--seed must be an integer"):
            model_config(model_dir, seed=seed)
    # vLLM's aliases.
    assert model_config(model_dir, dtype="half").torch_dtype == torch.float16
    assert model_config(model_dir, dtype="float").torch_dtype == torch.float32
    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        model_config(model_dir, device="tpu")


KV_ONLY_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("quantization_config, declared", [
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"]}}},
     "declares quantization_config.quant_method 'compressed-tensors'"),
    # FP8 KV only, 16-bit weights: vLLM refuses the flag here too (the method is the config's).
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": KV_ONLY_SCHEME},
     "declares quantization_config.quant_method 'compressed-tensors'"),
    ({"quant_method": "awq", "bits": 4}, "declares quantization_config.quant_method 'awq'"),
    ({"activation_scheme": "dynamic"}, "has a quantization_config without a quant_method"),
])
def test_quantization_flag_disagreeing_with_the_checkpoint_is_refused(model_dir, quantization_config, declared):
    """As vLLM: --quantization naming another method than config.json's quantization_config was accepted
    without a word (and ignored, or quantized the weights again); refused when the config is built."""
    rewrite_config(model_dir, quantization_config=quantization_config)
    with pytest.raises(ConfigError) as e:
        model_config(model_dir, quantization="fp8")
    assert str(e.value).startswith(f"--quantization fp8 does not match the checkpoint: {model_dir / 'config.json'} "
                                   f"{declared}. "), str(e.value)
    assert "drop --quantization" in str(e.value)
    assert model_config(model_dir).quantization is None


def test_quantization_flag_naming_the_checkpoints_own_method_is_redundant(model_dir):
    """Accepted, as vLLM does; the field then says what it says without the flag: the checkpoint's
    own weights (None), not weights quantized at load, which calibrate's hints read."""
    assert model_config(model_dir, quantization="fp8").quantization == "fp8"
    rewrite_config(model_dir, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert model_config(model_dir, quantization="fp8").quantization is None


# ------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING, {"type": "linear", "factor": 2.0}],
                         ids=["default", "llama3", "linear-old-type-key"])
def test_both_rope_spellings_parse_to_the_same_rope_config(model_dir, scaling):
    # Pre-5 spelling as written by hand: top-level rope_theta (+ rope_scaling, maybe with "type").
    rewrite_config(model_dir, rope_parameters=DELETE, rope_theta=5e5,
                   rope_scaling=scaling if scaling is not None else DELETE)
    rope_handwritten = model_config(model_dir).arch.rope
    modern = modern_rope_config(model_dir)
    assert "rope_parameters" in modern and "rope_theta" not in modern and "rope_scaling" not in modern
    rope_modern = model_config(model_dir).arch.rope
    legacy = legacy_rope_config(model_dir)
    assert "rope_parameters" not in legacy and legacy["rope_theta"] == 5e5
    rope_legacy = model_config(model_dir).arch.rope
    assert rope_modern == rope_legacy == rope_handwritten
    assert rope_modern.theta == 5e5
    expected_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    assert rope_modern.rope_type == expected_type
    assert rope_modern.factor == (1.0 if scaling is None else scaling["factor"])
    if scaling is LLAMA3_SCALING:
        assert rope_modern.original_max_position_embeddings == 64
        assert (rope_modern.low_freq_factor, rope_modern.high_freq_factor) == (1.0, 4.0)


def test_rope_defaults_without_any_rope_fields(tmp_path):
    rope = RopeConfig.from_hf({}, tmp_path / "config.json")
    assert rope == RopeConfig(rope_type="default", theta=10000.0)


def test_unsupported_rope_type(model_dir):
    rewrite_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported.*default, linear, llama3"):
        model_config(model_dir)


def test_llama3_rope_needs_original_max_position_embeddings(model_dir):
    params = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    rewrite_config(model_dir, rope_parameters={**params, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        model_config(model_dir)


def test_config_json_is_left_untouched(model_dir):
    before = (model_dir / "config.json").read_text()
    model_config(model_dir)
    assert json.loads((model_dir / "config.json").read_text()) == json.loads(before)


# ------------------------------------------------------------------ --speculative-config
def test_speculative_config_lookup_bounds_default_as_vllm():
    from fp8serve.config import SpeculativeConfig

    def bounds(**kw):
        c = SpeculativeConfig.parse(dict(method="ngram", num_speculative_tokens=3, **kw))
        return c.prompt_lookup_min, c.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=4) == (4, 4)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=2, prompt_lookup_max=4) == (2, 4)
    assert SpeculativeConfig.parse(None) is None
    c = SpeculativeConfig(num_speculative_tokens=2)
    assert SpeculativeConfig.parse(c) is c and c.method == "ngram"
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}') == c


@pytest.mark.parametrize("value, words", [
    ({"num_speculative_tokens": True}, "'num_speculative_tokens' must be an integer in [1, 16], got True"),
    ({"num_speculative_tokens": 17}, "got 17"),
    ({"num_speculative_tokens": "4"}, "got '4'"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "'prompt_lookup_min' must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, "'prompt_lookup_max' must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "'disable_by_batch_size' must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": True}, "'disable_by_batch_size' must be an integer >= 1"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' is not supported"),
    ("[]", "must be a JSON object, got []"),
    ("{'method': 'ngram'}", "must be a JSON object such as"),
])
def test_speculative_config_errors_name_the_flag_and_field(value, words):
    from fp8serve.config import SpeculativeConfig

    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value) and str(e.value).startswith("--speculative-config")
