// float32 views of a small-batch GEMV's activations and result, whether the
// caller's tensors are float32 or bf16. bf16 activations are widened once
// into a local buffer and the float32 result is rounded once per element
// (nearest even) by `narrow`, inside each thread's task, instead of two
// extra ATen ops per call (x.to(float), out.to(bf16)): at batch 1 those two
// cost about as much as reading a small layer's weights.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace fp8serve_staging {

struct Float32Staging {
  const float* x = nullptr;  // [M, K]
  float* out = nullptr;      // [M, N]
  int64_t num_cols = 0;      // N

  // x: contiguous [M, K], float32 or bf16; out: [M, N] of x's dtype.
  // widen_x = false: the caller reads bf16 x itself (x stays null), only the
  // result is staged.
  Float32Staging(const at::Tensor& x_in, const at::Tensor& out_in, bool widen_x = true)
      : num_cols(out_in.size(1)) {
    if (x_in.scalar_type() == at::kBFloat16) {
      if (widen_x) {
        const int64_t n = x_in.numel();
        x_buf_.resize(n);
        const c10::BFloat16* xb = x_in.data_ptr<c10::BFloat16>();
        for (int64_t i = 0; i < n; ++i) x_buf_[i] = static_cast<float>(xb[i]);
        x = x_buf_.data();
      }
      out_buf_.resize(out_in.numel());
      out = out_buf_.data();
      out_bf16_ = out_in.data_ptr<c10::BFloat16>();
    } else {
      x = x_in.data_ptr<float>();
      out = out_in.data_ptr<float>();
    }
  }

  // Round columns [begin, end) of every result row into the bf16 output
  // (nothing to do for float32): each task narrows the columns it computed.
  void narrow(int64_t num_rows, int64_t begin, int64_t end) const {
    if (out_bf16_ == nullptr) return;
    for (int64_t m = 0; m < num_rows; ++m)
      for (int64_t n = begin; n < end; ++n) out_bf16_[m * num_cols + n] = c10::BFloat16(out[m * num_cols + n]);
  }

 private:
  std::vector<float> x_buf_, out_buf_;
  c10::BFloat16* out_bf16_ = nullptr;
};

// The [M, N] result tensor of a GEMV over x: `out_arg` when the caller
// gives one (an `_out` entry: contiguous, x's dtype, on the CPU), else a new
// tensor.
inline at::Tensor result_tensor(const at::Tensor* out_arg, const at::Tensor& x, int64_t M, int64_t N) {
  if (out_arg == nullptr) return at::empty({M, N}, x.options());
  const at::Tensor& out = *out_arg;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == x.scalar_type() &&
                  out.is_contiguous() && out.device().is_cpu(),
              "out must be a contiguous [", M, ", ", N, "] CPU tensor of x's dtype, got ", out.sizes(), " ",
              out.scalar_type());
  return out;
}

}  // namespace fp8serve_staging
