"""Environment switches of the form auto / 1 / 0 (the packed weight copies'
FP8SERVE_*_PACKED_WEIGHTS): one parser, one error wording."""

from __future__ import annotations

import os

from fp8serve.errors import ConfigError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str) -> bool | None:
    """True / False where the environment variable `name` forces a choice,
    None for `auto` (or unset): the caller decides. Anything else is a
    ConfigError naming the variable, its value and the accepted values."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value != "auto":
        raise ConfigError(f"environment variable {name}={value!r}: expected auto, 1 or 0")
    return None
