"""`fp8serve bench throughput`: offline throughput of the engine, as vLLM's `vllm bench throughput`.

Every request is queued at once and the engine runs until all finish; the time is that of the
whole `LLM.generate` call. The sampling is vLLM's for this benchmark: temperature 1, top-p 1,
`ignore_eos`, so each request generates exactly its output length (`--n` samples of it).

Datasets (`--dataset-name`):
- `random` (the default without `--dataset-path`): `--num-prompts` prompts of `--input-len` token
  ids drawn from the ordinary vocabulary (after a shared `--random-prefix-len` prefix), each to
  generate `--output-len` tokens; `--random-range-ratio r` draws each length uniformly from
  [len * (1 - r), len * (1 + r)].
- `sharegpt`: conversations from the ShareGPT JSON file at `--dataset-path`, the first turn the
  prompt and the reply's length the output length (`--output-len` overrides it), filtered as vLLM
  does (prompt and reply >= 4 tokens, prompt <= 1024, prompt + output <= 2048).
"""

from __future__ import annotations

import argparse
import logging
import time

from fp8serve.benchmarks.datasets import (
    check_range_ratio,
    load_sharegpt,
    max_random_total_len,
    random_requests,
    sharegpt_requests,
)
from fp8serve.benchmarks.offline import (
    check_fits,
    describe_run,
    engine_config,
    random_pool,
    write_json,
)
from fp8serve.benchmarks.serve import non_negative_int, output_path_arg, parse_args_of, positive_int
from fp8serve.entrypoints.engine_args import add_engine_args
from fp8serve.errors import UserError

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "sharegpt")
# vLLM's default is 1000 prompts; this many keep the default run near a minute on two CPU cores
# (the default model at 512 + 128 tokens), and the table's shape is the same.
DEFAULT_NUM_PROMPTS = 64


def parse_range_ratio(text: str) -> float:
    try:
        ratio = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    check_range_ratio(ratio)
    return ratio


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                   help="random (default without --dataset-path) or sharegpt (the default with one)")
    g.add_argument("--dataset-path", default=None, metavar="FILE", help="a ShareGPT JSON file")
    g.add_argument("--num-prompts", type=positive_int, default=DEFAULT_NUM_PROMPTS,
                   help=f"requests (default {DEFAULT_NUM_PROMPTS}; vLLM's is 1000)")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=None,
                   help="random: prompt tokens per request (default 512)")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=None,
                   help="tokens to generate per request (random: default 128; sharegpt: default the reply's "
                        "length)")
    g.add_argument("--random-range-ratio", type=parse_args_of(parse_range_ratio), default=0.0,
                   help="random: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0: exact)")
    g.add_argument("--random-prefix-len", "--prefix-len", dest="random_prefix_len", type=non_negative_int,
                   default=0, help="random: tokens of one random prefix shared by every prompt")


def register(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput: a batch of requests through the engine",
                              description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    add_dataset_args(p)
    p.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="token ids only: leave the detokenizer out of the timed run")
    p.add_argument("--output-json", type=output_path_arg, default=None, metavar="FILE",
                   help="write the results here (vLLM's fields, and the engine's configuration)")
    p.set_defaults(func=run)


def dataset_name(args: argparse.Namespace) -> str:
    """vLLM's rule: no --dataset-path means the random dataset; a path means ShareGPT unless told."""
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if name == "sharegpt" and not args.dataset_path:
        raise UserError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
    if name == "random":
        if args.dataset_path:
            logger.warning("--dataset-path %s is not read: --dataset-name random makes its own prompts",
                           args.dataset_path)
    else:
        for flag, value in (("--input-len", args.input_len), ("--random-prefix-len", args.random_prefix_len or None),
                            ("--random-range-ratio", args.random_range_ratio or None)):
            if value is not None:
                raise UserError(f"{flag} is for --dataset-name random; sharegpt's prompts are the conversations' "
                                "first turns")
    return name


def run(args: argparse.Namespace) -> int:
    from fp8serve import LLM, SamplingParams

    name = dataset_name(args)
    pairs = load_sharegpt(args.dataset_path) if name == "sharegpt" else None  # a bad file before the weights load
    config = engine_config(args)
    input_len = args.input_len or 512
    output_len = args.output_len or 128
    if name == "random":
        what = " + ".join(["--random-prefix-len"] * bool(args.random_prefix_len) + ["--input-len", "--output-len"])
        if args.random_range_ratio:
            what = f"the longest request of {what} at --random-range-ratio {args.random_range_ratio:g}"
        check_fits(config, max_random_total_len(input_len, output_len, args.random_range_ratio,
                                                args.random_prefix_len), what, args.max_model_len)
    if name == "sharegpt":
        from fp8serve.engine.tokenizer import has_tokenizer_files

        mc = config.model_config
        if not has_tokenizer_files(mc.tokenizer or mc.model):
            raise UserError(f"{mc.tokenizer or mc.model} has no tokenizer files to tokenize the ShareGPT "
                            "conversations with: pass --tokenizer DIR")
    llm = LLM.from_engine_config(config)
    if name == "random":
        requests = random_requests(random_pool(llm), args.num_prompts, input_len, output_len,
                                   args.random_range_ratio, args.random_prefix_len, args.seed)
    else:
        requests = sharegpt_requests(pairs, llm.llm_engine.tokenizer, args.num_prompts, args.seed,
                                     args.output_len, config.model_config.max_model_len)
        if not requests:
            raise UserError(f"--dataset-path {args.dataset_path}: none of its {len(pairs)} conversations passes the "
                            "filter (prompt and reply >= 4 tokens, prompt <= 1024, prompt + output <= 2048 and <= "
                            "max_model_len)")
        if len(requests) < args.num_prompts:
            logger.warning("--dataset-path %s: %d conversations pass the filter, fewer than --num-prompts %d",
                           args.dataset_path, len(requests), args.num_prompts)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len,
                             detokenize=not args.disable_detokenize)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    result = summarize(outputs, elapsed)
    print(format_result(result))
    if args.output_json:
        write_json(args.output_json, {**result, "dataset_name": name, "n": args.n,
                                      "disable_detokenize": args.disable_detokenize, "config": describe_run(llm, args)})
    return 0


def summarize(outputs, elapsed: float) -> dict:
    """vLLM's fields (elapsed_time, num_requests, total_num_tokens, requests_per_second,
    tokens_per_second), with the prompt and output token counts apart. Counts are of what ran:
    each request's prompt once, every sample's generated tokens."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def format_result(r: dict) -> str:
    """vLLM's three lines."""
    return (f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
            f"{r['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {r['total_num_prompt_tokens']}\n"
            f"Total num output tokens:  {r['total_num_output_tokens']}")
