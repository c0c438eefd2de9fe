"""The engine flags every command shares: vLLM's names, reaching the engine's keyword arguments."""

import argparse

from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs


def parse(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(list(argv)))


def test_enable_prefix_caching_both_spellings():
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse()["enable_prefix_caching"] is False


def test_every_flag_reaches_the_engine_config():
    """engine_kwargs' keys are EngineConfig.create's parameters: a flag added to one and not the other fails here."""
    import inspect

    from fp8serve.config import EngineConfig

    params = set(inspect.signature(EngineConfig.create).parameters) - {"cls", "model"}
    assert set(parse()) == params
