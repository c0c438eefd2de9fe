#!/usr/bin/env bash
# What a lent GPU machine checks in one call (device time is short): the CUDA
# tests, FP8 numerics, then the KV-constrained workload on a random-weight ~1B Llama.
# Runs under the machine's own python3 (its torch and transformers; the
# engine's core needs nothing else). Writes logs to ${OUT:-/tmp/gpu_check}.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The repository itself, not an installed copy (the machine has none).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"

# 1. Tests marked cuda (the other tests in these files run too: they are the CPU references).
timeout 200 $PY -m pytest -q -rs -s -p no:cacheprovider -m cuda \
  tests/attention/test_torch_sdpa_fp8.py tests/models/test_llama.py tests/models/test_mixtral.py \
  tests/engine/test_kv_scales_e2e.py tests/quantization/test_fp8_linear_checkpoint.py 2>&1 | tee "$OUT/cuda_tests.log"

# 2. FP8 numerics: activation rounding, _scaled_mm accumulation, the engine's FP8 linears against float64.
timeout 150 $PY benchmarks/gpu_fp8_numerics.py 2>&1 | grep -v "Loading\|Writing\|INFO\|WARN" | tee "$OUT/fp8_numerics.log"

# 3. KV-constrained serving on the GPU: a random-weight Llama (16 layers, hidden 2048, 32 query / 8 KV heads,
# head size 64: 32 KiB of bf16 K/V per token) with a cache of 128 MiB = 8 requests of 512 tokens in bf16.
MODEL=${MODEL_DIR:-/tmp/llama_1b_random}
[ -f "$MODEL/config.json" ] || $PY - "$MODEL" <<'PYEOF' 2>&1 | tee "$OUT/model.txt"
import sys, torch
sys.path.insert(0, "tests")
from checkpoints import write_tiny_llama
write_tiny_llama(sys.argv[1], num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                 intermediate_size=8192, vocab_size=512, max_position_embeddings=1024, dtype=torch.bfloat16)
print("wrote", sys.argv[1])
PYEOF
timeout 240 $PY benchmarks/kv_saturation_engine.py --model "$MODEL" --device cuda --dtype bfloat16 \
  --kv-cache-memory 128MiB --max-model-len 512 --rounds ${ROUNDS:-3} --json "$OUT/kv_saturation_gpu.json" \
  2>&1 | tee "$OUT/kv_saturation_gpu.md"
