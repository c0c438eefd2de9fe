"""The engine flags every command shares: vLLM's names, reaching the engine's keyword arguments."""

import argparse

import pytest

from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs, human_readable_int
from fp8serve.errors import UserError


def parse(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(list(argv)))


def test_enable_prefix_caching_both_spellings():
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse()["enable_prefix_caching"] is False


def test_enable_chunked_prefill_both_spellings():
    kwargs = parse("--enable-chunked-prefill", "--max-num-batched-tokens", "64")
    assert kwargs["enable_chunked_prefill"] is True and kwargs["max_num_batched_tokens"] == 64
    assert parse("--no-enable-chunked-prefill")["enable_chunked_prefill"] is False
    assert parse()["enable_chunked_prefill"] is False


def test_speculative_config_json_reaches_the_engine_config(tmp_path):
    from checkpoints import write_tiny_llama

    from fp8serve.config import EngineConfig, SpeculativeConfig

    kwargs = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    config = EngineConfig.create(str(write_tiny_llama(tmp_path / "llama")), **kwargs)
    assert config.speculative_config == SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=3)
    assert parse()["speculative_config"] is None


def test_every_flag_reaches_the_engine_config():
    """engine_kwargs' keys are EngineConfig.create's parameters: a flag added to one and not the other fails here."""
    import inspect

    from fp8serve.config import EngineConfig

    params = set(inspect.signature(EngineConfig.create).parameters) - {"cls", "model"}
    assert set(parse()) == params


def test_serve_takes_vllm_disable_log_stats():
    from fp8serve.entrypoints import cli

    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--disable-log-stats"]).disable_log_stats is True
    assert parser.parse_args(["serve"]).disable_log_stats is False
    assert parser.parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize("text, value", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                         ("1m", 10**6), ("2M", 2 * 2**20), ("1G", 2**30), (" 128 ", 128)])
def test_human_readable_int_as_vllm(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["abc", "1.5K", "-1", "4kb", ""])
def test_human_readable_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_max_model_len_and_kv_cache_memory_bytes_take_vllm_syntax():
    kwargs = parse("--max-model-len", "1K", "--kv-cache-memory-bytes", "64M")
    assert kwargs["max_model_len"] == 1024 and kwargs["kv_cache_memory"] == 64 * 2**20
    assert parse("--kv-cache-memory", "64MiB")["kv_cache_memory"] == "64MiB"
    with pytest.raises(UserError, match="not both"):
        parse("--kv-cache-memory", "64MiB", "--kv-cache-memory-bytes", "64M")


def test_dtype_takes_vllm_aliases():
    assert parse("--dtype", "half")["dtype"] == "half" and parse("--dtype", "float")["dtype"] == "float"


# Every command that builds an engine or model: (its subcommand names, the other arguments it needs).
ENGINE_COMMANDS = [(["generate"], []), (["serve"], []), (["calibrate"], []), (["eval-kv"], ["--text", "t.txt"]),
                   (["compare"], []), (["bench", "sweep"], [])]


def _subparser(names: list[str]) -> argparse.ArgumentParser:
    from fp8serve.entrypoints import cli

    parser = cli.build_parser()
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_quantization_takes_vllm_choices(capsys):
    assert parse("-q", "fp8")["quantization"] == parse("--quantization", "fp8")["quantization"] == "fp8"
    assert parse()["quantization"] is None
    with pytest.raises(SystemExit):
        parse("-q", "awq")
    assert "argument --quantization/-q: invalid choice: 'awq' (choose from 'fp8')" in capsys.readouterr().err


@pytest.mark.parametrize("names, extra", ENGINE_COMMANDS, ids=lambda v: " ".join(v))
def test_every_engine_command_takes_quantization_as_serve_does(names, extra, capsys):
    """One flag, one help text, one set of choices: -q/--quantization through add_quantization_arg."""
    from fp8serve.entrypoints import cli

    parser = cli.build_parser()
    assert parser.parse_args([*names, *extra, "-q", "fp8"]).quantization == "fp8"
    assert parser.parse_args([*names, *extra, "--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args([*names, *extra]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args([*names, *extra, "-q", "awq"])
    assert "argument --quantization/-q: invalid choice: 'awq' (choose from 'fp8')" in capsys.readouterr().err
    [served] = [a for a in _subparser(["serve"])._actions if a.dest == "quantization"]
    [action] = [a for a in _subparser(names)._actions if a.dest == "quantization"]
    assert action.option_strings == served.option_strings and action.choices == served.choices
    assert action.help.startswith(served.help)


def test_max_logprobs_reaches_the_model_config(tmp_path):
    from checkpoints import write_tiny_llama

    from fp8serve.config import EngineConfig

    assert parse()["max_logprobs"] == 20
    model = str(write_tiny_llama(tmp_path / "llama"))
    assert EngineConfig.create(model, **parse("--max-logprobs", "50")).model_config.max_logprobs == 50
    assert EngineConfig.create(model, **parse("--max-logprobs", "-1")).model_config.max_logprobs == 512  # vocab
