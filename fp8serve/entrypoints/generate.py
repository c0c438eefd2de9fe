"""`fp8serve generate`: run prompts through the engine and print the outputs."""

from __future__ import annotations

import argparse
import json

from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description="Generate text for one or more prompts.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for several); default: a few example prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    # Unset sampling flags take the model's generation config (--generation-config,
    # --override-generation-config) as serve does, then this command's own defaults.
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per prompt (default {OWN_DEFAULTS['max_tokens']}; the generation config's "
                        "max_new_tokens caps it)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the generation config's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: the generation config's, else 0 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the generation config's, else 0.0")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the generation config's, else 1.0 (none)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


# What an unset flag means when the generation config does not set the field either.
OWN_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0}


def sampling_params(args: argparse.Namespace, defaults: dict):
    """The flags given, else `defaults` (ModelConfig.default_sampling_params), else
    OWN_DEFAULTS; the generation config's max_new_tokens bounds max_tokens, as in serve."""
    from fp8serve import SamplingParams

    fields = {}
    for field, own in OWN_DEFAULTS.items():
        given = getattr(args, field)
        fields[field] = given if given is not None else defaults.get(field, own)
    cap = defaults.get("max_tokens")
    if args.max_tokens is not None and cap is not None:
        fields["max_tokens"] = min(args.max_tokens, cap)
    return SamplingParams(**fields, seed=args.seed)


# Completion-style prompts (use --chat for instructions).
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a small village by the sea,",
]


def check_tokenizer(args: argparse.Namespace) -> None:
    """The prompts here are text: a model directory without tokenizer files is refused before its
    weights load, naming the flag that fixes it (the engine alone can only say so at the first prompt)."""
    from pathlib import Path

    from fp8serve.engine.tokenizer import TOKENIZER_FILES, has_tokenizer_files
    from fp8serve.errors import UserError

    # --tokenizer is checked by ModelConfig; a directory without config.json gets the engine's own error.
    if args.model is None or args.tokenizer is not None or not (Path(args.model) / "config.json").is_file():
        return
    if not has_tokenizer_files(args.model):
        raise UserError(f"{args.model} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) to tokenize the "
                        "prompts with: pass --tokenizer DIR, a local directory holding them")


def check_chat_template(args: argparse.Namespace) -> None:
    """--chat needs the tokenizer's chat template: a tokenizer without one is refused before the
    weights load (loading the tokenizer alone takes well under a second)."""
    from fp8serve.engine.tokenizer import has_tokenizer_files, load_tokenizer
    from fp8serve.errors import UserError

    if not args.chat or args.model is None:
        return  # the built-in model has a template
    source = args.tokenizer if args.tokenizer is not None else args.model
    if not has_tokenizer_files(source):
        return  # check_tokenizer and ModelConfig name what is missing
    if load_tokenizer(source).chat_template is None:
        flag = f"--tokenizer {source}" if args.tokenizer is not None else source
        raise UserError(f"{flag} has no chat template for --chat: drop --chat to send the prompts as they are")


def run(args: argparse.Namespace) -> int:
    from fp8serve import LLM

    sampling_params(args, {})  # a bad flag is refused before the model loads
    check_tokenizer(args)
    check_chat_template(args)
    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args, llm.llm_engine.config.model_config.default_sampling_params)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(f"Prompt: {prompt!r}\nOutput: {c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]\n")
    return 0
