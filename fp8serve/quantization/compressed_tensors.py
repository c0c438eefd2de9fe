"""compressed-tensors checkpoints with FP8 weights (`quant_method: "compressed-tensors"`).

llm-compressor writes these (schemes FP8, FP8_DYNAMIC, W8A16 float): `config_groups`, each
naming `targets` (a layer class such as "Linear", a module name, or "re:<regex>") and a
quantization scheme for their `weights` and `input_activations`; `ignore` lists modules left
in 16 bits. Targets and ignore entries name checkpoint modules (`...self_attn.q_proj`,
`...block_sparse_moe.experts.3.w1`), so each fused layer of ours is looked up by the
checkpoint modules it loads from (`WeightsMapper.checkpoint_modules`).

Supported, each run by `Fp8LinearMethod`: float8_e4m3fn weights with a per-tensor
(`strategy: tensor`, `weight_scale` [1]) or per-channel (`strategy: channel`,
`weight_scale` [out, 1]) scale; activations 16-bit (none), dynamic (per token or tensor) or
static per tensor (`input_scale`). Anything else (int4/int8 packs, group or block scales,
output activations) is refused with the field that says so: running it as something else
would give wrong weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8serve.errors import ConfigError
from fp8serve.quantization.base import LinearMethod, QuantizationConfig
from fp8serve.quantization.fp8_linear import (
    DISAGREE,
    KV_ZERO_POINT,
    Fp8LinearMethod,
    checkpoint_tensor_kind,
    fp8_checkpoint_vocab_dtype,
)
from fp8serve.quantization.unquantized import UnquantizedLinearMethod

# Formats whose FP8 weights are stored as float8_e4m3fn tensors, as they are used.
FP8_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    weight_strategy: str  # "tensor" | "channel"
    activation_scheme: str  # "static" | "dynamic" (dynamic also stands for 16-bit activations)

    def __str__(self) -> str:
        return f"FP8 weights per {self.weight_strategy}, {self.activation_scheme} activations"


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    scheme: Fp8Scheme
    format: str = "float-quantized"
    # input_activations as the config spells it: "null" (16-bit), "dynamic" or "static".
    activations: str = "dynamic"


def _matches(entry: str, module: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    # The class name every group of ours targets: all our quantizable layers are linear.
    return entry == "Linear" or module == entry or module.endswith("." + entry)


def _target_kind(target: str) -> str:
    return "regex" if target.startswith("re:") else "class" if target == "Linear" else "name"


def _weights_scheme(weights, where: str) -> str:
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}.weights must be an object, got {weights!r}")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind != "float" or bits != 8:
        raise ConfigError(f"{where}.weights is {bits}-bit {kind}: only 8-bit float (FP8) weights are supported")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        extra = f" (block_structure {weights.get('block_structure')})" if strategy == "block" else ""
        raise ConfigError(f"{where}.weights.strategy is {strategy!r}{extra}: only 'tensor' and 'channel' FP8 "
                          "weight scales are supported")
    group_size = weights.get("group_size")
    if group_size is not None and (not isinstance(group_size, int) or group_size != -1):
        # compressed-tensors' QuantizationArgs refuses a positive group_size without strategy
        # 'group' (-1 is its spelling of per channel): a scale per group of columns that this
        # config does not describe.
        raise ConfigError(f"{where}.weights.group_size is {group_size!r} with strategy {strategy!r}: "
                          "compressed-tensors uses a positive group_size only with strategy 'group'")
    if weights.get("symmetric", True) is not True:
        raise ConfigError(f"{where}.weights.symmetric is {weights.get('symmetric')!r}: FP8 weights are symmetric")
    if weights.get("dynamic", False):
        raise ConfigError(f"{where}.weights.dynamic is {weights.get('dynamic')!r}: weights must be stored quantized")
    return strategy


def _activation_scheme(activations, where: str) -> str:
    if activations is None:
        return "dynamic"  # weight-only (W8A16): no input_scale tensors
    if not isinstance(activations, dict):
        raise ConfigError(f"{where}.input_activations must be an object or null, got {activations!r}")
    kind, bits = activations.get("type", "int"), activations.get("num_bits")
    if kind != "float" or bits != 8:
        raise ConfigError(f"{where}.input_activations is {bits}-bit {kind}: only 8-bit float (FP8) activations "
                          "are supported")
    if activations.get("symmetric", True) is not True:
        raise ConfigError(f"{where}.input_activations.symmetric is {activations.get('symmetric')!r}: FP8 "
                          "activations are symmetric")
    dynamic, strategy = activations.get("dynamic", False), activations.get("strategy")
    if dynamic is True and strategy in ("token", "tensor"):
        return "dynamic"
    if dynamic is False and strategy == "tensor":
        return "static"
    raise ConfigError(f"{where}.input_activations (dynamic {dynamic!r}, strategy {strategy!r}) is not supported: "
                      "expected dynamic per-token / per-tensor, or static per-tensor FP8 activations")


def _string_list(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    for entry in value:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise ConfigError(f"{where}: {entry!r} is not a valid regular expression ({e})") from None
    return tuple(value)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[_Group], ignore: tuple[str, ...], where: str,
                 checkpoint_modules: Callable[[str], list[str]] | None = None,
                 kv_cache_scheme: dict | None = None) -> None:
        self.groups = groups
        self.ignore = ignore
        self.where = where
        self.kv_cache_scheme = kv_cache_scheme  # only named in errors: kv_scales.py reads it
        self.checkpoint_modules = checkpoint_modules or (lambda module: [module])
        self.activation_scheme = "dynamic"  # per group; read by Fp8LinearMethod only as a default
        self._warned_cpu = False
        self._warned_dequantized = False

    @classmethod
    def from_hf(cls, cfg: dict, where: str,
                checkpoint_modules: Callable[[str], list[str]] | None = None) -> "CompressedTensorsConfig":
        top_format = cfg.get("format")
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            # Saved before compression (llm-compressor's save_compressed=False): 16-bit weights
            # that only simulate the scheme, with no FP8 codes to load.
            raise ConfigError(f"{where}.quantization_status is {status!r}: only 'compressed' checkpoints (FP8 "
                              "weights on disk) are supported")
        sparsity = cfg.get("sparsity_config") or {}
        if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
            fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
            raise ConfigError(f"{where}.sparsity_config has format {fmt!r}: sparse-compressed weights are not "
                              "supported (only 'dense' storage)")
        if cfg.get("transform_config"):
            # Rotations (SpinQuant / QuIP Hadamards) the model must apply to its activations at run
            # time: loading the weights without them would run a different model.
            raise ConfigError(f"{where}.transform_config is set: weight/activation transforms (Hadamard "
                              "rotations) are not supported")
        groups_cfg = cfg.get("config_groups")
        if not isinstance(groups_cfg, dict) or not groups_cfg:
            raise ConfigError(f"{where}.config_groups must be a non-empty object")
        groups = []
        for name, group in groups_cfg.items():
            gwhere = f"{where}.config_groups.{name}"
            if not isinstance(group, dict):
                raise ConfigError(f"{gwhere} must be an object")
            fmt = group.get("format") or top_format
            if fmt not in FP8_FORMATS:
                raise ConfigError(f"{gwhere}: format {fmt!r} is not supported (supported: {', '.join(FP8_FORMATS)}, "
                                  "FP8 weights)")
            if group.get("output_activations") is not None:
                raise ConfigError(f"{gwhere}.output_activations is set: output quantization is not supported")
            targets = _string_list(group.get("targets"), f"{gwhere}.targets")
            if not targets:
                raise ConfigError(f"{gwhere}.targets is empty")
            activations = group.get("input_activations")
            scheme = Fp8Scheme(_weights_scheme(group.get("weights"), gwhere), _activation_scheme(activations, gwhere))
            spelled = "null" if activations is None else scheme.activation_scheme
            groups.append(_Group(name, targets, scheme, fmt, spelled))
        ignore = _string_list(cfg.get("ignore") or [], f"{where}.ignore")
        return cls(groups, ignore, where, checkpoint_modules, cfg.get("kv_cache_scheme"))

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return fp8_checkpoint_vocab_dtype(compute_dtype, checkpoint_dtype)

    def _group_of(self, module: str) -> _Group | None:
        if any(_matches(entry, module) for entry in self.ignore):
            return None
        # compressed-tensors' precedence: a target naming the module, then a regex, then the class.
        for kind in ("name", "regex", "class"):
            for group in self.groups:
                if any(_target_kind(t) == kind and _matches(t, module) for t in group.targets):
                    return group
        return None

    def _scheme_of(self, module: str) -> Fp8Scheme | None:
        group = self._group_of(module)
        return group.scheme if group is not None else None

    def explain_checkpoint_tensor(self, name: str, dtype: torch.dtype) -> str | None:
        """Which field of this config rules out checkpoint tensor `name` that the model has
        no place for (targets and ignore name checkpoint modules, as `name` does); None when
        it has nothing to say (the loader's generic message)."""
        kind = checkpoint_tensor_kind(name, dtype)
        if kind is None:
            return None
        if kind == KV_ZERO_POINT:
            # kv_scales.py has already refused any KV scheme but symmetric FP8.
            state = "says symmetric" if self.kv_cache_scheme else "is not set"
            return f"{kind}, but {self.where}.kv_cache_scheme {state}{DISAGREE}"
        module, _, suffix = name.rpartition(".")
        group = self._group_of(module)
        if group is None:
            why = (f"it matches {self.where}.ignore" if any(_matches(e, module) for e in self.ignore)
                   else f"no group of {self.where}.config_groups targets it")
            return f"{kind}, but {self.where} leaves {module} unquantized ({why}){DISAGREE}"
        field = f"{self.where}.config_groups.{group.name}"
        if suffix == "weight_zero_point":
            field += ".weights says symmetric"
        elif suffix in ("input_scale", "input_zero_point") and group.activations == "null":
            field += ".input_activations is null (16-bit activations)"
        elif suffix == "input_scale" and group.activations == "dynamic":
            field += ".input_activations says dynamic"
        elif suffix == "input_zero_point":
            field += ".input_activations says symmetric"
        elif suffix.startswith("output_"):
            field += ".output_activations is null"  # from_hf refuses any other
        elif suffix in ("weight_packed", "weight_shape"):
            field += f".format is {group.format!r} (FP8 weights)"
        elif suffix == "weight_g_idx":
            field += f".weights.strategy is {group.scheme.weight_strategy!r}"
        else:
            return None
        return f"{kind}, but {field}{DISAGREE}"

    def get_linear_method(self, prefix: str) -> LinearMethod:
        modules = self.checkpoint_modules(prefix)
        schemes = {m: self._scheme_of(m) for m in modules}
        if len(set(schemes.values())) > 1:
            # One fused matmul has one weight dtype: q/k/v (or gate/up) must agree.
            detail = ", ".join(f"{m}: {s or 'not quantized'}" for m, s in schemes.items())
            raise ConfigError(f"{self.where}: the projections fused into {prefix} are quantized differently "
                              f"({detail}); fp8serve needs them quantized alike")
        scheme = next(iter(schemes.values()))
        if scheme is None:
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self, scheme.weight_strategy, scheme.activation_scheme)


def explain_without_weight_config(name: str, dtype: torch.dtype, hf_quant_config, config_json: str) -> str | None:
    """`CompressedTensorsConfig.explain_checkpoint_tensor` for a checkpoint whose config.json
    declares no quantized weights (no quantization_config, or compressed-tensors with only a
    kv_cache_scheme), so that there is no config to ask: FP8 weights and their scales have
    no place in its 16-bit layers. None for a config that declares weights."""
    kind = checkpoint_tensor_kind(name, dtype)
    if kind is None or kind == KV_ZERO_POINT:
        return None
    if not hf_quant_config:
        return f"{kind}, but {config_json} has no quantization_config{DISAGREE}"
    if (isinstance(hf_quant_config, dict) and hf_quant_config.get("quant_method") == "compressed-tensors"
            and not hf_quant_config.get("config_groups")):
        return (f"{kind}, but {config_json}: quantization_config.config_groups is not set (without it "
                f"compressed-tensors quantizes only the KV cache){DISAGREE}")
    return None
