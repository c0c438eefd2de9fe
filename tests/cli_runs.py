"""`fp8serve ARGV` in-process for tests: its exit status (argparse's SystemExit included) and what it
printed. In-process, a leaked exception fails the test with its traceback. And what the engines a
command built were made of."""

from __future__ import annotations

from fp8serve.entrypoints import cli


def run_main(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def count_fp8_layers_of_built_llms(monkeypatch) -> list[int]:
    """Patch fp8serve.LLM (the CLI's tools look it up when they build an engine: `calibrate` and
    `eval-kv` through fp8serve.calibration.runner.build_llm, `compare` itself) so that each LLM
    built appends to the returned list how many of its modules run FP8 weights."""
    import fp8serve

    real_llm = fp8serve.LLM
    counts: list[int] = []

    def llm(*args, **kwargs):
        engine = real_llm(*args, **kwargs)
        modules = engine.llm_engine.model_runner.model.modules()
        counts.append(sum(getattr(m, "fp8_backend", None) is not None for m in modules))
        return engine

    monkeypatch.setattr(fp8serve, "LLM", llm)
    return counts
