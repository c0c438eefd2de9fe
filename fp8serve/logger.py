"""fp8serve's log output: one handler on the `fp8serve` logger, so library
users see the start-up lines (KV cache size, scale sources) without setting
up logging themselves. `FP8SERVE_CONFIGURE_LOGGING=0` turns this off and
`FP8SERVE_LOGGING_LEVEL` sets the level (default INFO)."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_default_logging() -> None:
    if os.environ.get("FP8SERVE_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("fp8serve")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("FP8SERVE_LOGGING_LEVEL", "INFO").upper())


def set_level(level: str) -> None:
    logging.getLogger("fp8serve").setLevel(level.upper())
