"""`fp8serve bench sweep`: what it checks before starting any server, and how it reports one that exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from checkpoints import write_tiny_llama
from fp8serve.benchmarks.sweep import WORKLOADS, check_server_flags, log_error, server_command, wait_healthy
from fp8serve.entrypoints.cli import build_parser, main
from fp8serve.errors import UserError


def _sweep(capsys, tmp_path, *argv: str) -> tuple[int, str]:
    """`fp8serve bench sweep ARGV --out-dir TMP/out`: its exit status and stderr, and no server started
    (the output folder, made before the first server starts, is not there)."""
    capsys.readouterr()
    try:
        code = main(["bench", "sweep", *argv, "--out-dir", str(tmp_path / "out")])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "starting:" not in captured.out
    assert not (tmp_path / "out").exists()
    return code, captured.err


@pytest.mark.parametrize("configs, message", [
    ("default@bogus", "--configs entry 'default@bogus': KV cache dtype 'bogus' is not one of auto, fp8, fp8_e4m3, "
                      "fp8_e5m2, bfloat16, float16, float32"),
    ("default@fp8,@fp8", "--configs entry '@fp8': no MODEL before '@' (use 'default' for the built-in model)"),
    ("{d}/nowhere@fp8", "--configs entry '{d}/nowhere@fp8': model path '{d}/nowhere' does not exist"),
    ("", "--configs '' names no configuration (expected comma-separated MODEL@KVDTYPE, e.g. "
         "default@auto,default@bfloat16,default@fp8)"),
    (" , ", "--configs ' , ' names no configuration")])
def test_sweep_checks_every_config_before_starting_a_server(tmp_path, capsys, configs, message):
    code, err = _sweep(capsys, tmp_path, "--configs", configs.format(d=tmp_path))
    assert code == 2 and err.startswith(f"error: {message.format(d=tmp_path)}")


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory 'lots': cannot parse size 'lots'"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory '0': must be more than 0 bytes"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config: method 'eagle' is not supported"),
    (["--speculative-config", "{"], "--speculative-config must be a JSON object"),
    (["--enable-chunked-prefill", "--max-num-batched-tokens", "8"],
     "--max-num-batched-tokens (8) must be at least --max-num-seqs (128) with --enable-chunked-prefill")])
def test_sweep_checks_the_server_flags_before_starting_a_server(tmp_path, capsys, argv, message):
    code, err = _sweep(capsys, tmp_path, "--configs", "default@fp8", *argv)
    assert code == 2 and err.startswith(f"error: {message}")


@pytest.mark.parametrize("argv, message", [
    (["--startup-timeout", "-1"], "argument --startup-timeout: must be > 0, got -1"),
    (["--startup-timeout", "0"], "argument --startup-timeout: must be > 0, got 0"),
    (["--startup-timeout", "nan"], "argument --startup-timeout: must be > 0, got nan"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--num-prompts", "-4"], "argument --num-prompts: must be >= 1, got -4"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be >= 1, got 0"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["-q", "awq"], "argument --quantization/-q: invalid choice: 'awq' (choose from 'fp8')")])
def test_sweep_rejects_bad_numbers_at_parsing(tmp_path, capsys, argv, message):
    code, err = _sweep(capsys, tmp_path, *argv)
    assert code == 2 and f"fp8serve bench sweep: error: {message}" in err


def test_sweep_num_prompts_defaults_to_the_workload():
    parser = build_parser()
    assert parser.parse_args(["bench", "sweep"]).num_prompts is None
    assert parser.parse_args(["bench", "sweep", "--num-prompts", "3"]).num_prompts == 3


def test_sweep_checks_the_out_dir_before_starting_a_server(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for out_dir, message in ((tmp_path / "file", f"--out-dir '{tmp_path}/file' is a file, not a folder"),
                             (tmp_path / "file" / "a" / "b",
                              f"--out-dir '{tmp_path}/file/a/b': '{tmp_path}/file' is a file, not a folder")):
        capsys.readouterr()
        assert main(["bench", "sweep", "--out-dir", str(out_dir)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"error: {message}\n" and "starting:" not in captured.out


def test_sweep_max_model_len(tmp_path, capsys):
    """The workloads' max_model_len is the setting of their published results, not a need of theirs:
    --max-num-batched-tokens below it says so and how to lower it, and --max-model-len lowers it to as little
    as the prompt and output take."""
    code, err = _sweep(capsys, tmp_path, "--max-num-batched-tokens", "256")
    assert code == 2
    assert err == ("error: --max-num-batched-tokens (256) is smaller than --max-model-len (512) (workload 'cpu' runs "
                   "its servers with --max-model-len 512, the setting of its published results; it needs 160, so "
                   "--max-model-len 160 also works): without --enable-chunked-prefill a whole prompt is one step, so "
                   "raise it, lower --max-model-len, or add --enable-chunked-prefill\n")
    code, err = _sweep(capsys, tmp_path, "--max-model-len", "159")
    assert code == 2
    assert err == "error: --max-model-len 159 is less than the 128 input + 32 output tokens of workload 'cpu' (160)\n"

    args = build_parser().parse_args(["bench", "sweep", "--max-num-batched-tokens", "256", "--max-model-len", "160"])
    check_server_flags(dict(WORKLOADS["cpu"]), args)  # accepted
    cmd = server_command("default", "fp8", WORKLOADS["cpu"], args, 8125)
    assert cmd[cmd.index("--max-model-len") + 1] == "160"
    # Without the flag: the workload's, as before.
    cmd = server_command("default", "fp8", WORKLOADS["cpu"], build_parser().parse_args(["bench", "sweep"]), 8125)
    assert cmd[cmd.index("--max-model-len") + 1] == "512"


def test_log_error_finds_the_servers_message(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO 12-05 [x] loading\nerror: KV cache of 1.00 MiB holds 2 blocks\n\n")
    assert log_error(log) == "KV cache of 1.00 MiB holds 2 blocks"
    log.write_text("usage: fp8serve serve [-h]\nfp8serve serve: error: argument --kv-cache-dtype: invalid choice\n")
    assert log_error(log) == "argument --kv-cache-dtype: invalid choice"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom\nINFO shutdown\n")
    assert log_error(log) == "RuntimeError: boom"
    log.write_text("INFO only this\n")
    assert log_error(log) == "INFO only this"
    assert log_error(tmp_path / "missing.log") == ""


def test_wait_healthy_quotes_the_log_of_a_server_that_exits(tmp_path):
    log_path = tmp_path / "server.log"
    script = "import sys; print('INFO starting'); print('error: the reason', file=sys.stderr); sys.exit(2)"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    proc.wait()
    with pytest.raises(UserError) as e:
        wait_healthy("http://127.0.0.1:9", proc, 30, log_path)
    assert str(e.value) == f"server exited with 2 before becoming healthy: the reason (log: {log_path})"


def test_sweep_reports_a_server_that_exits_in_one_line(tmp_path, capsys):
    """A KV budget below one request of --max-model-len is only found by the server (it needs the model's
    geometry): the sweep stops with the server's own message and its log, exit status 2."""
    model_dir = write_tiny_llama(tmp_path / "llama")
    capsys.readouterr()
    code = main(["bench", "sweep", "--configs", f"{model_dir}@auto", "--kv-cache-memory", "1KiB", "--dtype", "float32",
                 "--max-model-len", "200", "--out-dir", str(tmp_path / "out"), "--startup-timeout", "300"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    log_path = tmp_path / "out" / "server_0_auto.log"
    assert err.startswith(f"error: [{model_dir}@auto] server exited with 2 before becoming healthy: KV cache of ")
    assert err.endswith(f"(log: {log_path})\n") and "--max-model-len 200 needs" in err


def test_sweep_passes_quantization_to_every_server(tmp_path):
    """-q fp8 reaches each server's command line, which serve's own parser takes; the table's Model dtype
    column reads the server's weights from its "Loaded" line, which names FP8 weights made at load."""
    from fp8serve.benchmarks.sweep import _weights_dtype

    parser = build_parser()
    cmd = server_command("default", "auto", WORKLOADS["cpu"], parser.parse_args(["bench", "sweep", "-q", "fp8"]), 8125)
    assert cmd[cmd.index("--quantization") + 1] == "fp8"
    assert parser.parse_args(cmd[3:]).quantization == "fp8"
    cmd = server_command("default", "auto", WORKLOADS["cpu"], parser.parse_args(["bench", "sweep"]), 8125)
    assert "--quantization" not in cmd and parser.parse_args(cmd[3:]).quantization is None
    log = tmp_path / "server.log"
    for weights in ("float32", "fp8", "fp8 (quantized at load)", "bfloat16 (float32 compute)"):
        log.write_text(f"INFO 12-05 08:57:07 [fp8serve.engine.model_runner] Loaded /m (LlamaForCausalLM, {weights} "
                       "weights) in 0.1 s\nINFO 12-05 08:57:07 [x] Attention backend: cpu_paged (C++ decode)\n")
        assert _weights_dtype(log) == weights


def test_sweep_servers_load_fp8_weights_with_quantization(tmp_path, capsys):
    """End to end: the server the sweep starts with -q fp8 quantizes the weights at load (its log says so)
    before it stops at the KV budget, as in test_sweep_reports_a_server_that_exits_in_one_line."""
    model_dir = write_tiny_llama(tmp_path / "llama")
    capsys.readouterr()
    code = main(["bench", "sweep", "--configs", f"{model_dir}@auto", "--kv-cache-memory", "1KiB", "--dtype", "float32",
                 "--max-model-len", "200", "--out-dir", str(tmp_path / "out"), "--startup-timeout", "300", "-q", "fp8"])
    out = capsys.readouterr().out
    assert code == 2
    assert out.startswith("workload 'cpu': ") and out.splitlines()[0].endswith(", --quantization fp8")
    log = (tmp_path / "out" / "server_0_auto.log").read_text()
    assert f"Loaded {model_dir} (LlamaForCausalLM, fp8 (quantized at load) weights)" in log


def test_wait_healthy_says_when_the_startup_timeout_runs_out(tmp_path):
    log_path = tmp_path / "server.log"
    log_path.write_text("INFO loading weights\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(UserError) as e:
            wait_healthy("http://127.0.0.1:9", proc, 0.5, log_path)
    finally:
        proc.kill()
        proc.wait()
    assert str(e.value) == (f"server not healthy after 0.5 s (--startup-timeout); the log's last message: "
                            f"INFO loading weights (log: {log_path})")


def test_sweep_table_shows_no_latency_for_a_config_without_successful_requests():
    from fp8serve.benchmarks.sweep import format_table

    table = format_table([{"model_dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "num_blocks": 8, "ttft_ms": None,
                           "itl_ms": None, "e2e_s": None, "output_throughput": 0.0}])
    assert "| float32 | fp8_e4m3 | 8 | - | - | - | - | - | - | - | - |" in table


def test_sweep_table_names_the_model_when_rows_span_several():
    """Two checkpoints with the same dtypes would be indistinguishable rows without a Model column;
    one model keeps the seed's columns."""
    from fp8serve.benchmarks.sweep import format_table

    row = {"model_dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "num_blocks": 8, "ttft_ms": 1.0,
           "itl_ms": 2.0, "e2e_s": 3.0, "output_throughput": 10.0}
    table = format_table([{**row, "model": "default"}, {**row, "model": "/ckpt/llama-fp8/", "output_throughput": 20.0}])
    assert table.splitlines()[0].startswith("| Model | Model dtype | KV dtype |")
    assert "| default | float32 | fp8_e4m3 | 8 | 1.0 | 2.0 | 3.0 | 10.0 | 1.00x |" in table
    assert "| llama-fp8 | float32 | fp8_e4m3 | 8 | 1.0 | 2.0 | 3.0 | 20.0 | 2.00x |" in table
    single = format_table([{**row, "model": "default"}, {**row, "model": "default"}])
    assert single.splitlines()[0].startswith("| Model dtype |")


def test_sweep_checks_quantization_against_each_checkpoint_before_starting_a_server(tmp_path, capsys):
    """-q fp8 goes to every server; a checkpoint quantized by another method refuses it at start-up,
    minutes into a sweep. Found before the first server instead, naming the entry."""
    from checkpoints import set_quantization_config
    from kv_scale_checkpoints import COMPRESSED_TENSORS_KV_ONLY

    model = write_tiny_llama(tmp_path / "ct")
    set_quantization_config(model, COMPRESSED_TENSORS_KV_ONLY)
    code, err = _sweep(capsys, tmp_path, "--configs", f"default@fp8,{model}@fp8", "-q", "fp8")
    assert code == 2 and err.startswith(f"error: --configs entry '{model}@fp8': --quantization fp8 does not match "
                                        "the checkpoint")
