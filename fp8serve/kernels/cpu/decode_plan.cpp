// A recorded decode forward as a fixed list of kernel calls on fixed tensors
// (fp8serve/engine/static_plan.py builds it from a recording).
//
// Why: a decode step at batch 1 of the default model reads ~0.14-0.5 GB of
// weights in ~10-30 ms, and the TorchScript replay of its 635 recorded ops
// spent ~15% of that outside the kernels (perf, Zen 3, FP8 checkpoint: the
// interpreter, IValue boxing, the dispatcher, allocating every op's output,
// 330 view ops), while the second core waited for the next kernel. Here every
// op's output is the tensor the recording gave it, so views of it stay valid
// from one step to the next and are never made again, functional kernels write
// through their `_out` variants, and each step is one unboxed call.
//
// The step's inputs (token ids, positions, slot_mapping, block_tables,
// seq_lens) are the only tensors that change: `run(inputs)` binds them to the
// arguments that take them and returns the output tensor, the same one every
// step (the caller reads it before the next step, as a CUDA graph's output).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/div.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

enum class Kind {
  kFp8Linear,        // out, x, w, scale[, bias]
  kDenseGemv,        // out, x, w[, bias]
  kFp8GemvPacked,    // out, x, codes_packed, scale[, bias]; n
  kAmxFp8Linear,     // out, x, w, scale[, bias] (amx_fp8_linear.cpp)
  kAttention,        // out, query, key_cache, value_cache, block_tables, seq_lens; kv_format; q_scale, out_scale
  kRmsNorm,          // out, x, weight; eps
  kFusedAddRmsNorm,  // x, residual, weight; eps
  kSiluAndMul,       // out, x
  kRotary,           // positions, query, key, cos, sin
  kCache,            // key, value, key_cache, value_cache, slot_mapping; kv_format; k_scale, v_scale
  kEmbedding,        // out, weight, ids
  kCopy,             // out, src
  kMul,              // out, a, b (broadcast): per-KV-head scale folds (fp8serve/layers/attention.py)
  kDiv,              // out, a, b (broadcast)
};

struct KindInfo {
  const char* name;
  Kind kind;
  size_t min_tensors, max_tensors, ints, floats;
};

constexpr KindInfo kKinds[] = {
    {"fp8_linear", Kind::kFp8Linear, 4, 5, 0, 0},
    {"dense_gemv", Kind::kDenseGemv, 3, 4, 0, 0},
    {"fp8_gemv_packed", Kind::kFp8GemvPacked, 4, 5, 1, 0},
    {"amx_fp8_linear", Kind::kAmxFp8Linear, 4, 5, 0, 0},
    {"attention", Kind::kAttention, 6, 6, 1, 2},
    {"rms_norm", Kind::kRmsNorm, 3, 3, 0, 1},
    {"fused_add_rms_norm", Kind::kFusedAddRmsNorm, 3, 3, 0, 1},
    {"silu_and_mul", Kind::kSiluAndMul, 2, 2, 0, 0},
    {"rotary_embedding", Kind::kRotary, 5, 5, 0, 0},
    {"reshape_and_cache", Kind::kCache, 5, 5, 1, 2},
    {"embedding", Kind::kEmbedding, 3, 3, 0, 0},
    {"copy", Kind::kCopy, 2, 2, 0, 0},
    {"mul", Kind::kMul, 3, 3, 0, 0},
    {"div", Kind::kDiv, 3, 3, 0, 0},
};

using OptTensor = std::optional<at::Tensor>;

// The kernels' typed handles, looked up once: an unboxed call through the
// dispatcher (~0.1 us) keeps them visible to torch.profiler.
struct Ops {
  template <class Sig>
  static c10::TypedOperatorHandle<Sig> find(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
  }
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, OptTensor)> fp8_linear =
      find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, OptTensor)>("fp8serve::fp8_linear_out");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, OptTensor)> amx_fp8_linear =
      find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, OptTensor)>("fp8serve::amx_fp8_linear_out");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, OptTensor)> dense_gemv =
      find<void(at::Tensor, at::Tensor, at::Tensor, OptTensor)>("fp8serve::dense_gemv_out");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, OptTensor)> fp8_gemv_packed =
      find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, OptTensor)>("fp8serve::fp8_gemv_packed_out");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                                double, double)>
      attention = find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double,
                            double)>("fp8serve::paged_attention_decode_fused_out");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, double)> rms_norm =
      find<void(at::Tensor, at::Tensor, at::Tensor, double)>("fp8serve::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, double)> fused_add_rms_norm =
      find<void(at::Tensor, at::Tensor, at::Tensor, double)>("fp8serve::fused_add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor)> silu_and_mul =
      find<void(at::Tensor, at::Tensor)>("fp8serve::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor)> rotary =
      find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor)>("fp8serve::rotary_embedding");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, double,
                                OptTensor, OptTensor)>
      cache = find<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, double, OptTensor,
                        OptTensor)>("fp8serve::reshape_and_cache");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

struct Step {
  Kind kind;
  std::vector<at::Tensor> t;
  std::vector<int64_t> i;
  std::vector<double> f;
  std::vector<std::pair<size_t, size_t>> inputs;  // (argument in t, input number)
};

OptTensor optional_at(const std::vector<at::Tensor>& t, size_t j) {
  return t.size() > j ? OptTensor(t[j]) : std::nullopt;
}

}  // namespace

class DecodePlan : public torch::CustomClassHolder {
 public:
  DecodePlan() { (void)ops(); }  // a missing kernel fails here, where the plan is built

  // One kernel call. tensors: its tensor arguments in kKinds' order, those
  // taken from the step's inputs as recorded (rebound on every run);
  // input_args: pairs (argument index, input number).
  void add(const std::string& kind, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
           std::vector<double> floats, std::vector<int64_t> input_args) {
    const KindInfo* info = nullptr;
    for (const auto& k : kKinds) {
      if (kind == k.name) info = &k;
    }
    TORCH_CHECK(info != nullptr, "DecodePlan: unknown step kind '", kind, "'");
    TORCH_CHECK(tensors.size() >= info->min_tensors && tensors.size() <= info->max_tensors,
                "DecodePlan: step '", kind, "' takes ", info->min_tensors, "-", info->max_tensors, " tensors, got ",
                tensors.size());
    TORCH_CHECK(ints.size() == info->ints && floats.size() == info->floats, "DecodePlan: step '", kind, "' takes ",
                info->ints, " ints and ", info->floats, " floats, got ", ints.size(), " and ", floats.size());
    TORCH_CHECK(input_args.size() % 2 == 0, "DecodePlan: input_args are (argument, input) pairs");
    Step s{info->kind, std::move(tensors), std::move(ints), std::move(floats), {}};
    for (size_t j = 0; j < input_args.size(); j += 2) {
      const int64_t arg = input_args[j], input = input_args[j + 1];
      TORCH_CHECK(arg >= 0 && static_cast<size_t>(arg) < s.t.size() && input >= 0,
                  "DecodePlan: input_args pair (", arg, ", ", input, ") is out of range");
      s.inputs.emplace_back(static_cast<size_t>(arg), static_cast<size_t>(input));
      num_inputs_ = std::max(num_inputs_, static_cast<size_t>(input) + 1);
    }
    steps_.push_back(std::move(s));
  }

  void set_output(at::Tensor output) { output_ = std::move(output); }

  at::Tensor run(std::vector<at::Tensor> inputs) {
    TORCH_CHECK(inputs.size() >= num_inputs_, "DecodePlan: ", num_inputs_, " inputs expected, got ", inputs.size());
    TORCH_CHECK(output_.defined(), "DecodePlan: no output set");
    const Ops& o = ops();
    for (Step& s : steps_) {
      for (const auto& [arg, input] : s.inputs) s.t[arg] = inputs[input];
      auto& t = s.t;
      switch (s.kind) {
        case Kind::kFp8Linear: o.fp8_linear.call(t[0], t[1], t[2], t[3], optional_at(t, 4)); break;
        case Kind::kAmxFp8Linear: o.amx_fp8_linear.call(t[0], t[1], t[2], t[3], optional_at(t, 4)); break;
        case Kind::kDenseGemv: o.dense_gemv.call(t[0], t[1], t[2], optional_at(t, 3)); break;
        case Kind::kFp8GemvPacked:
          o.fp8_gemv_packed.call(t[0], t[1], t[2], t[3], s.i[0], optional_at(t, 4));
          break;
        case Kind::kAttention: o.attention.call(t[0], t[1], t[2], t[3], t[4], t[5], s.i[0], s.f[0], s.f[1]); break;
        case Kind::kRmsNorm: o.rms_norm.call(t[0], t[1], t[2], s.f[0]); break;
        case Kind::kFusedAddRmsNorm: o.fused_add_rms_norm.call(t[0], t[1], t[2], s.f[0]); break;
        case Kind::kSiluAndMul: o.silu_and_mul.call(t[0], t[1]); break;
        case Kind::kRotary: o.rotary.call(t[0], t[1], t[2], t[3], t[4]); break;
        case Kind::kCache:
          o.cache.call(t[0], t[1], t[2], t[3], t[4], s.i[0], s.f[0], s.f[1], std::nullopt, std::nullopt);
          break;
        case Kind::kEmbedding: at::index_select_out(t[0], t[1], 0, t[2]); break;
        case Kind::kCopy: t[0].copy_(t[1]); break;
        case Kind::kMul: at::mul_out(t[0], t[1], t[2]); break;
        case Kind::kDiv: at::div_out(t[0], t[1], t[2]); break;
      }
    }
    return output_;
  }

  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }

 private:
  std::vector<Step> steps_;
  size_t num_inputs_ = 0;
  at::Tensor output_;
};

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<>())
      .def("add", &DecodePlan::add)
      .def("set_output", &DecodePlan::set_output)
      .def("run", &DecodePlan::run)
      .def("num_steps", &DecodePlan::num_steps);
}
