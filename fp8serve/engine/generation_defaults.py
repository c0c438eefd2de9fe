"""Default sampling parameters from the model's generation_config.json, as
vLLM takes them (`--generation-config auto`, its default since v0.8):
a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset gets the model creator's value (Llama 3 Instruct
ships temperature 0.6, top_p 0.9), and `max_new_tokens` caps max_tokens.
`--generation-config vllm` ignores the file (the engine's own defaults:
temperature 1.0, no truncation); a directory reads its generation_config.json
instead of the model's. `--override-generation-config` (JSON) is applied on
top, as in vLLM.

The file's other fields (eos_token_id is read by tokenizer.eos_token_ids,
do_sample, num_beams, ...) are not sampling defaults here, as in vLLM.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fp8serve.errors import ConfigError

FILE = "generation_config.json"
# generation_config.json keys vLLM takes, and the SamplingParams field each sets.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _check(where: str, key: str, value) -> float | int:
    integer = key in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise ConfigError(f"{where}: '{key}' must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: '{key}' must be finite, got {value!r}")
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": value > 0, "top_k": value == -1 or value >= 0, "max_new_tokens": value >= 1}[key]
    if not ok:
        expected = {"temperature": ">= 0", "top_p": "in (0, 1]", "min_p": "in [0, 1]", "repetition_penalty": "> 0",
                    "top_k": "-1, 0 (off) or a positive integer", "max_new_tokens": ">= 1"}[key]
        raise ConfigError(f"{where}: '{key}' must be {expected}, got {value!r}")
    return int(value) if integer else float(value)


def default_sampling_params(model_dir: str, source: str = "auto", override: dict | None = None) -> dict:
    """SamplingParams fields -> values for requests that leave them unset ({} when none apply).
    `source`: "auto" (the model's file), "vllm" (none) or a directory holding generation_config.json."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"--generation-config must be 'auto', 'vllm' or a directory, got {source!r}")
    config: dict = {}
    if source != "vllm":
        directory = Path(model_dir if source == "auto" else source)
        path = directory / FILE
        if source != "auto" and not path.is_file():
            what = "is not a directory" if not directory.is_dir() else f"has no {FILE}"
            raise ConfigError(f"--generation-config '{source}' {what} (expected 'auto', 'vllm' or a directory "
                              f"holding {FILE})")
        if path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{path}: not valid JSON ({e}); --generation-config vllm ignores the file") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
            config = {k: v for k, v in config.items() if k in SAMPLING_KEYS and v is not None}
            config = {k: _check(str(path), k, v) for k, v in config.items()}
    if override is not None:
        if not isinstance(override, dict):
            raise ConfigError(f"--override-generation-config must be a JSON object, got {override!r}")
        unknown = sorted(set(override) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError(f"--override-generation-config: unknown key(s) {unknown} (known: "
                              f"{', '.join(SAMPLING_KEYS)})")
        config.update({k: _check("--override-generation-config", k, v) for k, v in override.items() if v is not None})
    return {SAMPLING_KEYS[k]: v for k, v in config.items()}
