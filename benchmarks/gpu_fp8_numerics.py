"""FP8 numerics on a CUDA GPU, printed as plain lines (run by gpu_check.sh):

1. activations rounded to e4m3 on the GPU and on the CPU: how many codes
   differ, with the scale as a CPU scalar and as a 0-dim CUDA tensor (CUDA
   divides by a CPU scalar through its reciprocal);
2. torch._scaled_mm against float64 on the same e4m3 codes, K = 64 / 576 /
   4096, with and without use_fast_accum: the worst error as a fraction of
   sum |a b| (float32 accumulation would give ~K 2^-24);
3. the engine with an FP8 Llama checkpoint (tests' tiny model): on the GPU,
   the same _scaled_mm path run on the CPU (float32 accumulation), and
   transformers in float64 doing the same FP8 arithmetic, pairwise.

Usage (repository root, a CUDA machine): PYTHONPATH=. python3 benchmarks/gpu_fp8_numerics.py
"""
import shutil
import sys

import torch

if not torch.cuda.is_available():
    raise SystemExit("gpu_fp8_numerics.py: needs a CUDA device (torch.cuda.is_available() is False)")
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/quantization")
from checkpoints import write_tiny_llama, hf_logits
from kv_scale_checkpoints import quantize_to_fp8_checkpoint
import test_fp8_linear_checkpoint as t
from fp8serve.quantization.fp8 import FP8_E4M3
torch.manual_seed(0)
M = 448.0
# 1. quantization of activations: GPU vs CPU codes
for scale_kind in ("cpu-scalar", "cuda-0dim"):
    x = torch.randn(4096, 256) * 3
    s = (x.abs().max() / M).clamp(min=1e-12)
    cpu = (x / s).clamp(-M, M).to(torch.float8_e4m3fn).view(torch.uint8)
    sg = s.cuda() if scale_kind == "cuda-0dim" else s
    gpu = (x.cuda() / sg).clamp(-M, M).to(torch.float8_e4m3fn).view(torch.uint8).cpu()
    q32 = (x.cuda() / sg)
    print(f"div {scale_kind}: codes differing {int((cpu != gpu).sum())} of {cpu.numel()}; quotient differing {int(((x / s) != q32.cpu()).sum())}")
# 2. _scaled_mm accuracy on identical codes
for K in (64, 576, 4096):
    a = (torch.randn(80, K) * 20).clamp(-M, M).to(torch.float8_e4m3fn)
    b = (torch.randn(256, K) * 20).clamp(-M, M).to(torch.float8_e4m3fn)
    ref = a.double() @ b.double().t()
    mag = a.double().abs() @ b.double().abs().t()
    one = torch.tensor(1.0, device="cuda")
    for fast in (False, True):
        out = torch._scaled_mm(a.cuda(), b.cuda().t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast).cpu().double()
        r = ((out - ref).abs() / mag).max()
        print(f"_scaled_mm K={K} fast_accum={fast}: max |err| / sum|ab| = {float(r):.2e} (2^{float(torch.log2(r)):.1f})")
# 3. engine FP8 checkpoint: cuda vs the same scaled_mm path emulated on CPU vs the float64 reference
import fp8serve.quantization.fp8_linear as fl
from fp8serve import LLM, SamplingParams
b = write_tiny_llama("/tmp/diag_base")
real = fl._use_scaled_mm
for sch in ("dynamic", "static"):
    shutil.rmtree("/tmp/diag_fp8", ignore_errors=True); shutil.rmtree("/tmp/diag_ref", ignore_errors=True)
    quantize_to_fp8_checkpoint(b, "/tmp/diag_fp8", "/tmp/diag_ref", activation_scheme=sch)
    res = {}
    for dev in ("cuda", "cpu"):
        fl._use_scaled_mm = (lambda d: True) if dev == "cpu" else real
        llm = LLM("/tmp/diag_fp8", dtype="float32", kv_cache_memory="4MiB", device=dev)
        out = llm.generate([t.PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=t.TOP_K), use_tqdm=False)[0]
        res[dev] = [{tok: lp.logprob for tok, lp in pos.items()} for pos in out.prompt_logprobs[1:]]
    with torch.no_grad():
        ref = t._hf_with_gpu_fp8_arithmetic("/tmp/diag_fp8", "/tmp/diag_ref", sch)(input_ids=torch.tensor([t.PROMPT]), use_cache=False).logits[0]
    worst = max(abs(a[k] - res["cpu"][i].get(k, a[k])) for i, a in enumerate(res["cuda"]) for k in a)
    print(f"{sch}: cuda vs ref {t.max_logprob_error(res['cuda'], ref):.3e}; cpu-emulated vs ref {t.max_logprob_error(res['cpu'], ref):.3e}; cuda vs cpu-emulated {worst:.3e}; cuda vs weight-only {t.max_logprob_error(res['cuda'], hf_logits('/tmp/diag_ref', t.PROMPT)):.3e}")
