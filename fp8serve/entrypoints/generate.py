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
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


# Completion-style prompts (use --chat for instructions).
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a small village by the sea,",
]


def run(args: argparse.Namespace) -> int:
    from fp8serve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, **engine_kwargs(args))
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
