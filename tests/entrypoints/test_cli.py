"""`fp8serve` CLI: works on a tiny checkpoint; user errors are one line on stderr, no traceback.

The subprocess cases run concurrently, each paying ~2 s of interpreter and torch start-up
(~4 s when it loads the model). Error cases that need a loaded model, and further flags, call
`cli.main` in-process instead: there a leaked exception, the in-process traceback, fails the test.
"""

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from checkpoints import write_tiny_llama
from cli_runs import run_main

from fp8serve.entrypoints import cli

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog again and again and again"
# float32 skips the bf16-vs-fp32 timing of dtype=auto; a small budget skips sizing from free RAM.
LIGHT = ["--dtype", "float32", "--kv-cache-memory", "2MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("cli") / "llama"))


def subprocess_cases(model: str, missing: str) -> dict[str, list[str]]:
    return {
        "help": ["--help"],
        "generate": ["generate", "--model", model, *LIGHT, "--prompt", "The capital of France is",
                     "--prompt", "Once upon a time", "--max-tokens", "4"],
        "missing_model": ["generate", "--model", missing, "--prompt", "hi"],
        "negative_temperature": ["generate", "--model", model, *LIGHT, "--prompt", "hi", "--temperature", "-1"],
        "unknown_kv_cache_dtype": ["generate", "--model", model, *LIGHT, "--prompt", "hi",
                                   "--kv-cache-dtype", "fp9"],
    }


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    missing = str(tmp_path_factory.mktemp("cli-missing") / "no-such-model")
    cases = subprocess_cases(model_dir, missing)

    def run(args):
        return subprocess.run([sys.executable, "-m", "fp8serve.entrypoints.cli", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = {name: pool.submit(run, args) for name, args in cases.items()}
        out = {name: f.result() for name, f in futures.items()}
    out["_missing"] = missing
    return out


def error_line(stderr: str) -> str:
    """The one line that reports the error; INFO log lines before it are fine."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    return lines[0]


def test_help_lists_the_subcommands(results):
    r = results["help"]
    assert r.returncode == 0, r.stderr
    assert "usage: fp8serve" in r.stdout
    assert re.search(r"^\s+generate\s", r.stdout, re.MULTILINE)
    assert re.search(r"^\s+convert-gguf\s", r.stdout, re.MULTILINE)


def test_generate_prints_the_outputs(results):
    r = results["generate"]
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "Prompt: 'The capital of France is'" in r.stdout
    assert "Prompt: 'Once upon a time'" in r.stdout
    outputs = re.findall(r"^Output: .*\[(\d+) tokens, (\w+)\]$", r.stdout, re.MULTILINE)
    assert len(outputs) == 2
    for num_tokens, reason in outputs:
        # At most --max-tokens; fewer only if the model chose to stop.
        assert (int(num_tokens), reason) == (4, "length") or (int(num_tokens) <= 4 and reason == "stop")


def test_missing_model_path(results):
    r = results["missing_model"]
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert results["_missing"] in line and "does not exist" in line


def test_negative_temperature(results):
    r = results["negative_temperature"]
    # SamplingParams raises InvalidParameterError: a ValueError (as in vLLM) and a UserError.
    line = error_line(r.stderr)
    assert r.returncode == 2
    assert "temperature" in line and "-1" in line


def test_unknown_kv_cache_dtype(results):
    r = results["unknown_kv_cache_dtype"]
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert "--kv-cache-dtype" in line and "'fp9'" in line and "fp8_e4m3" in line


# ------------------------------------------------------------------------------- in-process


def case(extra: list[str], expected: list[str]):
    return pytest.param(extra, expected, id=" ".join(extra))


def test_prompt_longer_than_max_model_len(model_dir, capsys):
    argv = ["generate", "--model", model_dir, *LIGHT, "--max-model-len", "8", "--prompt", LONG_PROMPT]
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and out == ""
    line = error_line(err)
    assert "--max-model-len 8" in line and "prompt" in line


def test_kv_cache_too_small(model_dir, capsys):
    argv = ["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "hi", "--kv-cache-memory", "1KiB"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    line = error_line(err)
    assert "--kv-cache-memory" in line and "1.00 KiB" in line and "0 blocks" in line
    assert "use --kv-cache-dtype fp8" in line
    # Already FP8: that remedy is not offered again.
    rc, _, err = run_main([*argv, "--kv-cache-dtype", "fp8"], capsys)
    assert rc == 2
    line = error_line(err)
    assert "0 blocks" in line and "--kv-cache-dtype fp8" not in line


def test_kv_cache_larger_than_the_machine(model_dir, capsys):
    argv = ["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "hi", "--kv-cache-memory", "4096TiB"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    assert "of memory available on this machine" in error_line(err)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--port", "99999"], "--port must be in 0..65535, got 99999"),
        (["--port=-1"], "--port must be in 0..65535, got -1"),
        (["--stall-timeout=-5"], "--stall-timeout must be a finite number of seconds > 0"),
        (["--shutdown-timeout=-1"], "--shutdown-timeout must be a finite number of seconds >= 0"),
        (["--max-request-body-size", "0"], "--max-request-body-size must be at least 1 byte"),
        (["--model", "/elsewhere"], "two models given"),
        (["--uvicorn-log-level", "bogus"], "invalid choice: 'bogus'"),
        (["--served-model-name", "a", "b", "a"], "--served-model-name: 'a' given twice; give distinct"),
        (["--served-model-name", " "], "--served-model-name: an empty name"),
    ],
)
def test_serve_flags_are_checked_before_the_model_loads(model_dir, capsys, extra, expected):
    rc, _, err = run_main(["serve", model_dir, *extra], capsys)
    assert rc == 2
    # (argparse's own usage line lists "error" among the log levels: no error_line here)
    assert expected in err and "Traceback" not in err


def test_a_tokenizer_transformers_rejects_is_one_line(model_dir, tmp_path, capsys):
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(model_dir, d)
    (d / "tokenizer.json").write_text("{not json")
    rc, _, err = run_main(["generate", "--model", str(d), *LIGHT, "--prompt", "hi"], capsys)
    assert rc == 2
    assert "transformers cannot load the tokenizer" in error_line(err)


def test_generate_help_lists_the_engine_flags(capsys):
    rc, out, _ = run_main(["generate", "--help"], capsys)
    assert rc == 0
    for flag in ("--model", "--prompt", "--max-tokens", "--temperature", "--kv-cache-dtype",
                 "--kv-cache-memory", "--max-model-len", "--block-size"):
        assert flag in out


def test_no_subcommand_prints_help(capsys):
    rc, out, _ = run_main([], capsys)
    assert rc == 2 and "generate" in out


@pytest.mark.parametrize(
    "extra, expected",
    [
        case(["--max-tokens", "0"], ["max_tokens", "0"]),
        case(["--top-p", "0"], ["top_p", "0"]),
        case(["--top-k", "-5"], ["top_k", "-5"]),
        case(["--kv-cache-memory", "lots"], ["--kv-cache-memory", "'lots'"]),
        case(["--block-size", "3"], ["--block-size", "3"]),
        case(["--max-model-len", "1000"], ["--max-model-len 1000", "max_position_embeddings (256)"]),
        case(["--max-model-len", "32", "--max-num-batched-tokens", "16"], ["--max-num-batched-tokens (16)"]),
        case(["--max-num-seqs", "0"], ["--max-num-seqs", "0"]),
        case(["-tp", "2"], ["--tensor-parallel-size 2"]),
        case(["--device", "tpu"], ["--device", "'tpu'"]),
        case(["--prompt", ""], ["empty"]),
    ],
)
def test_bad_values_are_one_line(model_dir, capsys, extra, expected):
    argv = ["generate", "--model", model_dir, *LIGHT, "--prompt", "hi", *extra]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    line = error_line(err)
    for text in expected:
        assert text in line


def test_directory_without_config_json(tmp_path, capsys):
    rc, _, err = run_main(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert rc == 2
    assert "config.json not found" in error_line(err)


@pytest.mark.parametrize("env, value, level", [
    ("FP8SERVE_LOGGING_LEVEL", "warning", "WARNING"),
    ("FP8SERVE_LOG_LEVEL", "ERROR", "ERROR"),
])
def test_log_level_default_comes_from_the_environment(monkeypatch, env, value, level):
    """FP8SERVE_LOGGING_LEVEL (what the Python API reads, vLLM's VLLM_LOGGING_LEVEL) sets the
    CLI's default too; FP8SERVE_LOG_LEVEL, the older spelling, still works."""
    for name in ("FP8SERVE_LOGGING_LEVEL", "FP8SERVE_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, value)
    assert cli.build_parser().parse_args(["scales"]).log_level == level
    assert cli.build_parser().parse_args(["--log-level", "debug", "scales"]).log_level == "DEBUG"


def test_a_bad_log_level_in_the_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("FP8SERVE_LOGGING_LEVEL", "LOUD")
    rc, _, err = run_main(["scales"], capsys)
    assert rc == 2 and "FP8SERVE_LOGGING_LEVEL / FP8SERVE_LOG_LEVEL: 'LOUD' is not one of" in err


def test_generate_takes_unset_sampling_flags_from_the_generation_config(model_dir, tmp_path, capsys):
    """As serve does: the model's generation_config.json (temperature 1, top_k 5,
    max_new_tokens 6) fills the flags left unset, caps --max-tokens, and a flag given wins."""
    import json
    import shutil

    from fp8serve import LLM, SamplingParams

    d = tmp_path / "llama"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    config.update(temperature=1.0, top_k=5, max_new_tokens=6)
    (d / "generation_config.json").write_text(json.dumps(config))
    prompt = "The capital of France is"

    def generate(*extra):
        rc, out, _ = run_main(["generate", "--model", str(d), *LIGHT, "--json", "--prompt", prompt, *extra], capsys)
        assert rc == 0
        return json.loads(out.strip().splitlines()[-1])["token_ids"]

    llm = LLM(str(d), dtype="float32", kv_cache_memory="2MiB")
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=0),
                           use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, seed=0),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert sampled != greedy  # else this test could not tell the two apart
    assert generate() == sampled
    assert generate("--max-tokens", "40") == sampled  # max_new_tokens caps the flag
    assert generate("--temperature", "0") == greedy
    # --generation-config vllm: the command's own defaults (greedy), 3 tokens as asked
    assert generate("--generation-config", "vllm", "--max-tokens", "3") == greedy[:3]
    over = generate("--override-generation-config", '{"max_new_tokens": 2}')
    assert over == sampled[:2]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if the engine starts loading weights."""
    import fp8serve.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "ModelRunner", lambda *a, **k: pytest.fail("the weights started loading"))


def test_quantization_flag_on_a_quantized_checkpoint_is_refused_before_loading(model_dir, tmp_path, capsys,
                                                                                no_model_loads):
    """-q fp8 on a compressed-tensors (FP8 weights) checkpoint ran it without a word about the flag."""
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    ct = tmp_path / "ct"
    write_fp8_checkpoint(model_dir, ct, activation_scheme="dynamic", weight_strategy="channel")
    rc, _, err = run_main(["generate", "--model", str(ct), *LIGHT, "--prompt", "hi", "-q", "fp8"], capsys)
    assert rc == 2
    line = error_line(err)
    assert (f"--quantization fp8 does not match the checkpoint: {ct / 'config.json'} declares "
            "quantization_config.quant_method 'compressed-tensors'") in line, line


def test_generate_without_tokenizer_files_names_the_flag_before_loading(tmp_path, capsys, no_model_loads):
    """generate's prompts are text: a checkpoint without tokenizer files loaded its weights first, then
    said to pass prompt_token_ids, which the command has no flag for."""
    bare = write_tiny_llama(tmp_path / "bare", with_tokenizer=False)
    rc, _, err = run_main(["generate", "--model", str(bare), *LIGHT, "--prompt", "hi"], capsys)
    assert rc == 2
    line = error_line(err)
    assert f"{bare} has no tokenizer files (tokenizer.json, " in line and "pass --tokenizer DIR" in line, line


def test_generate_with_the_tokenizer_flag_on_a_file_says_so(model_dir, tmp_path, capsys, no_model_loads):
    bare = write_tiny_llama(tmp_path / "bare", with_tokenizer=False)
    tok_file = Path(model_dir) / "tokenizer.json"
    rc, _, err = run_main(["generate", "--model", str(bare), "--tokenizer", str(tok_file), *LIGHT, "--prompt", "hi"],
                          capsys)
    assert rc == 2
    line = error_line(err)
    assert f"--tokenizer '{tok_file}': is a file, not a directory" in line and "no such directory" not in line, line


def test_generate_chat_without_a_chat_template_is_refused_before_loading(model_dir, tmp_path, capsys,
                                                                          no_model_loads):
    """--chat with a tokenizer that has no chat template: found after the weights loaded, before."""
    import json
    import shutil

    d = tmp_path / "no-template"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config.pop("chat_template", None) is not None  # else this test shows nothing
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    rc, _, err = run_main(["generate", "--model", str(d), *LIGHT, "--chat", "--prompt", "hi"], capsys)
    assert rc == 2 and f"{d} has no chat template for --chat" in error_line(err)
    # The template comes from --tokenizer: a model directory with one does not help.
    rc, _, err = run_main(["generate", "--model", model_dir, "--tokenizer", str(d), *LIGHT, "--chat",
                           "--prompt", "hi"], capsys)
    assert rc == 2 and f"--tokenizer {d} has no chat template for --chat" in error_line(err)
