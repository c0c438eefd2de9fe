import pytest

from fp8serve.engine.tokenizer import check_text, first_invalid_text
from fp8serve.errors import InvalidParameterError, UserError


def test_first_invalid_text_names_the_path_and_character():
    assert first_invalid_text("caf\u00e9 \U0001f600", "prompt") is None
    assert first_invalid_text(["ok", {"a": ["x", "y\udc80z"]}], "stop") == ("stop[1].a[1]", 1)
    assert first_invalid_text({"role": "user", "content": "\ud83d\ude00"}, "m") == ("m.content", 0)
    assert first_invalid_text([1, None, 2.5, {"k": 3}], "x") is None


def test_check_text_raises_a_parameter_error():
    check_text({"content": "fine"}, "messages")
    with pytest.raises(InvalidParameterError, match=r"messages\[0\]\.content is not valid Unicode text: a lone "
                                                    r"UTF-16 surrogate at character 2") as info:
        check_text([{"content": "ab\ud800"}], "messages")
    assert info.value.parameter == "messages"
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidParameterError) as info:
        check_text("\udfff", "prompt.text", parameter="prompt")
    assert info.value.parameter == "prompt"


def test_tokenizer_flag_gives_a_checkpoint_without_one_its_tokenizer(tmp_path):
    """vLLM's --tokenizer: a checkpoint that ships no tokenizer files takes text prompts with another
    directory's tokenizer, and tokenizes as that directory's tokenizer does."""
    from checkpoints import write_tiny_llama
    from fp8serve import LLM, SamplingParams
    from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs

    bare = write_tiny_llama(tmp_path / "bare", with_tokenizer=False)
    with_tok = write_tiny_llama(tmp_path / "with_tok")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(UserError, match="has no tokenizer"):
        LLM(str(bare), dtype="float32", kv_cache_memory="4MiB").generate("Hello there", params, use_tqdm=False)

    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(bare), "--tokenizer", str(with_tok), "--dtype", "float32",
                              "--kv-cache-memory", "4MiB"])
    llm = LLM(args.model, **engine_kwargs(args))
    out = llm.generate("Hello there", params, use_tqdm=False)[0]
    # The same weights (the factory is seeded) with the tokenizer in the model's own directory.
    reference = LLM(str(with_tok), dtype="float32", kv_cache_memory="4MiB")
    ref = reference.generate("Hello there", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == reference.get_tokenizer().encode("Hello there", add_special_tokens=True)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ref.prompt_token_ids, ref.outputs[0].token_ids)
    assert out.outputs[0].text == ref.outputs[0].text and out.outputs[0].text
    assert llm.llm_engine.config.model_config.tokenizer == str(with_tok)


def _a_file(d):
    f = d / "tokenizer.json"
    f.write_text("{}")
    return f


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "nowhere", "no such directory (a local directory with tokenizer.json or"),
    (lambda d: d, "the directory has none of tokenizer.json, tokenizer.model"),
    # A file that exists is not "no such directory".
    (_a_file, "is a file, not a directory (a local directory with tokenizer.json or"),
])
def test_bad_tokenizer_flag_is_named(tmp_path, make, words):
    from checkpoints import write_tiny_llama
    from fp8serve import LLM
    from fp8serve.errors import ConfigError

    model = write_tiny_llama(tmp_path / "model")
    empty = tmp_path / "empty"
    empty.mkdir()
    path = make(empty)
    with pytest.raises(ConfigError) as e:
        LLM(str(model), tokenizer=str(path), dtype="float32", kv_cache_memory="4MiB")
    assert str(e.value).startswith(f"--tokenizer '{path}': {words}"), str(e.value)


def test_text_prompt_without_a_tokenizer_names_both_remedies(tmp_path):
    """The offline API may take token ids, or a tokenizer directory (tokenizer=, the CLI's --tokenizer)."""
    from checkpoints import write_tiny_llama
    from fp8serve import LLM, SamplingParams

    bare = write_tiny_llama(tmp_path / "bare", with_tokenizer=False)
    llm = LLM(str(bare), dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(UserError) as e:
        llm.generate("Hello there", SamplingParams(max_tokens=1), use_tqdm=False)
    assert str(e.value) == (f"{bare} has no tokenizer files: pass prompt_token_ids instead of text, or a directory "
                            "holding them as tokenizer=DIR (--tokenizer DIR)")


def test_chat_template_missing_from_the_tokenizer_flags_directory_names_it(tmp_path):
    """With --tokenizer the template comes from that directory; the error named the model's."""
    import json
    import shutil

    from checkpoints import write_tiny_llama
    from fp8serve import LLM

    bare = write_tiny_llama(tmp_path / "bare", with_tokenizer=False)
    tok = tmp_path / "tok"
    shutil.copytree(write_tiny_llama(tmp_path / "with_tok"), tok,
                    ignore=lambda _, names: [n for n in names if not n.startswith(("tokenizer", "special"))])
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(bare), tokenizer=str(tok), dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(UserError) as e:
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert str(e.value) == f"--tokenizer {tok} has no chat template"


def test_tokenizer_config_alone_is_one_line_naming_the_files(tmp_path):
    """transformers' own error for it is a paragraph about tokenizer backends."""
    import shutil

    from checkpoints import make_tokenizer
    from fp8serve.engine.tokenizer import load_tokenizer
    from fp8serve.errors import ConfigError

    make_tokenizer(tmp_path / "full")
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(tmp_path / "full" / "tokenizer_config.json", only)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(only))
    assert str(e.value) == (f"{only}: cannot load a tokenizer from tokenizer_config.json alone: expected "
                            "tokenizer.json or tokenizer.model or vocab.json next to it")
