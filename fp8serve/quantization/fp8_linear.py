"""FP8 weight checkpoints (`quant_method: "fp8"`, AutoFP8 / llm-compressor layout).

On disk each quantized linear has a `float8_e4m3fn` weight and a float32
per-tensor `weight_scale`; static activation schemes add a per-tensor
`input_scale`. A fused layer (qkv, gate_up) receives one scale per shard,
and the shards' scales may differ, so scales are kept per shard.
compressed-tensors checkpoints (compressed_tensors.py) use the same method,
also with per-channel weight scales (`weight_scale` [out, 1]: one per row).

CPU path (weight-only): weights stay FP8, one byte each, as uint8 e4m3 codes
with one float32 scale per output row (each shard's scale repeated over its
rows, so fused shards with different scales need no requantization). `apply`
runs `fp8serve.kernels.fp8_linear_ops.fp8_linear`: decoded in registers for
few rows (decode), decoded block by block into a float GEMM for many
(prefill). Activations stay in the compute dtype (float32 or bfloat16) and are
not quantized, so a static `input_scale` is loaded, validated and kept but not
applied; the model's numerics are those of its FP8 weights. The engine reports
it in the load log. Without the C++ kernels (no compiler,
FP8SERVE_DISABLE_CPU_KERNELS) or with another compute dtype, weights are
decoded (`fp8 * scale`, per shard) into the compute dtype at load and the layer
runs as a float matmul.

CUDA path (compute capability >= 8.9): weights stay FP8, requantized to one
per-tensor scale (the shards' maximum), and the layer runs `torch._scaled_mm`
with activations quantized per tensor (static: `input_scale`; dynamic: amax
of the batch).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from fp8serve.errors import ConfigError
from fp8serve.kernels import amx_linear_ops, cpu_ops, fp8_linear_ops, onednn_linear
from fp8serve.quantization.base import LinearMethod, QuantizationConfig, set_weight_loader
from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8, quantize_fp8
from fp8serve.quantization.loaders import load_fp8_output_shard, load_per_shard_scalar, load_row_scales
from fp8serve.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

ACTIVATION_SCHEMES = ("static", "dynamic")


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, activation_scheme: str, ignored_layers: list[str],
                 checkpoint_modules: Callable[[str], list[str]] | None = None, where: str = "fp8") -> None:
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers
        # Our layer -> the checkpoint modules it loads from (WeightsMapper.checkpoint_modules):
        # ignored_layers names checkpoint modules (q_proj, block_sparse_moe.experts.0.w1).
        self.checkpoint_modules = checkpoint_modules or (lambda module: [module])
        self.where = where
        self._warned_cpu = False
        self._warned_dequantized = False

    @classmethod
    def from_hf(cls, cfg: dict, where: str,
                checkpoint_modules: Callable[[str], list[str]] | None = None) -> "Fp8Config":
        if cfg.get("weight_block_size") is not None:
            # DeepSeek / Qwen style: a scale per 128 x 128 block (`weight_scale_inv`), which the
            # per-row CPU kernels cannot apply without requantizing.
            raise ConfigError(f"{where}.weight_block_size is {cfg['weight_block_size']}: block-wise FP8 weights are "
                              "not supported (fp8serve loads per-tensor and per-channel FP8 weights)")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ConfigError(f"{where}.activation_scheme is '{scheme}', expected one of {', '.join(ACTIVATION_SCHEMES)}")
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or []
        if not isinstance(ignored, list) or not all(isinstance(x, str) for x in ignored):
            raise ConfigError(f"{where}.ignored_layers must be a list of layer names")
        return cls(scheme, ignored, checkpoint_modules, where)

    def _is_ignored(self, module: str) -> bool:
        # Mixtral routers are never quantized by AutoFP8/llm-compressor.
        return (module.endswith("lm_head") or module.endswith("block_sparse_moe.gate")
                or any(module == name or module.endswith("." + name) for name in self.ignored_layers))

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return fp8_checkpoint_vocab_dtype(compute_dtype, checkpoint_dtype)

    def explain_checkpoint_tensor(self, name: str, dtype: torch.dtype) -> str | None:
        """Which field of this config rules out checkpoint tensor `name` that the model has
        no place for; None when it has nothing to say (the loader's generic message)."""
        kind = checkpoint_tensor_kind(name, dtype)
        if kind is None:
            return None
        module, _, suffix = name.rpartition(".")
        if kind != KV_ZERO_POINT and self._is_ignored(module):
            return (f"{kind}, but {self.where} leaves {module} unquantized (lm_head, MoE routers and "
                    f"{self.where}.ignored_layers are){DISAGREE}")
        if suffix == "input_scale" and self.activation_scheme == "dynamic":
            return f"{kind}, but {self.where}.activation_scheme is 'dynamic'{DISAGREE}"
        if kind == KV_ZERO_POINT or suffix.endswith("_zero_point"):
            return f"{kind}, but {self.where}.quant_method is 'fp8': symmetric FP8, no zero points{DISAGREE}"
        if suffix in ("output_scale", "weight_packed", "weight_shape", "weight_g_idx"):
            return f"{kind}, but {self.where}.quant_method is 'fp8' (per-tensor FP8 weights){DISAGREE}"
        return None

    def get_linear_method(self, prefix: str) -> LinearMethod:
        ignored = {module: self._is_ignored(module) for module in self.checkpoint_modules(prefix)}
        if len(set(ignored.values())) > 1:
            # One fused matmul has one weight dtype.
            listed = ", ".join(m for m, i in ignored.items() if i)
            raise ConfigError(f"{self.where}.ignored_layers lists {listed} but not the projections fused with it "
                              f"into {prefix}; fp8serve needs them quantized alike")
        if all(ignored.values()):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self)


def fp8_checkpoint_vocab_dtype(compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """FP8 checkpoints keep the embedding / LM head unquantized at the
    checkpoint's 16-bit width (as llm-compressor writes them). With float32
    compute it stays there: upcasting is exact and buys nothing (the LM
    head accumulates in float32 either way), yet it doubles the largest
    read of a decode step (SmolLM2's tied head: 57 -> 113 MB of 220 MB)."""
    if compute_dtype == torch.float32 and checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return compute_dtype


WEIGHT_STRATEGIES = ("tensor", "channel")

# Quantization tensors a checkpoint may hold for a layer, by their last name component, as
# compressed-tensors / AutoFP8 write them: named when a config field rules one out (an int
# scheme's zero point, a static scale under a dynamic scheme).
_TENSOR_KINDS = {
    "weight_scale": "is an FP8 weight scale",
    "input_scale": "is a static activation scale",
    "output_scale": "is an output activation scale",
    "weight_zero_point": "is a zero point of asymmetric weights",
    "input_zero_point": "is a zero point of asymmetric activations",
    "output_zero_point": "is a zero point of asymmetric output activations",
    "weight_packed": "holds packed integer weights (compressed-tensors' pack-quantized format)",
    "weight_shape": "is a packed weight's shape (compressed-tensors' pack-quantized format)",
    "weight_g_idx": "is a GPTQ group index (activation ordering of grouped int weights)",
}
# An asymmetric KV cache's zero points: on the attention, or as k/v_proj output zero points.
_KV_ZERO_POINTS = (".self_attn.k_zero_point", ".self_attn.v_zero_point", ".self_attn.k_proj.output_zero_point",
                   ".self_attn.v_proj.output_zero_point")
KV_ZERO_POINT = "is a zero point of an asymmetric KV cache"
DISAGREE = ": the config and the weights disagree"


def checkpoint_tensor_kind(name: str, dtype: torch.dtype) -> str | None:
    """What quantization tensor `name` is ("is an FP8 weight scale", ...), None for one
    no scheme here writes."""
    if ("." + name).endswith(_KV_ZERO_POINTS):
        return KV_ZERO_POINT
    suffix = name.rpartition(".")[2]
    if suffix == "weight" and dtype.is_floating_point and dtype.itemsize == 1:
        return f"holds FP8 ({dtype}) weights"
    return _TENSOR_KINDS.get(suffix)


def _why_dequantized(device: torch.device, dtype: torch.dtype, per_row: bool) -> str:
    if device.type == "cuda":
        return ("per-channel scales take no scaled matmul here" if per_row and _use_scaled_mm(device)
                else "this GPU has no FP8 matmul (compute capability 8.9 or newer)")
    if device.type == "cpu" and dtype not in (torch.float32, torch.bfloat16):
        return (f"the CPU FP8 kernels take float32 or bfloat16 activations, not {dtype}: "
                "--dtype bfloat16 keeps 1 byte")
    return f"no FP8 kernels for {device.type} here (the CPU kernels did not load: see the warning above)"


def _use_scaled_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _use_cpu_kernel(device: torch.device, compute_dtype: torch.dtype) -> bool:
    return device.type == "cpu" and compute_dtype in (torch.float32, torch.bfloat16) and fp8_linear_ops.is_available()


def _shard_of_row(layer, row: int) -> int:
    end = 0
    for index, size in enumerate(layer.output_sizes):
        end += size
        if row < end:
            return index
    raise IndexError(row)


class Fp8LinearMethod(LinearMethod):
    """`weight_strategy`: "tensor" (one weight_scale per checkpoint tensor) or
    "channel" (one per output row); `activation_scheme`: "static" (an
    input_scale per tensor) or "dynamic"; both default to the config's."""

    def __init__(self, config: QuantizationConfig, weight_strategy: str = "tensor",
                 activation_scheme: str | None = None) -> None:
        if weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight_strategy must be one of {WEIGHT_STRATEGIES}, got {weight_strategy!r}")
        self.config = config
        self.weight_strategy = weight_strategy
        self.activation_scheme = activation_scheme or config.activation_scheme
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme must be one of {ACTIVATION_SCHEMES}, got {self.activation_scheme!r}")

    def create_weights(self, layer, input_size, output_sizes, params_dtype) -> None:
        layer.compute_dtype = params_dtype
        n = len(output_sizes)
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=torch.float8_e4m3fn), requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, load_fp8_output_shard(layer)))
        # NaN until loaded: a missing scale fails loudly instead of silently 0.
        if self.weight_strategy == "channel":
            scale = nn.Parameter(torch.full((sum(output_sizes),), float("nan"), dtype=torch.float32),
                                 requires_grad=False)
            layer.register_parameter("weight_scale", set_weight_loader(scale, load_row_scales(layer)))
        else:
            scale = nn.Parameter(torch.full((n,), float("nan"), dtype=torch.float32), requires_grad=False)
            layer.register_parameter("weight_scale", set_weight_loader(scale, load_per_shard_scalar(layer)))
        if self.activation_scheme == "static":
            inp = nn.Parameter(torch.full((n,), float("nan"), dtype=torch.float32), requires_grad=False)
            layer.register_parameter("input_scale", set_weight_loader(inp, load_per_shard_scalar(layer)))
        else:
            layer.input_scale = None

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "prefix", "linear")
        for pname in ("weight_scale", "input_scale"):
            s = getattr(layer, pname, None)
            if s is not None and not (torch.isfinite(s).all() and (s > 0).all()):
                # Name the projection (q/k/v, gate/up) whose scale is bad: the
                # checkpoint stores one tensor per projection, not the fused one.
                bad = [i for i, v in enumerate(s.tolist()) if not (math.isfinite(v) and v > 0)]
                per_row = s.numel() != len(layer.output_sizes)
                bad_shards = sorted({_shard_of_row(layer, i) for i in bad}) if per_row else bad
                names = getattr(layer, "shard_names", None)
                shards = [names[i] if names else i for i in bad_shards]
                which = f" of shard(s) {shards}" if len(layer.output_sizes) > 1 else ""
                values = (f"{len(bad)} of {s.numel()} rows, e.g. row {bad[0]}: {s[bad[0]].item()}" if per_row
                          else s.tolist())
                # And as the checkpoint spells them: an unfused expert's w2, not experts.0.down_proj.
                modules = getattr(self.config, "checkpoint_modules", lambda m: [m])(name)
                in_ckpt = ([f"{modules[i]}.{pname}" for i in bad_shards]
                           if len(modules) == len(layer.output_sizes) else [])
                tail = f"; checkpoint tensor(s) {', '.join(in_ckpt)}" if in_ckpt != [f"{name}.{pname}"] else ""
                raise ConfigError(f"FP8 checkpoint: '{name}.{pname}'{which} is missing or not a finite number > 0 "
                                  f"({values}){tail}")
        codes = layer.weight.data.view(torch.uint8)
        # e4m3fn's only non-finite codes; the CPU kernel would read them as +-480.
        if ((codes & 0x7F) == 0x7F).any():
            raise ConfigError(f"FP8 checkpoint: '{name}.weight' contains NaN codes")
        offsets = [0]
        for size in layer.output_sizes:
            offsets.append(offsets[-1] + size)
        per_row = self.weight_strategy == "channel"
        row_scales = (layer.weight_scale.data.float().contiguous() if per_row else
                      fp8_linear_ops.expand_shard_scales(layer.weight_scale.data, layer.output_sizes))  # [N]
        if _use_scaled_mm(codes.device) and not per_row:
            # Per-channel scales take the dequantized path below on CUDA (untested
            # here: no rowwise-scaled _scaled_mm without a GPU to check it on).
            scales = layer.weight_scale.data.tolist()
            # One scale for the fused matmul: requantize shards to the max.
            max_scale = max(scales)
            w = torch.cat([
                dequantize_fp8(codes[a:b], s, FP8_E4M3, torch.float32) for (a, b), s in zip(zip(offsets, offsets[1:]), scales)
            ])
            layer.weight = nn.Parameter(quantize_fp8(w, max_scale, FP8_E4M3).view(torch.float8_e4m3fn).t(), requires_grad=False)
            layer.weight_scale = nn.Parameter(torch.tensor(max_scale, device=codes.device), requires_grad=False)
            if layer.input_scale is not None:
                layer.input_scale = nn.Parameter(layer.input_scale.max(), requires_grad=False)
            layer.fp8_backend = "scaled_mm"
            return
        dtype = layer.compute_dtype
        if layer.input_scale is not None and not self.config._warned_cpu:
            self.config._warned_cpu = True
            logger.info("FP8 checkpoint with static activation scales: on this device the input_scale values are "
                        "validated but activations are not quantized (weight-only FP8)")
        if _use_cpu_kernel(codes.device, dtype):
            layer.weight = nn.Parameter(codes.contiguous(), requires_grad=False)  # [N, K] uint8
            layer.weight_scale = nn.Parameter(row_scales, requires_grad=False)  # [N] float32
            layer.fp8_backend = "cpu_kernel"
            return
        if not self.config._warned_dequantized:
            # Said once: the model then holds 2-4 bytes per weight and loses FP8's decode speed.
            self.config._warned_dequantized = True
            logger.warning("FP8 weights dequantized to %s at load (%s): they take %d bytes per weight, not 1",
                           str(dtype).removeprefix("torch."), _why_dequantized(codes.device, dtype, per_row),
                           dtype.itemsize)
        # float32 products, one rounding to `dtype`: the same values the kernels compute with.
        w = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        for a, b in zip(offsets, offsets[1:]):
            w[a:b] = dequantize_fp8(codes[a:b], row_scales[a:b, None], FP8_E4M3, torch.float32).to(dtype)
        layer.weight = nn.Parameter(w, requires_grad=False)
        layer.fp8_backend = "dequantized"

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_backend == "dequantized":
            return onednn_linear.linear(x, layer.weight, bias, packed=layer.weight_packed)
        if cpu_ops.fp8_gemv_packed_applies(x, getattr(layer, "weight_gemv_packed", None)):
            # bf16 batches of 1-512 rows on the packed codes, where the engine made them (gemv_packing.py).
            return cpu_ops.fp8_gemv_packed(x, layer.weight_gemv_packed, layer.weight_scale_gemv_packed,
                                           layer.weight.shape[0], bias)
        if layer.fp8_backend == "cpu_kernel" and x.dim() == 2:
            # The engine's activations are [num_tokens, hidden]: no reshapes
            # (two ATen calls per linear, ~0.6 ms of a batch-1 step).
            return fp8_linear_ops.fp8_linear_loaded(x, layer.weight, layer.weight_scale, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.fp8_backend == "cpu_kernel":
            out = fp8_linear_ops.fp8_linear_loaded(x2, layer.weight, layer.weight_scale, bias)
            return out.reshape(*shape[:-1], out.shape[-1])
        if layer.input_scale is not None:
            x_scale = layer.input_scale
        else:
            x_scale = (x2.abs().max().float() / FP8_E4M3.max_finite).clamp(min=1e-12)
        xq = (x2.float() / x_scale).clamp(-FP8_E4M3.max_finite, FP8_E4M3.max_finite).to(torch.float8_e4m3fn)
        # cuBLAS takes a fused bias only for 16-bit outputs ("Bias is not
        # supported when out_dtype is set to Float32"): add it after.
        fused_bias = bias if x.dtype != torch.float32 else None
        out = torch._scaled_mm(xq, layer.weight, scale_a=x_scale.reshape(()).float(),
                               scale_b=layer.weight_scale.float(), out_dtype=x.dtype, bias=fused_bias)
        if bias is not None and fused_bias is None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

    def apply_silu_and_mul(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        # Where `apply` would run fp8_tiled_gemm (float32 rows past the fused kernel's): its gated
        # form, which applies SiLU-and-mul to each tile as it leaves the registers.
        if layer.fp8_backend != "cpu_kernel" or cpu_ops.fp8_gemv_packed_applies(
                x, getattr(layer, "weight_gemv_packed", None)):
            return None
        return fp8_linear_ops.fp8_linear_silu_and_mul_loaded(x, layer.weight, layer.weight_scale, bias)

    def row_breakpoints(self, layer, x_dtype: torch.dtype) -> tuple[int, ...]:
        # Every row bound `apply` and fp8_linear_ops consult: the packed codes (1-512
        # rows), the fused kernel's rows, AMX's rows (amx_fp8_linear, or the dequantize + GEMM path),
        # and the rows a dequantized weight's packed bf16 copy serves (onednn_linear.linear).
        fused = fp8_linear_ops.max_fused_rows(x_dtype) if x_dtype in (torch.float32, torch.bfloat16) else 0
        # `apply` asks the kernels once per process whether fp8_tiled_gemm serves float32 rows
        # (cached). Asked first inside a recorded prefill, those two op calls would be in that
        # recording and in no later one, which then cannot be unified with it: ask here, before any.
        fp8_linear_ops.tiled_gemm_enabled()
        return (1, 2, cpu_ops.FP8_GEMV_PACKED_MAX_ROWS + 1, fused + 1, amx_linear_ops.MIN_ROWS,
                amx_linear_ops.MIN_FP8_ROWS, amx_linear_ops.MAX_ROWS + 1, onednn_linear.AMX_BF16_PACKED_MAX_ROWS + 1)
