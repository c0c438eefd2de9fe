"""Absolute-maximum observers, and the scales they imply.

`KVAmaxObserver` watches every Attention layer through its `kv_observer`
hook, which sees K after RoPE and V exactly as they are written to the cache.
`InputAmaxObserver` watches the inputs of linear modules through torch forward
pre-hooks. Both keep running maxima as Python floats (one sync per layer per
chunk), so observing thousands of tokens costs no memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

# float8_e4m3fn's largest finite value; the scales we write are for e4m3
# (the schema's "float8_e4m3fn"), whatever format later reads them.
E4M3_MAX = 448.0
# An all-zero tensor would give scale 0, which every loader rejects (and which
# would divide by zero on write); any tiny positive scale stores zeros exactly.
MIN_SCALE = 1e-12


def scale_from_amax(amax: float, margin: float = 1.0, fp8_max: float = E4M3_MAX) -> float:
    """margin * amax / fp8_max: the smallest scale that stores `amax` without
    saturating, times a safety factor for values larger than any observed."""
    if not (math.isfinite(amax) and amax >= 0):
        raise ValueError(f"amax must be a finite number >= 0, got {amax!r}")
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a finite number > 0, got {margin!r}")
    return max(margin * amax / fp8_max, MIN_SCALE)


def _amax(x: torch.Tensor) -> float:
    return float(x.detach().abs().amax().float())


@dataclass
class LayerKVAmax:
    layer: int
    k_amax: float = 0.0
    v_amax: float = 0.0
    num_tokens: int = 0
    # Per KV head (for kv_cache_scheme strategy attn_head); empty until the layer runs.
    k_head_amax: list[float] = field(default_factory=list)
    v_head_amax: list[float] = field(default_factory=list)

    def k_scale(self, margin: float = 1.0) -> float:
        return scale_from_amax(self.k_amax, margin)

    def v_scale(self, margin: float = 1.0) -> float:
        return scale_from_amax(self.v_amax, margin)

    def k_head_scales(self, margin: float = 1.0) -> list[float]:
        return [scale_from_amax(a, margin) for a in self.k_head_amax]

    def v_head_scales(self, margin: float = 1.0) -> list[float]:
        return [scale_from_amax(a, margin) for a in self.v_head_amax]


class KVAmaxObserver:
    """Per-layer (and per-KV-head) amax of K and V over everything the layers see while attached.

    Layers are numbered by their position in `attn_layers`, which is the
    decoder layer index (the order the engine assigns scales in)."""

    def __init__(self, attn_layers: list[nn.Module]) -> None:
        self.attn_layers = list(attn_layers)
        self.stats = [LayerKVAmax(i) for i in range(len(self.attn_layers))]
        self._index = {id(layer): i for i, layer in enumerate(self.attn_layers)}

    def _observe(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [num_tokens, num_kv_heads, head_size]
        s = self.stats[self._index[id(layer)]]
        # One sync for both tensors' per-head maxima; the layer amax is their max.
        heads = torch.stack([key.detach().abs().amax(dim=(0, 2)), value.detach().abs().amax(dim=(0, 2))])
        k_heads, v_heads = heads.float().tolist()
        s.k_head_amax = [max(a, b) for a, b in zip(s.k_head_amax, k_heads)] if s.k_head_amax else k_heads
        s.v_head_amax = [max(a, b) for a, b in zip(s.v_head_amax, v_heads)] if s.v_head_amax else v_heads
        s.k_amax = max(s.k_amax, max(k_heads))
        s.v_amax = max(s.v_amax, max(v_heads))
        s.num_tokens += key.shape[0]

    def attach(self) -> "KVAmaxObserver":
        for layer in self.attn_layers:
            if layer.kv_observer is not None:
                raise RuntimeError(f"{getattr(layer, 'prefix', 'attention layer')} already has a kv_observer")
            layer.kv_observer = self._observe
        return self

    def detach(self) -> None:
        for layer in self.attn_layers:
            if layer.kv_observer == self._observe:
                layer.kv_observer = None

    def __enter__(self) -> "KVAmaxObserver":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()


class InputAmaxObserver:
    """amax of the input of each watched module, by module name.

    A module that never ran (a Mixtral expert no calibration token was routed
    to) keeps amax None; callers decide what to do about it."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = dict(modules)
        self.amax: dict[str, float | None] = {name: None for name in self.modules}
        self.num_tokens: dict[str, int] = {name: 0 for name in self.modules}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]  # [num_tokens, input_size]
            if x.numel() == 0:
                return
            previous = self.amax[name]
            value = _amax(x)
            self.amax[name] = value if previous is None else max(previous, value)
            self.num_tokens[name] += x.reshape(-1, x.shape[-1]).shape[0]

        return hook

    def attach(self) -> "InputAmaxObserver":
        if self._handles:
            raise RuntimeError("InputAmaxObserver is already attached")
        self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "InputAmaxObserver":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()
