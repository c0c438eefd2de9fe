"""What `fp8serve bench throughput` and `bench latency` share: the engine from the command's engine
flags, the random-prompt vocabulary, and the run's description for --output-json."""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from fp8serve.benchmarks.datasets import ordinary_token_ids
from fp8serve.config import EngineConfig
from fp8serve.entrypoints.engine_args import engine_kwargs
from fp8serve.entrypoints.llm import LLM
from fp8serve.errors import UserError


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.create(args.model, **engine_kwargs(args))


def check_fits(config: EngineConfig, total_len: int, what: str, max_model_len_flag: int | None) -> None:
    """Refuse before the weights load a workload whose longest request (prompt + output) the
    engine would refuse at the first request."""
    limit = config.model_config.max_model_len
    if total_len > limit:
        fix = (f"lower them or raise --max-model-len {max_model_len_flag}" if max_model_len_flag is not None
               else "lower them: that is the model's own limit")
        raise UserError(f"{what} = {total_len} tokens is more than the max_model_len {limit} of "
                        f"{config.model_config.model}; {fix}")


def random_pool(llm: LLM) -> list[int]:
    engine = llm.llm_engine
    return ordinary_token_ids(engine.config.model_config.arch.vocab_size, engine.tokenizer,
                              set(engine.eos_token_ids))


def describe_run(llm: LLM, args: argparse.Namespace) -> dict:
    """The engine as it ran (flags resolved: dtype, KV cache dtype and blocks) and the machine."""
    runner = llm.llm_engine.model_runner
    config = llm.llm_engine.config
    return {
        "model": config.model_config.model,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": runner.kv_cache_spec.kv_cache_dtype,
        "quantization": args.quantization,
        "num_blocks": runner.num_blocks,
        "block_size": config.cache_config.block_size,
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "device": str(config.model_config.torch_device),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
    }


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
