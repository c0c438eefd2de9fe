"""The model's generation_config.json as default sampling parameters (vLLM's
--generation-config auto / vllm / DIR and --override-generation-config): what
is taken, what is refused, and the offline API's defaults from it."""

from __future__ import annotations

import json

import pytest

from checkpoints import write_tiny_llama
from fp8serve import LLM, SamplingParams
from fp8serve.engine.generation_defaults import default_sampling_params
from fp8serve.errors import ConfigError


def write_generation_config(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3],
                                                                   **fields}))
    return directory


def test_takes_vllms_sampling_keys_only(tmp_path):
    d = write_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=50, do_sample=True, num_beams=1,
                                max_new_tokens=20, repetition_penalty=None, min_p=0.05)
    assert default_sampling_params(str(d)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_tokens": 20,
                                               "min_p": 0.05}
    assert default_sampling_params(str(d), "vllm") == {}
    assert default_sampling_params(str(tmp_path / "no-such-model")) == {}  # auto: no file, no defaults
    other = write_generation_config(tmp_path / "other", temperature=0.3)
    assert default_sampling_params(str(d), str(other)) == {"temperature": 0.3}
    assert default_sampling_params(str(d), "vllm", {"temperature": 0.5, "max_new_tokens": 7}) == \
        {"temperature": 0.5, "max_tokens": 7}
    assert default_sampling_params(str(d), "auto", {"top_p": 0.5})["top_p"] == 0.5


@pytest.mark.parametrize("fields, message", [
    ({"temperature": "hot"}, "'temperature' must be a number, got 'hot'"),
    ({"temperature": True}, "'temperature' must be a number, got True"),
    ({"temperature": -0.1}, "'temperature' must be >= 0, got -0.1"),
    ({"top_p": 0}, "'top_p' must be in (0, 1], got 0"),
    ({"top_k": 2.5}, "'top_k' must be an integer, got 2.5"),
    ({"max_new_tokens": 0}, "'max_new_tokens' must be >= 1, got 0"),
    ({"repetition_penalty": 0.0}, "'repetition_penalty' must be > 0, got 0.0"),
])
def test_a_bad_value_is_named_with_its_file(tmp_path, fields, message):
    d = write_generation_config(tmp_path, **fields)
    with pytest.raises(ConfigError) as e:
        default_sampling_params(str(d))
    assert str(d / "generation_config.json") in str(e.value) and message in str(e.value)


def test_bad_sources_and_overrides_are_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON .*--generation-config vllm ignores the file"):
        default_sampling_params(str(tmp_path))
    assert default_sampling_params(str(tmp_path), "vllm") == {}
    with pytest.raises(ConfigError, match="--generation-config '.*nowhere' is not a directory"):
        default_sampling_params(str(tmp_path), str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no generation_config.json"):
        default_sampling_params(str(tmp_path), str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['temprature'\]"):
        default_sampling_params(str(tmp_path), "vllm", {"temprature": 0.5})
    with pytest.raises(ConfigError, match="--override-generation-config: 'top_p' must be in"):
        default_sampling_params(str(tmp_path), "vllm", {"top_p": 2})


def test_offline_generate_without_params_uses_the_models_defaults(tmp_path):
    """temperature 0 and max_new_tokens 5 in the model's file: LLM.generate(prompt) is greedy and
    stops at 5 tokens, as with explicit SamplingParams; --generation-config vllm restores the
    engine's defaults (16 tokens); an override JSON on top of the file."""
    model = write_tiny_llama(tmp_path / "llama")
    write_generation_config(model, temperature=0.0, max_new_tokens=5)
    prompt = {"prompt_token_ids": [5, 9, 13, 21, 34]}
    llm = LLM(str(model), dtype="float32", kv_cache_memory="4MiB")
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    ref = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) <= 5
    plain = LLM(str(model), dtype="float32", kv_cache_memory="4MiB", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    over = LLM(str(model), dtype="float32", kv_cache_memory="4MiB",
               override_generation_config='{"max_new_tokens": 3}')
    assert over.get_default_sampling_params().max_tokens == 3
    assert over.get_default_sampling_params().temperature == 0.0


def test_the_log_names_where_the_defaults_came_from(tmp_path, caplog):
    """A --generation-config directory is named as the source, not "the model's"; an override is named too."""
    import logging

    caplog.set_level(logging.INFO, logger="fp8serve.engine.llm_engine")
    model = write_tiny_llama(tmp_path / "llama")
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    write_generation_config(elsewhere, temperature=0.5)

    def logged(**kwargs):
        caplog.clear()
        LLM(str(model), dtype="float32", kv_cache_memory="4MiB", **kwargs)
        return [r.getMessage() for r in caplog.records if "Default sampling parameters" in r.getMessage()]

    [line] = logged(generation_config=str(elsewhere))
    assert f"from {elsewhere}/generation_config.json:" in line and "model's" not in line
    [line] = logged(generation_config="vllm", override_generation_config='{"top_k": 3}')
    assert "from --override-generation-config:" in line
    [line] = logged(generation_config=str(elsewhere), override_generation_config='{"top_k": 3}')
    assert "generation_config.json and --override-generation-config:" in line
