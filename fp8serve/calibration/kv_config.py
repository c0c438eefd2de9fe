"""A KV cache configuration to evaluate or compare: dtype + where scales come from.

Spelled on the command line as ``DTYPE[:SCALES]``:

  DTYPE   auto | bfloat16 | float16 | float32 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
  SCALES  default     whatever the engine resolves: an FP8-KV checkpoint's own
                      scales, else 1.0 (the default when SCALES is left out)
          json=FILE   --quantization-param-path FILE
          calculate   --calculate-kv-scales (from the first prefill)
          scale1      k_scale = v_scale = 1.0 in every layer, ignoring any the
                      checkpoint carries (set after load)

e.g. ``fp8_e4m3:scale1``, ``fp8_e4m3:json=scales.json``, ``fp8_e4m3:calculate``, ``fp8_e5m2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8serve.errors import UserError

KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_MODES = ("default", "json", "calculate", "scale1")
SPEC_HELP = ("DTYPE[:SCALES], DTYPE one of " + ", ".join(KV_DTYPES)
             + "; SCALES one of default (checkpoint scales or 1.0), json=FILE, calculate, scale1 (force 1.0)")


@dataclass(frozen=True)
class KVConfig:
    kv_cache_dtype: str
    scales: str = "default"  # one of SCALE_MODES
    json_path: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "KVConfig":
        dtype, sep, scales = spec.partition(":")
        if dtype not in KV_DTYPES:
            raise UserError(f"KV config '{spec}': unknown KV cache dtype '{dtype}' (expected {SPEC_HELP})")
        dtype = "fp8_e4m3" if dtype == "fp8" else dtype
        if sep and not scales:
            raise UserError(f"KV config '{spec}': nothing after ':' (expected {SPEC_HELP})")
        scales = scales or "default"
        if scales != "default" and not dtype.startswith("fp8"):
            # The engine ignores scales for a 16/32-bit cache, so such a row would silently
            # repeat the unscaled configuration under another label.
            raise UserError(f"KV config '{spec}': scales apply to an FP8 KV cache only; "
                            f"use fp8_e4m3:{scales} or fp8_e5m2:{scales}, or '{dtype}' alone")
        if scales.startswith("json="):
            path = scales.removeprefix("json=")
            if not path:
                raise UserError(f"KV config '{spec}': json= needs a file, e.g. {dtype}:json=scales.json")
            if Path(path).is_dir():
                raise UserError(f"KV config '{spec}': scale file '{path}' is a directory; expected a JSON file")
            if not Path(path).is_file():
                raise UserError(f"KV config '{spec}': scale file '{path}' not found")
            return cls(dtype, "json", path)
        if scales not in ("default", "calculate", "scale1"):
            raise UserError(f"KV config '{spec}': unknown scales '{scales}' (expected {SPEC_HELP})")
        return cls(dtype, scales)

    @classmethod
    def for_dtypes(cls, dtypes: list[str], json_path: str | None = None,
                   calculate: bool = False) -> list["KVConfig"]:
        """The --kv-cache-dtype D [D ...] form: each dtype with the scales the
        --quantization-param-path / --calculate-kv-scales flags give."""
        suffix = f":json={json_path}" if json_path else ":calculate" if calculate else ""
        if suffix:
            flag = "--quantization-param-path" if json_path else "--calculate-kv-scales"
            unscaled = [d for d in dtypes if d in KV_DTYPES and not d.startswith("fp8")]
            if unscaled:
                raise UserError(f"{flag} applies to FP8 KV caches only, but --kv-cache-dtype includes "
                                f"{', '.join(unscaled)}; evaluate those without scales via --config/@SPEC")
        return [cls.parse(d + suffix) for d in dtypes]

    @property
    def label(self) -> str:
        if self.scales == "default":
            return self.kv_cache_dtype
        if self.scales == "json":
            return f"{self.kv_cache_dtype}:json={Path(self.json_path).name}"
        return f"{self.kv_cache_dtype}:{self.scales}"

    @property
    def scales_description(self) -> str:
        return f"json:{self.json_path}" if self.scales == "json" else self.scales

    def engine_kwargs(self) -> dict:
        return dict(
            kv_cache_dtype=self.kv_cache_dtype,
            quantization_param_path=self.json_path,
            calculate_kv_scales=self.scales == "calculate",
        )

    def apply_after_load(self, llm) -> None:
        """`scale1`: overwrite whatever scales the engine resolved with 1.0,
        the seed's "FP8 checkpoint, scale 1.0" configuration."""
        if self.scales == "scale1":
            for layer in llm.llm_engine.model_runner.attn_layers:
                layer.set_kv_scales(1.0, 1.0, "forced:1.0")


def scale_summary(llm) -> dict:
    """The scales the engine's layers hold now: source(s) and ranges."""
    layers = llm.llm_engine.model_runner.attn_layers
    sources = sorted({layer.kv_scale_source.split(":")[0] for layer in layers})
    ks = [float(layer.k_scale) for layer in layers]
    vs = [float(layer.v_scale) for layer in layers]
    return {"scale_source": ",".join(sources), "k_scale_range": [min(ks), max(ks)],
            "v_scale_range": [min(vs), max(vs)]}
