"""`fp8serve compare`: greedy outputs of model x KV cache configurations, side by side.

The seed PR's sanity check: eight chat prompts, a few greedy tokens each,
for a 16-bit model and an FP8 one with various KV caches. A wrong or missing
scale shows up as an early divergence from the first configuration; the
first token that differs is marked ⟦like this⟧. Identical text proves
little, divergence late in a reply is normal for FP8, and divergence at the
first token of most prompts means something is broken.
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

from fp8serve.calibration.kv_config import SPEC_HELP
from fp8serve.entrypoints.engine_args import add_quantization_arg, human_readable_int

logger = logging.getLogger(__name__)

_DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# Our own prompts on the subjects of the seed PR's example prompts.
EXAMPLE_PROMPTS = [
    "In two or three sentences, explain what a large language model (LLM) is and how it learns.",
    "List the most important milestones in artificial intelligence research from 1950 to 2020.",
    "How does artificial intelligence differ from human intelligence in the way it learns and reasons?",
    "Describe the basic components of a neural network and what each of them does.",
    "Write the opening paragraph of a short story about a robot that discovers it can dream.",
    "Summarize how the COVID-19 pandemic changed the global economy and the way companies do business.",
    "Why is the Mona Lisa so famous? Give a few reasons.",
    "Translate the proverb 'The early bird catches the worm' into Japanese, French and Swahili.",
]

# A SPEC's last field: the weights quantized at load, as -q/--quantization METHOD.
_QUANTIZATION_KEYS = ("q=", "quantization=")

_EPILOG = f"""\
configurations:
  MODEL [MODEL ...] --kv-cache-dtype D [D ...]   every model with every KV cache dtype (and -q if given)
  MODEL@SPEC[:q=fp8]                               one configuration; SPEC = {SPEC_HELP};
                                                   :q=fp8 (or :quantization=fp8) quantizes the weights at load,
                                                   as -q fp8 does for MODELs without @SPEC (MODEL@q=fp8 =
                                                   MODEL@auto:q=fp8)
  MODEL may be 'default' for the built-in model. The seed's four configurations in one command:
    fp8serve compare BF16_DIR@auto FP8_DIR@auto FP8_DIR@fp8_e4m3:scale1 FP8_DIR@fp8_e4m3
  A 16-bit model against its weights quantized at load, with an FP8 KV cache:
    fp8serve compare BF16_DIR@auto BF16_DIR@auto:q=fp8 BF16_DIR@fp8_e4m3:q=fp8
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare greedy outputs across models and KV cache dtypes (the seed PR's output check)",
        description=(
            "Run eight example chat prompts greedily through each (model x KV cache) configuration and print "
            "the outputs side by side as a markdown table, marking the first token that differs from the "
            "first configuration's output."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("models", nargs="*", metavar="MODEL[@SPEC]",
                   help="checkpoint directories ('default' = built-in model), optionally with @KV-SPEC[:q=fp8]")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], metavar="D",
                   help="KV cache dtypes for every MODEL given without @SPEC (default: auto)")
    p.add_argument("--quantization-param-path", default=None, metavar="FILE",
                   help="JSON scales for every MODEL given without @SPEC")
    add_quantization_arg(p, scope="For every MODEL given without @SPEC (a SPEC ends in :q=fp8 instead)")
    p.add_argument("--max-tokens", type=int, default=20, help="greedy tokens per prompt (default 20)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable; default: eight examples on the seed PR's subjects)")
    p.add_argument("--no-chat", action="store_true", help="send prompts as raw text, without the chat template")
    p.add_argument("--dtype", default="auto", choices=_DTYPE_CHOICES, help="compute dtype (default auto)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 256MiB")
    p.add_argument("--max-model-len", type=human_readable_int, default=None,
                   help="context length of each engine (default: the model's); lower it to fit a small "
                        "--kv-cache-memory")
    p.add_argument("--out", default=None, metavar="FILE.md", help="also write the markdown to FILE.md")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class RunConfig:
    model: str
    kv: object  # KVConfig
    quantization: str | None = None  # --quantization: the weights quantized at load

    @property
    def label(self) -> str:
        q = f":q={self.quantization}" if self.quantization else ""
        return f"{Path(self.model).name} @ {self.kv.label}{q}"


def _resolve_model(name: str) -> str:
    if name == "default" and not Path(name).exists():
        from fp8serve.default_model import ensure_default_model

        return str(ensure_default_model())
    return name


def _quantization_fields(kv_spec: str) -> list[str]:
    """The q=/quantization= fields among a SPEC's KV cache fields; a json= field's file path (which may
    hold ':') is not searched."""
    fields = kv_spec.split(":")
    json_at = next((i for i, f in enumerate(fields) if f.startswith("json=")), len(fields))
    return [f for f in fields[:json_at] if f.startswith(_QUANTIZATION_KEYS)]


def split_quantization(item: str, spec: str) -> tuple[str, str | None]:
    """(KV part, method) of MODEL@SPEC's SPEC: a last field q=METHOD (or quantization=METHOD) names the
    weights' quantization at load, None without one; a SPEC of that field alone has KV cache 'auto'."""
    from fp8serve.errors import UserError
    from fp8serve.quantization.registry import QUANTIZATION_METHODS

    kv, _, last = spec.rpartition(":")
    if not last.startswith(_QUANTIZATION_KEYS):
        kv, last = spec, None
    # Another q= field would reach KVConfig.parse and be reported as a bad KV cache dtype or scales.
    other = _quantization_fields(kv)
    if other and last is not None:
        raise UserError(f"'{item}': q= (quantization=) is given twice ({other[0]} and {last}); a SPEC takes one "
                        "q=METHOD, as its last field")
    if other:
        raise UserError(f"'{item}': {other[0]} must be the SPEC's last field (MODEL@DTYPE[:SCALES]:q=METHOD)")
    if last is None:
        return spec, None
    method = last.partition("=")[2]
    if method not in QUANTIZATION_METHODS:
        raise UserError(f"'{item}': quantization '{method}' is not one of {', '.join(QUANTIZATION_METHODS)} "
                        "(as -q/--quantization)")
    return kv or "auto", method


def parse_run_configs(models: list[str], kv_cache_dtypes: list[str], json_path: str | None,
                      quantization: str | None = None) -> list[RunConfig]:
    """`quantization` (-q) is for MODELs without @SPEC, as `kv_cache_dtypes` and `json_path` are."""
    from fp8serve.calibration.kv_config import KVConfig

    out = []
    for item in models or ["default"]:
        model, at, spec = item.rpartition("@")
        if at and not Path(item).exists():
            kv_spec, spec_quantization = split_quantization(item, spec)
            out.append(RunConfig(_resolve_model(model), KVConfig.parse(kv_spec), spec_quantization))
        else:
            out += [RunConfig(_resolve_model(item), kv, quantization)
                    for kv in KVConfig.for_dtypes(kv_cache_dtypes, json_path)]
    return out


def check_args(args: argparse.Namespace) -> None:
    """What can be wrong with the flags, said before the first model loads."""
    from fp8serve.calibration.writers import check_output_file
    from fp8serve.errors import UserError

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    # Flags for MODELs without @SPEC would otherwise be dropped without a word.
    models = args.models or ["default"]
    if all("@" in m and not Path(m).exists() for m in models):
        for flag, given, spec in (("--kv-cache-dtype", args.kv_cache_dtype != ["auto"], "MODEL@fp8_e4m3"),
                                  ("--quantization-param-path", args.quantization_param_path is not None,
                                   "MODEL@fp8_e4m3:json=FILE"),
                                  ("--quantization", args.quantization is not None, "MODEL@auto:q=fp8")):
            if given:
                raise UserError(f"{flag} applies to MODELs given without @SPEC, and every MODEL has one; "
                                f"put it in the SPEC ({spec}) or drop it")
    if args.out:
        check_output_file(args.out, "--out")


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """The text each token adds, so that "".join(pieces) is the decoded text
    (a token ending mid-character adds "" and the next one the character)."""
    pieces, previous = [], ""
    for i in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        if not text.startswith(previous):
            # Decoding is not prefix-stable here (rare cleanup rules): fall back to per-token text.
            return [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]
        pieces.append(text[len(previous):])
        previous = text
    return pieces


def first_difference(pieces: list[str], reference: list[str]) -> int | None:
    """Index of the first piece that differs from `reference`, len(pieces)
    if `pieces` stops early, None if identical."""
    for i, (a, b) in enumerate(zip(pieces, reference)):
        if a != b:
            return i
    if len(pieces) == len(reference):
        return None
    return min(len(pieces), len(reference))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n").replace("\r", "\\r")


def render_marked(pieces: list[str], diff_at: int | None) -> str:
    if diff_at is None:
        return _escape("".join(pieces))
    head = _escape("".join(pieces[:diff_at]))
    if diff_at >= len(pieces):
        return head + "⟦⏹⟧"  # stopped where the reference went on
    # A token that ends mid-character adds no text of its own: mark it
    # together with the tokens that complete the character.
    end = diff_at
    while end + 1 < len(pieces) and not pieces[end]:
        end += 1
    marked = "".join(pieces[diff_at:end + 1]) or "∅"
    return head + "⟦" + _escape(marked) + "⟧" + _escape("".join(pieces[end + 1:]))


def format_markdown(configs: list[RunConfig], summaries: list[dict], prompts: list[str],
                    pieces: list[list[list[str]]]) -> str:
    """pieces[c][p]: the output pieces of configuration c on prompt p."""
    lines = ["| # | model | quantization | KV cache | scales | prompts identical to #1 "
             "| first difference (token index) |", "|---|---|---|---|---|---|---|"]
    diffs = [[first_difference(pieces[c][p], pieces[0][p]) for p in range(len(prompts))] for c in range(len(configs))]
    for c, (cfg, s) in enumerate(zip(configs, summaries)):
        k0, k1 = s["k_scale_range"]
        scales = f"{s['scale_source']} k {k0:.3g}..{k1:.3g}" if k0 != k1 else f"{s['scale_source']} {k0:.3g}"
        same = sum(d is None for d in diffs[c])
        where = ", ".join("=" if d is None else str(d) for d in diffs[c])
        lines.append(f"| {c + 1} | {Path(cfg.model).name} | {s['quantization'] or '-'} | {s['kv_cache_dtype']} "
                     f"({cfg.kv.label}) | {scales} | {same}/{len(prompts)} | {where} |")
    lines += ["", "| prompt | " + " | ".join(f"#{c + 1}" for c in range(len(configs))) + " |",
              "|---" * (len(configs) + 1) + "|"]
    for p, prompt in enumerate(prompts):
        cells = [render_marked(pieces[c][p], None if c == 0 else diffs[c][p]) for c in range(len(configs))]
        lines.append(f"| {_escape(prompt)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def generate_all(configs: list[RunConfig], prompts: list[str], *, max_tokens: int, chat: bool = True,
                 dtype: str = "auto", device: str = "auto", kv_cache_memory: str | None = None,
                 max_model_len: int | None = None):
    """(per-config scale summaries, pieces[c][p]); one engine at a time."""
    from fp8serve import LLM, SamplingParams
    from fp8serve.calibration.kv_config import scale_summary

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    summaries, pieces = [], []
    for cfg in configs:
        llm = LLM(cfg.model, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory,
                  max_model_len=max_model_len, quantization=cfg.quantization, **cfg.kv.engine_kwargs())
        cfg.kv.apply_after_load(llm)
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        tok = llm.get_tokenizer()
        pieces.append([token_pieces(tok, o.outputs[0].token_ids) for o in outputs])
        # after generation: calculated scales exist only once a prefill ran
        summaries.append({"kv_cache_dtype": llm.llm_engine.model_runner.kv_cache_spec.kv_cache_dtype,
                          "dtype": llm.llm_engine.config.model_config.dtype_name,
                          "quantization": llm.llm_engine.config.model_config.quantization,
                          "device": str(llm.llm_engine.config.model_config.torch_device), **scale_summary(llm)})
        del llm
        gc.collect()
    return summaries, pieces


def check_models(configs: list[RunConfig]) -> None:
    """Every MODEL's config.json, and each q= against the checkpoint's own quantization_config (as the
    engine checks it), before the first configuration runs: a late one would fail after minutes."""
    from fp8serve.config import check_quantization_flag, read_hf_config

    for c in configs:
        hf_config, cfg_path = read_hf_config(c.model)
        if c.quantization is not None:
            check_quantization_flag(c.quantization, hf_config.get("quantization_config"), cfg_path)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    configs = parse_run_configs(args.models, args.kv_cache_dtype, args.quantization_param_path, args.quantization)
    check_models(configs)
    prompts = args.prompt or EXAMPLE_PROMPTS
    summaries, pieces = generate_all(configs, prompts, max_tokens=args.max_tokens, chat=not args.no_chat,
                                     dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
                                     max_model_len=args.max_model_len)
    header = (f"Greedy, {args.max_tokens} tokens, {'chat template' if not args.no_chat else 'raw prompts'}, "
              f"compute dtype {summaries[0]['dtype']}, device {summaries[0]['device']} ({platform.machine()}). "
              "⟦x⟧ marks the first token that differs from configuration #1 (⟦⏹⟧: stopped earlier).")
    md = header + "\n\n" + format_markdown(configs, summaries, prompts, pieces)
    print(md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md + "\n")
        print(f"\nwrote {args.out}")
    return 0
