"""Where each attention layer's k_scale / v_scale comes from.

The rules, in the order `resolve_kv_scales` applies them (kv = the KV cache
dtype, ckpt = scale tensors found in an FP8 checkpoint, json =
--quantization-param-path):

  kv                          ckpt  json  -> scales                   log
  auto/bfloat16/float16/f32   any   any   -> 1.0 (unused)             one info line if ckpt or json was given
  fp8_e5m2                    any   any   -> 1.0                      one info line (says what was ignored)
  fp8_e4m3                    yes   any   -> checkpoint               one info line; json ignored, said in it
  fp8_e4m3                    no    yes   -> json                     one info line
  fp8_e4m3                    no    no    -> 1.0                      one warning: accuracy may drop, how to fix

"ckpt = yes" needs an FP8 checkpoint (`is_fp8_checkpoint`): scale tensors in
a 16-bit checkpoint are never read, so a 16-bit checkpoint gets its scales
from the JSON only. When an FP8 checkpoint carries scales *and* a JSON is
given, the checkpoint wins: its scales were calibrated for its own FP8
weights, and the JSON schema only exists for models without them. An FP8
checkpoint without scales takes the JSON.

e5m2 keeps 1.0 because its range (+-57344) covers activations unscaled; its
3 fewer mantissa bits are what costs accuracy, and a scale cannot help that.

Scales that are given but wrong are errors (`ConfigError`), never a silent
fallback to 1.0. Scales that are ignored (by the table above) are not read
or validated.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8serve.errors import ConfigError
from fp8serve.model_loader.loader import open_safetensors, safetensors_files
from fp8serve.model_loader.weights_mapper import WeightsMapper, is_kv_scale_param, layer_index

_logger = logging.getLogger(__name__)

UNSCALED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = UNSCALED_KV_CACHE_DTYPES + ("fp8_e4m3", "fp8_e5m2")

JSON_SCHEMA_HINT = (
    '{"model_type": "<config.json model_type>", "kv_cache": {"dtype": "float8_e4m3fn", '
    '"scaling_factor": {"<tp_rank>": {"<layer>": <scale>, ...}}}}'
)
_HOW_TO_SUPPLY = (
    "pass per-layer scales with --quantization-param-path FILE (vLLM's JSON schema), "
    "or produce them with `fp8serve calibrate`"
)


@dataclass(frozen=True)
class LayerKVScale:
    layer: int
    k_scale: float  # with per-head scales: their max
    v_scale: float
    source: str  # "checkpoint:<tensor name>[,<tensor name>]" | "json:<file>" | "default"
    # One scale per KV head (kv_cache_scheme strategy "attn_head"), else None.
    k_head_scales: tuple[float, ...] | None = None
    v_head_scales: tuple[float, ...] | None = None


@dataclass(frozen=True)
class _ScaleTensor:
    """A checkpoint tensor that the mapper sends to a layer's k or v scale."""

    name: str
    file: Path
    layer: int
    kind: str  # "k" | "v"
    # True for the seed's single `kv_scale` (one tensor for both K and V).
    shared: bool = False


def is_fp8_checkpoint(hf_config: dict) -> bool:
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return False
    method = qc.get("quant_method")
    return method == "fp8" or (method == "compressed-tensors" and qc.get("kv_cache_scheme") is not None)


KV_SCALE_STRATEGIES = ("tensor", "attn_head")


def _check_kv_cache_scheme(hf_config: dict, model_dir: str | Path) -> str:
    """A compressed-tensors `kv_cache_scheme` must describe what the checkpoint's scales are:
    static symmetric FP8 (amax / 448), one scale per layer (strategy "tensor") or per KV head
    ("attn_head", the strategies vLLM takes). An int8 or 4-bit scheme's scales (amax / 127,
    amax / 6) would saturate an e4m3 cache; dynamic ones are not on disk. vLLM refuses the same.
    Returns the strategy ("tensor" without a scheme: AutoFP8's per-tensor scales)."""
    qc = hf_config.get("quantization_config") or {}
    scheme = qc.get("kv_cache_scheme") if qc.get("quant_method") == "compressed-tensors" else None
    if scheme is None:
        return "tensor"
    where = f"{Path(model_dir) / 'config.json'}: quantization_config.kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise ConfigError(f"{where} must be an object, got {scheme!r}")
    want = {"type": "float", "num_bits": 8, "dynamic": False, "symmetric": True}
    wrong = {k: scheme.get(k, v if k == "symmetric" else None) for k, v in want.items()
             if scheme.get(k, v if k == "symmetric" else None) != v}
    if scheme.get("strategy") not in KV_SCALE_STRATEGIES:
        wrong["strategy"] = scheme.get("strategy")
    if wrong:
        raise ConfigError(f"{where} has {', '.join(f'{k} {v!r}' for k, v in wrong.items())}: only static "
                          "symmetric 8-bit float KV scales are supported (type float, num_bits 8, strategy "
                          "tensor or attn_head, dynamic false)")
    return scheme["strategy"]


def _find_scale_tensors(model_dir: str | Path, mapper: WeightsMapper) -> list[_ScaleTensor]:
    """KV-scale tensor names from the safetensors headers; reads no data."""
    found = []
    for file in safetensors_files(model_dir):
        with open_safetensors(file) as f:
            names = list(f.keys())
        for name in names:
            targets = [t for t in mapper.map(name) if is_kv_scale_param(t.param_name)]
            for target in targets:
                layer = layer_index(target.param_name)
                if layer is None:
                    raise ConfigError(
                        f"{file}: tensor '{name}' is a KV scale but names no decoder layer; "
                        "expected a name like 'model.layers.<N>.self_attn...'"
                    )
                kind = "k" if target.param_name.endswith(".k_scale") else "v"
                found.append(_ScaleTensor(name, file, layer, kind, shared=len(targets) > 1))
    return found


def _scale_value(tensor: torch.Tensor, name: str, file: Path, num_kv_heads: int | None) -> float | tuple[float, ...]:
    """A scalar, or with `num_kv_heads` (strategy "attn_head") one scale per KV head:
    compressed-tensors writes those as [num_kv_heads, 1, 1]."""
    if num_kv_heads is None and tensor.numel() != 1:
        raise ConfigError(
            f"{file}: tensor '{name}' has shape {list(tensor.shape)}; expected a scalar KV scale "
            "(shape [] or [1]); one scale per KV head needs config.json's quantization_config.kv_cache_scheme "
            "to say strategy 'attn_head', and per-channel KV scales are not supported"
        )
    if num_kv_heads is not None and (tensor.numel() != num_kv_heads
                                     or [d for d in tensor.shape if d != 1] not in ([], [num_kv_heads])):
        raise ConfigError(
            f"{file}: tensor '{name}' has shape {list(tensor.shape)}; kv_cache_scheme strategy 'attn_head' "
            f"expects one scale per KV head: shape [{num_kv_heads}, 1, 1] (num_key_value_heads {num_kv_heads})"
        )
    values = tensor.reshape(-1).to(torch.float64).tolist()
    for i, value in enumerate(values):
        what = f"tensor '{name}'" + (f" (KV head {i})" if num_kv_heads is not None else "")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{file}: {what} is {value}; expected a finite KV scale > 0")
        if not fits_float32(value):
            raise ConfigError(f"{file}: {what} is {value}; expected {FLOAT32_SCALE_RANGE}")
    return values[0] if num_kv_heads is None else tuple(values)


# The cache and the kernels keep scales as float32: a scale that rounds to 0,
# to a subnormal or to inf there would quantize every K/V to 0 or saturate it.
_FLOAT32_TINY = 2.0**-126
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_SCALE_RANGE = f"a scale a float32 holds as a normal number ({_FLOAT32_TINY:.3g} .. {_FLOAT32_MAX:.3g})"


def fits_float32(value: float) -> bool:
    return _FLOAT32_TINY <= value <= _FLOAT32_MAX


def _read_values(tensors: list[_ScaleTensor], num_kv_heads: int | None = None) -> dict[int, dict[str, tuple]]:
    by_file: dict[Path, list[_ScaleTensor]] = defaultdict(list)
    for t in tensors:
        by_file[t.file].append(t)
    scales: dict[int, dict[str, tuple[float, _ScaleTensor]]] = defaultdict(dict)
    for file, items in by_file.items():
        with open_safetensors(file) as f:
            values = {t.name: _scale_value(f.get_tensor(t.name), t.name, file, num_kv_heads) for t in items}
        for t in items:
            previous = scales[t.layer].get(t.kind)
            if previous is not None and previous[1].shared != t.shared:
                # Calibration tools write per-tensor k_scale/v_scale and the
                # seed's kv_scale (their max) side by side for older readers;
                # the specific scale is the more precise one.
                if previous[1].shared:
                    scales[t.layer][t.kind] = (values[t.name], t)
                continue
            if previous is not None:
                raise ConfigError(
                    f"{file}: tensor '{t.name}' gives layer {t.layer} a second {t.kind.upper()} scale "
                    f"(already given by '{previous[1].name}' in {previous[1].file}); expected exactly one"
                )
            scales[t.layer][t.kind] = (values[t.name], t)
    return scales


def _read_checked(tensors: list[_ScaleTensor], num_kv_heads: int | None = None) -> dict[int, dict[str, tuple]]:
    scales = _read_values(tensors, num_kv_heads)
    _check_pairs(scales)
    return scales


def _with_layer(name: str, layer: int) -> str:
    return re.sub(r"(?<![^.])layers\.\d+\.", f"layers.{layer}.", name, count=1)


def _check_pairs(scales: dict[int, dict[str, tuple[float, _ScaleTensor]]]) -> None:
    for layer, kinds in sorted(scales.items()):
        if len(kinds) == 2:
            continue
        (kind, (_, present)), = kinds.items()
        other = "v" if kind == "k" else "k"
        # Name the missing tensor after one that another layer does have.
        example = next((s[other][1].name for s in scales.values() if other in s), None)
        expected = f"'{_with_layer(example, layer)}'" if example else f"a {other}_scale tensor for layer {layer}"
        raise ConfigError(
            f"{present.file}: tensor '{present.name}' gives layer {layer} a {kind.upper()} scale but the "
            f"checkpoint has no {other.upper()} scale for it; expected {expected} as well"
        )


def read_checkpoint_kv_scales(model_dir: str | Path, mapper: WeightsMapper,
                              num_kv_heads: int | None = None) -> dict[int, dict[str, tuple]]:
    """layer -> {"k": (scale, tensor name), "v": (scale, tensor name)} for every
    KV-scale tensor in the checkpoint, named through `mapper`; with `num_kv_heads`
    (strategy "attn_head") each scale is a tuple, one per KV head.

    Opens each safetensors file for its header and reads only the scale
    tensors. Raises `ConfigError` for a non-scalar, non-finite or
    non-positive scale, two scales for one slot, or a layer with K but not V
    (or V but not K). An empty dict means the checkpoint has no KV scales."""
    scales = _read_checked(_find_scale_tensors(model_dir, mapper), num_kv_heads)
    return {
        layer: {kind: (value, t.name) for kind, (value, t) in kinds.items()}
        for layer, kinds in sorted(scales.items())
    }


def _checkpoint_scales(model_dir: str | Path, tensors: list[_ScaleTensor], num_layers: int,
                       num_kv_heads: int | None = None) -> list[LayerKVScale]:
    scales = _read_checked(tensors, num_kv_heads)
    for layer, kinds in sorted(scales.items()):
        if layer >= num_layers:
            _, t = kinds["k"]
            raise ConfigError(
                f"{t.file}: tensor '{t.name}' is a KV scale for layer {layer}; "
                f"expected layers 0..{num_layers - 1} (the model has {num_layers} layers)"
            )
    missing = [i for i in range(num_layers) if i not in scales]
    if missing:
        _, t = scales[min(scales)]["k"]
        raise ConfigError(
            f"{Path(model_dir)}: FP8 checkpoint has KV scales for {len(scales)} of {num_layers} layers "
            f"(missing layers {_ranges(missing)}); expected a tensor like '{_with_layer(t.name, missing[0])}' "
            "for every layer"
        )
    out = []
    for layer in range(num_layers):
        (k, tk), (v, tv) = scales[layer]["k"], scales[layer]["v"]
        names = tk.name if tk.name == tv.name else f"{tk.name},{tv.name}"
        if num_kv_heads is None:
            out.append(LayerKVScale(layer, k, v, f"checkpoint:{names}"))
        else:
            out.append(LayerKVScale(layer, max(k), max(v), f"checkpoint:{names}", k, v))
    return out


def _num_kv_heads(hf_config: dict, model_dir: str | Path) -> int:
    heads = hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ConfigError(f"{Path(model_dir) / 'config.json'}: per-KV-head scales (kv_cache_scheme strategy "
                          f"'attn_head') need num_key_value_heads (or num_attention_heads) >= 1, got {heads!r}")
    return heads


def _ranges(indices: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def load_quantization_param_json(
    path: str | Path,
    *,
    expected_model_type: str,
    num_layers: int,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> dict[int, float]:
    """layer -> scale (one per layer, used for K and V) from a
    --quantization-param-path file in vLLM's schema (see JSON_SCHEMA_HINT).

    Every rank's entry is validated, `tp_rank`'s is returned. Any deviation
    raises `ConfigError` naming the file and the JSON path of the field."""
    path = Path(path)

    def fail(field: str, expected: str, got: str) -> ConfigError:
        return ConfigError(f"{path}: field '{field}': expected {expected}, got {got}")

    def unique_keys(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            # json keeps the last of duplicates silently; a scale file with two
            # entries for one layer is ambiguous, whichever reader you ask.
            raise ConfigError(f"{path}: key {dup!r} appears twice in one JSON object; expected each key once")
        return dict(pairs)

    try:
        data = json.loads(path.read_text(), object_pairs_hook=unique_keys)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the KV scale file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); expected {JSON_SCHEMA_HINT}") from None
    if not isinstance(data, dict):
        raise fail("<top level>", f"an object {JSON_SCHEMA_HINT}", type(data).__name__)
    if data.get("model_type") != expected_model_type:
        raise fail(
            "model_type", f"'{expected_model_type}' (the checkpoint's config.json model_type)",
            repr(data.get("model_type")),
        )
    kv = data.get("kv_cache")
    if not isinstance(kv, dict):
        raise fail("kv_cache", "an object with 'dtype' and 'scaling_factor'", repr(kv))
    if kv.get("dtype") != "float8_e4m3fn":
        raise fail("kv_cache.dtype", "'float8_e4m3fn'", repr(kv.get("dtype")))
    per_rank = kv.get("scaling_factor")
    if not isinstance(per_rank, dict):
        raise fail("kv_cache.scaling_factor", 'an object {"<tp_rank>": {"<layer>": <scale>}}', repr(per_rank))
    if len(per_rank) != tp_size:
        raise fail(
            "kv_cache.scaling_factor", f"{tp_size} tensor-parallel rank(s), one per rank of the engine's "
            f"tensor parallel size {tp_size}", f"{len(per_rank)} ({', '.join(map(repr, per_rank))})",
        )
    result = {}
    for rank in range(tp_size):
        field = f"kv_cache.scaling_factor.{rank}"
        if str(rank) not in per_rank:
            raise fail(field, f"the scales of rank {rank}", f"no such key (ranks: {', '.join(map(repr, per_rank))})")
        result[rank] = _parse_layer_scales(per_rank[str(rank)], field, num_layers, fail)
    return result[tp_rank]


def _parse_layer_scales(obj, field: str, num_layers: int, fail) -> dict[int, float]:
    if not isinstance(obj, dict):
        raise fail(field, 'an object {"<layer>": <scale>, ...}', repr(obj))
    scales = {}
    for key, value in obj.items():
        f = f"{field}.{key}"
        if not re.fullmatch(r"0|[1-9][0-9]*", key):
            raise fail(f, "a decimal layer index as key", repr(key))
        layer = int(key)
        if layer >= num_layers:
            raise fail(f, f"layers 0..{num_layers - 1} only (the model has {num_layers} layers)", "an extra layer")
        # bool is an int in Python, and `true` is not a scale.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(f, "a number > 0", repr(value))
        if not (math.isfinite(value) and value > 0):
            raise fail(f, "a finite number > 0", repr(value))
        if not fits_float32(value):
            raise fail(f, FLOAT32_SCALE_RANGE, repr(value))
        scales[layer] = float(value)
    missing = [i for i in range(num_layers) if i not in scales]
    if missing:
        raise fail(
            f"{field}.{missing[0]}", f"a scale for every layer 0..{num_layers - 1}",
            f"no entry (missing layers {_ranges(missing)})",
        )
    return scales


def resolve_kv_scales(
    *,
    model_dir: str | Path,
    hf_config: dict,
    num_layers: int,
    kv_cache_dtype: str,
    mapper: WeightsMapper,
    quantization_param_path: str | None,
    tp_size: int = 1,
    tp_rank: int = 0,
    logger: logging.Logger | None = None,
) -> list[LayerKVScale]:
    """One `LayerKVScale` per layer, by the rules in this module's docstring.

    `kv_cache_dtype` is already normalized (see KV_CACHE_DTYPES)."""
    log = logger or _logger
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    defaults = [LayerKVScale(i, 1.0, 1.0, "default") for i in range(num_layers)]
    # Scale tensors count only in an FP8 checkpoint; finding them reads headers only.
    ckpt_tensors = _find_scale_tensors(model_dir, mapper) if is_fp8_checkpoint(hf_config) else []

    given = []
    if ckpt_tensors:
        given.append(f"the checkpoint's {len(ckpt_tensors)} KV-scale tensors (e.g. '{ckpt_tensors[0].name}')")
    if quantization_param_path is not None:
        given.append(f"--quantization-param-path {quantization_param_path}")
    ignored = " and ".join(given)

    if kv_cache_dtype in UNSCALED_KV_CACHE_DTYPES:
        if given:
            log.info("KV cache dtype is %s, not FP8: ignoring %s", kv_cache_dtype, ignored)
        return defaults

    if kv_cache_dtype == "fp8_e5m2":
        log.info(
            "fp8_e5m2 KV cache: k_scale = v_scale = 1.0 in every layer (scales apply to fp8_e4m3 only)%s",
            f"; ignoring {ignored}" if given else "",
        )
        return defaults

    if ckpt_tensors:
        per_head = _check_kv_cache_scheme(hf_config, model_dir) == "attn_head"
        num_kv_heads = _num_kv_heads(hf_config, model_dir) if per_head else None
        scales = _checkpoint_scales(model_dir, ckpt_tensors, num_layers, num_kv_heads)
        log.info(
            "fp8_e4m3 KV cache: %s scales from the checkpoint (k_scale %s, v_scale %s)%s",
            "per-layer, per-KV-head" if per_head else "per-layer",
            _span(x for s in scales for x in (s.k_head_scales or (s.k_scale,))),
            _span(x for s in scales for x in (s.v_head_scales or (s.v_scale,))),
            f"; ignoring --quantization-param-path {quantization_param_path}: an FP8 checkpoint's own scales "
            "take precedence" if quantization_param_path is not None else "",
        )
        return scales

    if quantization_param_path is not None:
        values = load_quantization_param_json(
            quantization_param_path,
            expected_model_type=hf_config.get("model_type", "llama"),
            num_layers=num_layers,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        log.info(
            "fp8_e4m3 KV cache: per-layer scales from %s (%s)", quantization_param_path, _span(values.values())
        )
        source = f"json:{quantization_param_path}"
        return [LayerKVScale(i, values[i], values[i], source) for i in range(num_layers)]

    log.warning(
        "fp8_e4m3 KV cache without calibrated scales: using k_scale = v_scale = 1.0, so keys and values "
        "outside +-448 saturate and small ones lose precision; accuracy may drop. To fix it, %s.",
        _HOW_TO_SUPPLY,
    )
    return defaults


def _span(values) -> str:
    values = list(values)
    return f"{min(values):.4g}..{max(values):.4g}" if values else "none"
