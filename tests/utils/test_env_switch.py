"""env_switch: auto / 1 / 0 environment switches, and a clear error for anything else."""

from __future__ import annotations

import pytest

from fp8serve.errors import ConfigError
from fp8serve.utils.env_switch import env_switch

NAME = "FP8SERVE_TEST_SWITCH"


@pytest.mark.parametrize("value, wanted", [("1", True), ("on", True), (" TRUE ", True), ("yes", True),
                                           ("0", False), ("off", False), ("No", False), ("false", False),
                                           ("auto", None), ("AUTO", None)])
def test_values(monkeypatch, value, wanted):
    monkeypatch.setenv(NAME, value)
    assert env_switch(NAME) is wanted


def test_unset_is_auto(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_switch(NAME) is None


def test_anything_else_names_the_variable(monkeypatch):
    monkeypatch.setenv(NAME, "sometimes")
    with pytest.raises(ConfigError, match="FP8SERVE_TEST_SWITCH='sometimes': expected auto, 1 or 0"):
        env_switch(NAME)
