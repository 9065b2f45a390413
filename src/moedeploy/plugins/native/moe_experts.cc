// moedeploy.cpu::MoEExperts: a layer's routed SwiGLU experts in one ONNX Runtime node.
//
// Why: on a CPU, a decode step's experts are a few matrix-vector products on weights picked
// by the routing. Standard ONNX can pick weights at run time only by copying them (Gather,
// Slice) or with an If per expert, whose subgraphs and row selection cost about a tenth of a
// decode step (benchmarks/README.md, session 43). This kernel reads each expert's weights in
// place, only for the tokens routed to it.
//
//   Y[n] = sum over experts e with R[n, e] > 0, in index order, of
//          R[n, e] * W2[e] act(W1[e] x_n, W3[e] x_n)
//
// act is the op's SwiGLU, silu(g) * u by default, with moe::MoE's attributes activation_alpha,
// activation_beta and swiglu_limit (gpt-oss's clamped variant).
//
// Inputs: X (N, H) float; R (N, E) float routing weights, 0 off a token's top-k (the graph
// computes them, so every routing variant works); then, variadic, each expert's weights as
// tensors of their own: W1[0..E), W3[0..E), W2[0..E) with W1, W3 (I, H) and W2 (H, I); or with
// interleaved=1, W1[0..E) as (2I, H), gate row 2i and up row 2i+1 (a streamed export's fused
// weight), and W2[0..E). One tensor an expert, not a stack: the graph's per-expert Ifs (the
// prompt path) read the same initializers, so ONNX Runtime maps each expert's bytes once.
// A token whose X row is not finite, or whose R row holds NaN or +Inf (or only -Inf), gets a
// NaN row, as eager PyTorch gives (plugins/moe.py's nan_where_not_finite says which rows).
//
// Work is split over ONNX Runtime's own intra-op threads (KernelContext_ParallelFor), by
// blocks of weight rows, so a one-token step reads its experts with every thread. It is a
// matrix-vector kernel, right for decode; a prompt's many tokens belong to a GEMM.
// Built on the machine that runs it by moedeploy.plugins.native, against ONNX Runtime's C API
// headers (version 17 or later).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

namespace {

// 16 floats: one AVX-512 register, two AVX2 ones; aligned(4) lets it load from any float.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// dot(row, x) over k floats: one row at a time, four accumulators. One sequential stream per
// thread: on a 2-core AVX-512 EPYC this read 21-23 GB/s single-threaded where four rows at
// once (x loaded once for the four) read 10-12 (a sum over the same memory: 24-27).
inline float dot(const float* row, const float* x, int64_t k) {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    a0 += *reinterpret_cast<const v16*>(row + i) * *reinterpret_cast<const v16*>(x + i);
    a1 += *reinterpret_cast<const v16*>(row + i + 16) * *reinterpret_cast<const v16*>(x + i + 16);
    a2 += *reinterpret_cast<const v16*>(row + i + 32) * *reinterpret_cast<const v16*>(x + i + 32);
    a3 += *reinterpret_cast<const v16*>(row + i + 48) * *reinterpret_cast<const v16*>(x + i + 48);
  }
  for (; i + 16 <= k; i += 16) a0 += *reinterpret_cast<const v16*>(row + i) * *reinterpret_cast<const v16*>(x + i);
  float s = hsum((a0 + a1) + (a2 + a3));
  for (; i < k; ++i) s += row[i] * x[i];
  return s;
}

// rows [begin, end) of matrix w (rows x k, row-major) times x into out[begin..end)
inline void gemv_rows(const float* w, const float* x, int64_t k, int64_t begin, int64_t end, float* out) {
  for (int64_t r = begin; r < end; ++r) out[r] = dot(w + r * k, x, k);
}

// The op's SwiGLU (moe_attributes.ExpertActivation): g' = min(g, limit), u' = clamp(u, -limit,
// limit), g' * sigmoid(alpha g') * (u' + beta); the defaults (1, 0, +inf) are silu(g) * u.
struct Activation {
  float alpha = 1.f, beta = 0.f, limit = std::numeric_limits<float>::infinity();
  float operator()(float g, float u) const {
    if (limit < std::numeric_limits<float>::infinity()) {
      g = std::min(g, limit);
      u = std::max(std::min(u, limit), -limit);
    }
    return g / (1.f + std::exp(-alpha * g)) * (u + beta);
  }
};

constexpr int64_t kRowBlock = 64;  // weight rows a task

struct Pair {  // one token routed to one expert
  int64_t token, expert;
  float weight;
};

struct Shapes {
  int64_t tokens = 0, hidden = 0, experts = 0, inter = 0;
};

// What one Compute works on: pointers into ONNX Runtime's tensors, and scratch of its own.
struct Step {
  Shapes s;
  bool interleaved = false;
  const float* x = nullptr;
  std::vector<const float*> w1, w3, w2;  // per expert
  std::vector<Pair> pairs;
  std::vector<int64_t> first;  // pairs of token n: [first[n], first[n + 1])
  std::vector<char> nan_row;
  std::vector<float> gate_up;  // per pair: 2I (gate and up; interleaved as the weight is)
  std::vector<float> h;        // per pair: I
  float* y = nullptr;
  int64_t fc1_blocks = 0, down_blocks = 0;
};

// Phase 1 task: one block of one pair's gate/up rows.
void fc1_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const size_t pair = index / w.fc1_blocks;
  const int64_t block = static_cast<int64_t>(index % w.fc1_blocks);
  const Pair& p = w.pairs[pair];
  const int64_t hidden = w.s.hidden, inter = w.s.inter;
  const float* x = w.x + p.token * hidden;
  float* out = w.gate_up.data() + pair * 2 * inter;
  if (w.interleaved) {
    const int64_t begin = block * kRowBlock, end = std::min(begin + kRowBlock, 2 * inter);
    gemv_rows(w.w1[p.expert], x, hidden, begin, end, out);
    return;
  }
  const int64_t half = (inter + kRowBlock - 1) / kRowBlock;  // blocks [0, half) gate, [half, 2 half) up
  const bool up = block >= half;
  const int64_t begin = (up ? block - half : block) * kRowBlock, end = std::min(begin + kRowBlock, inter);
  gemv_rows(up ? w.w3[p.expert] : w.w1[p.expert], x, hidden, begin, end, out + (up ? inter : 0));
}

// Phase 2 task: one block of one token's output rows, its experts summed in index order.
void down_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const int64_t n = static_cast<int64_t>(index) / w.down_blocks, block = static_cast<int64_t>(index) % w.down_blocks;
  const int64_t hidden = w.s.hidden, inter = w.s.inter;
  const int64_t begin = block * kRowBlock, end = std::min(begin + kRowBlock, hidden);
  float* y = w.y + n * hidden;
  if (w.nan_row[n]) {
    std::fill(y + begin, y + end, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  std::fill(y + begin, y + end, 0.f);
  float part[kRowBlock];
  for (int64_t q = w.first[n]; q < w.first[n + 1]; ++q) {
    const Pair& p = w.pairs[q];
    gemv_rows(w.w2[p.expert] + begin * inter, w.h.data() + q * inter, inter, 0, end - begin, part);
    for (int64_t r = begin; r < end; ++r) y[r] += part[r - begin] * p.weight;
  }
}

OrtStatus* error(const OrtApi& api, const std::string& message) {
  return api.CreateStatus(ORT_INVALID_ARGUMENT, ("MoEExperts: " + message).c_str());
}

std::vector<int64_t> shape_of(const Ort::ConstValue& value) {
  return value.GetTensorTypeAndShapeInfo().GetShape();
}

struct MoEExpertsKernel {
  MoEExpertsKernel(const OrtApi& api, const OrtKernelInfo* info) : api_(api) {
    Ort::ConstKernelInfo kernel_info(info);
    interleaved_ = attribute<int64_t>(kernel_info, "interleaved", 0) != 0;
    act_.alpha = attribute<float>(kernel_info, "activation_alpha", 1.f);
    act_.beta = attribute<float>(kernel_info, "activation_beta", 0.f);
    act_.limit = attribute<float>(kernel_info, "swiglu_limit", std::numeric_limits<float>::infinity());
  }

  template <typename T>
  static T attribute(const Ort::ConstKernelInfo& info, const char* name, T otherwise) {
    try {
      return info.GetAttribute<T>(name);
    } catch (const Ort::Exception&) {  // absent: the default
      return otherwise;
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      return compute(context);
    } catch (const std::exception& e) {
      return error(api_, e.what());
    }
  }

  OrtStatusPtr compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const auto x = ctx.GetInput(0), r = ctx.GetInput(1);
    const auto xs = shape_of(x), rs = shape_of(r);
    if (xs.size() != 2 || rs.size() != 2 || rs[0] != xs[0])
      return error(api_, "X must be (N, H) and R (N, E)");
    Step w;  // per call: one session may run on several threads at once
    w.s.tokens = xs[0];
    w.s.hidden = xs[1];
    w.s.experts = rs[1];
    const size_t per_expert = interleaved_ ? 2 : 3;
    if (ctx.GetInputCount() != 2 + per_expert * w.s.experts)
      return error(api_, "takes X, R and " + std::to_string(per_expert) + " weights for each of R's " +
                             std::to_string(w.s.experts) + " experts, got " + std::to_string(ctx.GetInputCount()) +
                             " inputs");
    w.interleaved = interleaved_;
    w.w1.resize(w.s.experts);
    w.w3.assign(w.s.experts, nullptr);
    w.w2.resize(w.s.experts);
    for (int64_t e = 0; e < w.s.experts; ++e) {
      w.w1[e] = ctx.GetInput(2 + e).GetTensorData<float>();
      if (!interleaved_) w.w3[e] = ctx.GetInput(2 + w.s.experts + e).GetTensorData<float>();
      w.w2[e] = ctx.GetInput(2 + (per_expert - 1) * w.s.experts + e).GetTensorData<float>();
    }
    {  // the weights' shapes: checked on the first run, and again whenever any tensor or H changes
      std::lock_guard<std::mutex> guard(check_lock_);
      bool moved = checked_.size() != ctx.GetInputCount() || w.s.hidden != checked_hidden_;
      checked_.resize(ctx.GetInputCount(), nullptr);
      for (size_t i = 2; i < ctx.GetInputCount(); ++i) moved |= ctx.GetInput(i).GetTensorData<float>() != checked_[i];
      if (moved) {
        if (OrtStatusPtr status = check_weights(ctx, w.s)) {
          checked_.clear();
          return status;
        }
        for (size_t i = 2; i < ctx.GetInputCount(); ++i) checked_[i] = ctx.GetInput(i).GetTensorData<float>();
        checked_hidden_ = w.s.hidden;
        checked_inter_ = w.s.inter;
      }
      w.s.inter = checked_inter_;
    }
    w.x = x.GetTensorData<float>();
    w.y = ctx.GetOutput(0, {w.s.tokens, w.s.hidden}).GetTensorMutableData<float>();
    route(r.GetTensorData<float>(), w);
    const int64_t inter = w.s.inter;
    w.gate_up.resize(w.pairs.size() * 2 * inter);
    w.h.resize(w.pairs.size() * inter);
    if (!w.pairs.empty()) {
      w.fc1_blocks = interleaved_ ? (2 * inter + kRowBlock - 1) / kRowBlock : 2 * ((inter + kRowBlock - 1) / kRowBlock);
      ctx.ParallelFor(fc1_task, w.pairs.size() * w.fc1_blocks, 0, &w);
      for (size_t q = 0; q < w.pairs.size(); ++q) {
        const float* gu = w.gate_up.data() + q * 2 * inter;
        float* h = w.h.data() + q * inter;
        if (interleaved_)
          for (int64_t i = 0; i < inter; ++i) h[i] = act_(gu[2 * i], gu[2 * i + 1]);
        else
          for (int64_t i = 0; i < inter; ++i) h[i] = act_(gu[i], gu[inter + i]);
      }
    }
    w.down_blocks = (w.s.hidden + kRowBlock - 1) / kRowBlock;
    if (w.s.tokens > 0) ctx.ParallelFor(down_task, w.s.tokens * w.down_blocks, 0, &w);
    return nullptr;
  }

  // Every weight (rows, cols) as the layout says, W2's I the same as W1's; sets s.inter.
  OrtStatusPtr check_weights(const Ort::KernelContext& ctx, Shapes& s) const {
    const int64_t experts = s.experts, hidden = s.hidden;
    const auto first = shape_of(ctx.GetInput(2));
    if (first.size() != 2) return error(api_, "each expert's weight must be 2-D");
    const int64_t inter = interleaved_ ? first[0] / 2 : first[0];
    for (int64_t e = 0; e < experts; ++e) {
      const auto w1 = shape_of(ctx.GetInput(2 + e));
      if (w1 != std::vector<int64_t>{interleaved_ ? 2 * inter : inter, hidden})
        return error(api_, "expert " + std::to_string(e) + "'s W1 is not (" + (interleaved_ ? "2I" : "I") + ", H)");
      if (!interleaved_ && shape_of(ctx.GetInput(2 + experts + e)) != std::vector<int64_t>{inter, hidden})
        return error(api_, "expert " + std::to_string(e) + "'s W3 is not (I, H)");
      const size_t down = 2 + (interleaved_ ? 1 : 2) * experts + e;
      if (shape_of(ctx.GetInput(down)) != std::vector<int64_t>{hidden, inter})
        return error(api_, "expert " + std::to_string(e) + "'s W2 is not (H, I)");
    }
    s.inter = inter;
    return nullptr;
  }

  // The (token, expert) pairs to compute, and the tokens whose row is NaN.
  static void route(const float* r, Step& w) {
    const int64_t tokens = w.s.tokens, hidden = w.s.hidden, experts = w.s.experts;
    constexpr float inf = std::numeric_limits<float>::infinity();
    w.pairs.clear();
    w.first.assign(tokens + 1, 0);
    w.nan_row.assign(tokens, 0);
    for (int64_t n = 0; n < tokens; ++n) {
      w.first[n] = static_cast<int64_t>(w.pairs.size());
      bool bad = false, all_minus_inf = true;
      for (int64_t i = 0; i < hidden && !bad; ++i) bad = !std::isfinite(w.x[n * hidden + i]);
      for (int64_t e = 0; e < experts; ++e) {
        const float v = r[n * experts + e];
        bad |= std::isnan(v) || v == inf;
        all_minus_inf &= v == -inf;
      }
      w.nan_row[n] = bad || all_minus_inf;
      if (w.nan_row[n]) continue;
      for (int64_t e = 0; e < experts; ++e)
        if (r[n * experts + e] > 0.f) w.pairs.push_back({n, e, r[n * experts + e]});
    }
    w.first[tokens] = static_cast<int64_t>(w.pairs.size());
  }

  const OrtApi& api_;
  bool interleaved_ = false;
  Activation act_;
  std::mutex check_lock_;
  std::vector<const float*> checked_;  // the weight tensors whose shapes were checked
  int64_t checked_hidden_ = -1, checked_inter_ = 0;
};

struct MoEExpertsOp : Ort::CustomOpBase<MoEExpertsOp, MoEExpertsKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new MoEExpertsKernel(api, info);
      return nullptr;
    } catch (const std::exception& e) {
      return error(api, e.what());
    }
  }
  const char* GetName() const { return "MoEExperts"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 2 ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  }
  int GetVariadicInputMinArity() const { return 2; }
  bool GetVariadicInputHomogeneity() const { return true; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

constexpr const char* kDomain = "moedeploy.cpu";

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                          const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr)  // a runtime older than these headers: say so through the oldest API there is
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, "moedeploy's native kernels were compiled against newer ONNX Runtime headers than this runtime");
  Ort::InitApi(api);
  static MoEExpertsOp op;
  try {
    Ort::CustomOpDomain domain{kDomain};
    domain.Add(&op);
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(domain);
    // The domain must outlive every session that uses it: kept for the process's life.
    static std::vector<Ort::CustomOpDomain>* domains = new std::vector<Ort::CustomOpDomain>();
    static std::mutex lock;
    std::lock_guard<std::mutex> guard(lock);
    domains->push_back(std::move(domain));
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
