"""`fp8serve ARGV` in-process for tests: its exit status (argparse's SystemExit included) and what it
printed. In-process, a leaked exception fails the test with its traceback."""

from __future__ import annotations

from fp8serve.entrypoints import cli


def run_main(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err
