"""Engine flags shared by every command that builds an engine, with vLLM's names."""

from __future__ import annotations

import argparse
import re

from fp8serve.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from fp8serve.quantization.registry import QUANTIZATION_METHODS

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's integer flags' syntax: plain digits, or a number with a suffix,
    lower case decimal (1k = 1000, 25.6k = 25600), upper case binary
    (1K = 1024, whole numbers only)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 4k (4000) or 4K (4096), got {text!r}")
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction needs a decimal suffix (k, m, g, t), e.g. "
                                         f"{number}k")
    return int(number) * _BINARY.get(suffix, 1)


def add_quantization_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, scope: str = "") -> None:
    """-q/--quantization (vLLM's), for every command that builds an engine: serve and generate
    through add_engine_args, and the tools that take a few engine flags of their own.
    `scope`: a sentence appended to the help where the flag applies to part of a command's runs."""
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                        help="quantize a 16/32-bit checkpoint's linear weights at load: fp8 = float8_e4m3 with a "
                             "per-tensor scale (vLLM's dynamic FP8; on CPU the fastest decode). FP8 checkpoints "
                             "need no flag" + (f". {scope}" if scope else ""))


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="Hugging Face checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None,
                            help="Hugging Face checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the tokenizer files (default: the model's directory; local only)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto = float32 on CPUs without fast bf16, the checkpoint's dtype on CUDA")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="KV cache storage; auto = compute dtype, fp8 = fp8_e4m3")
    add_quantization_arg(g)
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens) for requests that leave them unset: auto = the model's "
                        "generation_config.json (vLLM's default), vllm = none, or a directory holding one")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='defaults on top of --generation-config, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--quantization-param-path", default=None,
                   help="JSON with per-layer KV scales (vLLM schema), for 16-bit checkpoints")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="compute FP8 KV scales from the first prefill batch when none are supplied")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB, 2GiB (default: 1/4 of free RAM)")
    g.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None, metavar="BYTES",
                   help="vLLM's name for the same budget, in vLLM's syntax (4G = 4 GiB, 4g = 4e9 bytes); "
                        "give one of the two")
    g.add_argument("--max-model-len", type=human_readable_int, default=None,
                   help="longest prompt + output, in tokens (as in vLLM: 4096, 4k = 4000, 4K = 4096)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 is supported")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--enforce-eager", action="store_true",
                   help="always run the model eagerly (no recorded decode or prefill forwards; vLLM: no CUDA graphs)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse the KV cache of earlier requests' identical prompt prefixes (a shared system "
                        "prompt, a chat's earlier turns) instead of prefilling them again")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=False,
                   help="split long prompts into chunks of at most --max-num-batched-tokens (default 512 with "
                        "this flag) that run in the same steps as the running requests' decodes, so a long "
                        "prompt no longer stalls them; prompts may then be longer than that budget")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\': tokens that followed an earlier '
                        'occurrence of the sequence\'s last tokens are proposed and checked in one forward pass '
                        '(off by default)')
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for per position (-1: the vocabulary)")
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    from fp8serve.errors import UserError

    kv_cache_memory = args.kv_cache_memory
    if args.kv_cache_memory_bytes is not None:
        if kv_cache_memory is not None:
            raise UserError("give --kv-cache-memory or --kv-cache-memory-bytes, not both")
        kv_cache_memory = args.kv_cache_memory_bytes
    return dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        tokenizer=args.tokenizer,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        quantization_param_path=args.quantization_param_path,
        calculate_kv_scales=args.calculate_kv_scales,
        kv_cache_memory=kv_cache_memory,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        device=args.device,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        speculative_config=args.speculative_config,
        max_logprobs=args.max_logprobs,
    )
