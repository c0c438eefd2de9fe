"""Declarative mapping from checkpoint tensor names to model parameter names.

Each model declares a list of rules; the loader and the `scales` command apply
the same rules, so a checkpoint's `self_attn.kv_scale` lands on the attention
layer whether we load the whole model or only inspect its scales.

Rules match whole dotted components (``self_attn.k_proj`` matches
``model.layers.3.self_attn.k_proj.weight`` but never ``self_attn.k_proj2``),
and the first matching rule wins, so specific rules (``k_proj.output_scale``)
must be listed before general ones (``k_proj``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter and, for fused
    parameters, which shard of it (``"q"``/``"k"``/``"v"`` or an int)."""

    param_name: str
    shard_id: str | int | None = None


@dataclass(frozen=True)
class MappingRule:
    checkpoint: str  # dotted components as they appear in the checkpoint
    params: tuple[str, ...]  # replacement components; several = one-to-many
    shard_id: str | int | None = None

    def pattern(self) -> re.Pattern[str]:
        # `*` stands for one dotted component (an expert index, say) and is
        # carried over to the same `*` in the replacement.
        body = r"\.".join("([^.]+)" if c == "*" else re.escape(c) for c in self.checkpoint.split("."))
        return re.compile(r"(?:(?<=\.)|^)" + body + r"(?=\.|$)")

    def replacement(self, param: str) -> str:
        parts, n = [], 0
        for c in param.split("."):
            if c == "*":
                n += 1
                parts.append(f"\\{n}")
            else:
                parts.append(c.replace("\\", "\\\\"))
        return ".".join(parts)


@dataclass
class WeightsMapper:
    rules: list[MappingRule] = field(default_factory=list)
    # Dotted components of checkpoint tensors that are never loaded
    # (e.g. ``rotary_emb.inv_freq`` that old exports carry).
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._compiled = [(r, r.pattern()) for r in self.rules]
        self._ignored = [MappingRule(i, ()).pattern() for i in self.ignored]

    def is_ignored(self, name: str) -> bool:
        return any(p.search(name) for p in self._ignored)

    def map(self, name: str) -> list[WeightTarget]:
        """Targets for checkpoint tensor `name`; [] when it is ignored.

        A name no rule touches maps to itself."""
        if self.is_ignored(name):
            return []
        for rule, pat in self._compiled:
            if pat.search(name):
                return [
                    WeightTarget(pat.sub(rule.replacement(p), name, count=1), rule.shard_id)
                    for p in rule.params
                ]
        return [WeightTarget(name)]

    def checkpoint_modules(self, module: str) -> list[str]:
        """The checkpoint modules whose tensors load into model module `module`:
        the inverse of `map` for module names, in rule order (models list a
        fused module's shards in order): ``model.layers.0.mlp.experts.3.gate_up_proj``
        -> ``[...block_sparse_moe.experts.3.w1, ...block_sparse_moe.experts.3.w3]``.
        Quantization configs name checkpoint modules, the model fused ones."""
        found = [m for rule in self.rules for param in rule.params if (m := _invert(rule, param, module)) is not None]
        return found or [module]

    def checkpoint_module(self, module: str, shard_id: str | int | None = None) -> str | None:
        """The one checkpoint module whose tensors load into shard `shard_id` of model
        module `module` (None: into the whole of it), for naming a missing tensor as the
        checkpoint spells it: ``model.layers.0.mlp.experts.3.down_proj`` ->
        ``model.layers.0.block_sparse_moe.experts.3.w2``. A module no rule names is its
        own; None where no rule, or more than one, gives that part."""
        found = [(rule, m) for rule in self.rules for param in rule.params
                 if (m := _invert(rule, param, module)) is not None]
        if not found:
            return module if shard_id is None else None
        exact = [m for rule, m in found if rule.shard_id == shard_id and len(rule.params) == 1]
        return exact[0] if len(exact) == 1 else None


def _invert(rule: MappingRule, param: str, module: str) -> str | None:
    """The checkpoint module `rule` maps onto model module `module` through its
    replacement `param`, wildcards carried back; None where `param` does not name it."""
    body = r"\.".join("([^.]+)" if c == "*" else re.escape(c) for c in param.split("."))
    m = re.search(r"(?:^|\.)" + body + "$", module)
    if m is None:
        return None
    head = module[:m.start() + (1 if module[m.start()] == "." else 0)]
    wildcards = iter(m.groups())
    return head + ".".join(next(wildcards) if c == "*" else c for c in rule.checkpoint.split("."))


def layer_index(param_name: str) -> int | None:
    """The decoder layer a parameter belongs to (``...layers.7...`` -> 7)."""
    m = _LAYER_RE.search(param_name)
    return int(m.group(1)) if m else None


def kv_scale_rules() -> list[MappingRule]:
    """The three KV-scale name families found in real checkpoints, mapped to
    the shared Attention layer's ``k_scale``/``v_scale``.

    - the seed PR's single ``self_attn.kv_scale`` (one scale for K and V);
    - ``self_attn.k_scale`` / ``self_attn.v_scale`` (AutoFP8, vLLM >= 0.6);
    - compressed-tensors ``self_attn.{k,v}_proj.output_scale``.
    """
    return [
        MappingRule("self_attn.kv_scale", ("self_attn.attn.k_scale", "self_attn.attn.v_scale")),
        MappingRule("self_attn.k_proj.output_scale", ("self_attn.attn.k_scale",)),
        MappingRule("self_attn.v_proj.output_scale", ("self_attn.attn.v_scale",)),
        MappingRule("self_attn.k_scale", ("self_attn.attn.k_scale",)),
        MappingRule("self_attn.v_scale", ("self_attn.attn.v_scale",)),
    ]


def is_kv_scale_param(param_name: str) -> bool:
    return param_name.endswith(".attn.k_scale") or param_name.endswith(".attn.v_scale")
