// moedeploy.cpu::MoEExperts: a layer's routed SwiGLU experts in one ONNX Runtime node.
//
// Why: on a CPU, a decode step's experts are a few matrix-vector products on weights picked
// by the routing. Standard ONNX can pick weights at run time only by copying them (Gather,
// Slice) or with an If per expert, whose subgraphs and row selection cost about a tenth of a
// decode step (benchmarks/README.md, session 43). This kernel reads each expert's weights in
// place, once for all the tokens routed to it.
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
// weight), and W2[0..E). One tensor an expert, not a stack: views into the artifact's data
// file that ONNX Runtime maps in place; or with panels=1, each re-laid in 16-row panels
// ((rows / 16, cols, 16), see panel_dot; H and I multiples of 16), arrays the session holds,
// which decode faster. Attribute scratch_floats: the most scratch a chunk of
// tokens may take (default 32 Mi floats; tests set it small). A token whose X row is not finite, or whose R row holds
// NaN or +Inf (or only -Inf), gets a NaN row, as eager PyTorch gives (plugins/moe.py's
// nan_where_not_finite says which rows).
//
// Work: the (token, expert) pairs grouped by expert; each expert's weight rows split in blocks
// over ONNX Runtime's own intra-op threads (KernelContext_ParallelFor). Panels (panel_dot): one
// token routed to an expert (a decode step) a GEMV with x broadcast; several (a prompt) 8 tokens
// (4 without AVX-512) over each panel. Rows: a row at a time for one token, blocks of 4 rows x
// 4 tokens of dot products for several, the rows in L1 while the tokens pass over them.
// Built on the machine that runs it by moedeploy.plugins.native, against ONNX Runtime's C API
// headers (version 17 or later).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

namespace {

// 16 floats: one AVX-512 register, two AVX2 ones; aligned(4) lets it load from any float.
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The sum of the 16 lanes as a tree (4 vector adds), not 16 dependent scalar adds: a prompt's
// blocks end in 16 of these for every 4 x 4 dot products.
inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
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

// Several tokens on the same weights (a prompt): R rows x T tokens of dot products at once, each
// weight and x load feeding several FMAs, so the loop is bound by FMAs rather than loads; the
// rows stay in L1 while the expert's token groups pass over them. 4 x 4 holds 16 accumulators
// in AVX-512's 32 registers; with 16 (AVX2) registers the vectors would spill, so 2 x 2 there.
#if defined(__AVX512F__)
constexpr int kBlockRows = 4, kBlockTokens = 4;
#else
constexpr int kBlockRows = 2, kBlockTokens = 2;
#endif

// out[j * out_stride + t * token_stride] = dot(rows[j], xs[t]) for j < R, t < T
template <int R, int T>
inline void dot_block(const float* const* rows, const float* const* xs, int64_t k, float* out, int64_t row_stride,
                      int64_t token_stride) {
  v16 acc[R][T] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    v16 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = *reinterpret_cast<const v16*>(xs[t] + i);
    for (int j = 0; j < R; ++j) {
      const v16 wv = *reinterpret_cast<const v16*>(rows[j] + i);
      for (int t = 0; t < T; ++t) acc[j][t] += wv * xv[t];
    }
  }
  for (int j = 0; j < R; ++j)
    for (int t = 0; t < T; ++t) {
      float sum = hsum(acc[j][t]);
      for (int64_t q = i; q < k; ++q) sum += rows[j][q] * xs[t][q];
      out[j * row_stride + t * token_stride] = sum;
    }
}

// dot_block<4, 4> written out: with the 16 accumulators in arrays GCC reloaded every x and w
// vector for each FMA (32 loads per 16 FMAs: load-bound at 40 GFLOP/s on 2 cores); named, the
// 8 vectors are loaded once a step.
template <>
inline void dot_block<4, 4>(const float* const* rows, const float* const* xs, int64_t k, float* out, int64_t row_stride,
                            int64_t token_stride) {
  v16 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
  v16 a20 = {}, a21 = {}, a22 = {}, a23 = {}, a30 = {}, a31 = {}, a32 = {}, a33 = {};
  const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
  const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const v16 u0 = *reinterpret_cast<const v16*>(x0 + i), u1 = *reinterpret_cast<const v16*>(x1 + i);
    const v16 u2 = *reinterpret_cast<const v16*>(x2 + i), u3 = *reinterpret_cast<const v16*>(x3 + i);
    v16 w = *reinterpret_cast<const v16*>(r0 + i);
    a00 += w * u0; a01 += w * u1; a02 += w * u2; a03 += w * u3;
    w = *reinterpret_cast<const v16*>(r1 + i);
    a10 += w * u0; a11 += w * u1; a12 += w * u2; a13 += w * u3;
    w = *reinterpret_cast<const v16*>(r2 + i);
    a20 += w * u0; a21 += w * u1; a22 += w * u2; a23 += w * u3;
    w = *reinterpret_cast<const v16*>(r3 + i);
    a30 += w * u0; a31 += w * u1; a32 += w * u2; a33 += w * u3;
  }
  const v16 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t) {
      float sum = hsum(acc[j][t]);
      for (int64_t q = i; q < k; ++q) sum += rows[j][q] * xs[t][q];
      out[j * row_stride + t * token_stride] = sum;
    }
}

template <int R>
inline void dot_rows_tokens(const float* const* rows, const float* const* xs, int tokens, int64_t k, float* out,
                            int64_t row_stride, int64_t token_stride) {
  switch (tokens) {  // a last, partial group of tokens
    case 1: dot_block<R, 1>(rows, xs, k, out, row_stride, token_stride); break;
    case 2: dot_block<R, 2>(rows, xs, k, out, row_stride, token_stride); break;
    case 3: dot_block<R, (kBlockTokens >= 3 ? 3 : 1)>(rows, xs, k, out, row_stride, token_stride); break;
    default: dot_block<R, kBlockTokens>(rows, xs, k, out, row_stride, token_stride); break;
  }
}

// Panels: a matrix of rows x k re-laid as rows/16 panels of k x 16 floats, panel p holding
// rows 16p..16p+15 column by column (the lowering re-lays the weights when a session loads).
// A GEMV then reads one stream and does one FMA per 64 bytes with x[q] broadcast, where the
// row-at-a-time dot loads x beside every weight vector: on a 2-core AVX-512 EPYC, paired in
// one process, the panel GEMV read as fast as a plain sum over the same bytes and the row
// dot 0.61-0.74x as fast (benchmarks/README.md, session 44).
constexpr int64_t kPanel = 16;
#if defined(__AVX512F__)
constexpr int kPanelTokens = 8;  // 8 accumulators of one register each
#else
constexpr int kPanelTokens = 4;  // v16 is two AVX2 registers
#endif

// The 16 rows of one panel p (k x 16) times x: four accumulators over k.
inline v16 panel_dot(const float* p, const float* x, int64_t k) {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t q = 0;
  for (; q + 4 <= k; q += 4) {
    a0 += *reinterpret_cast<const v16*>(p + kPanel * q) * x[q];
    a1 += *reinterpret_cast<const v16*>(p + kPanel * (q + 1)) * x[q + 1];
    a2 += *reinterpret_cast<const v16*>(p + kPanel * (q + 2)) * x[q + 2];
    a3 += *reinterpret_cast<const v16*>(p + kPanel * (q + 3)) * x[q + 3];
  }
  for (; q < k; ++q) a0 += *reinterpret_cast<const v16*>(p + kPanel * q) * x[q];
  return (a0 + a1) + (a2 + a3);
}

// One panel times T tokens: each 64-byte load of the panel feeds T FMAs.
template <int T>
inline void panel_tokens(const float* p, const float* const* xs, int64_t k, float* out, int64_t token_stride) {
  v16 a[T] = {};
  for (int64_t q = 0; q < k; ++q) {
    const v16 w = *reinterpret_cast<const v16*>(p + kPanel * q);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) a[t] += w * xs[t][q];
  }
  for (int t = 0; t < T; ++t) *reinterpret_cast<v16*>(out + t * token_stride) = a[t];
}

// Rows [begin, end) (multiples of 16) of a panelled matrix times each of `tokens` vectors.
inline void panels_times_tokens(const float* w, int64_t k, int64_t begin, int64_t end, const float* const* xs,
                                int64_t tokens, float* out, int64_t token_stride) {
  for (int64_t r = begin; r < end; r += kPanel) {
    const float* p = w + r * k;  // panel r / 16 starts r * k floats in
    if (tokens == 1) {
      *reinterpret_cast<v16*>(out + r) = panel_dot(p, xs[0], k);
      continue;
    }
    for (int64_t t = 0; t < tokens; t += kPanelTokens) {
      float* o = out + t * token_stride + r;
      switch (std::min<int64_t>(kPanelTokens, tokens - t)) {
        case 1: panel_tokens<1>(p, xs + t, k, o, token_stride); break;
        case 2: panel_tokens<2>(p, xs + t, k, o, token_stride); break;
        case 3: panel_tokens<3>(p, xs + t, k, o, token_stride); break;
#if defined(__AVX512F__)
        case 4: panel_tokens<4>(p, xs + t, k, o, token_stride); break;
        case 5: panel_tokens<5>(p, xs + t, k, o, token_stride); break;
        case 6: panel_tokens<6>(p, xs + t, k, o, token_stride); break;
        case 7: panel_tokens<7>(p, xs + t, k, o, token_stride); break;
#endif
        default: panel_tokens<kPanelTokens>(p, xs + t, k, o, token_stride); break;
      }
    }
  }
}

// Rows [begin, end) of w (rows x k, or panelled) times each of `tokens` vectors xs[t]:
// out[t * token_stride + r]. One token: a row at a time (a memory-bound GEMV); more: blocks
// of rows x tokens.
inline void rows_times_tokens(const float* w, int64_t k, int64_t begin, int64_t end, const float* const* xs,
                              int64_t tokens, float* out, int64_t token_stride, bool panels) {
  if (panels) {
    panels_times_tokens(w, k, begin, end, xs, tokens, out, token_stride);
    return;
  }
  if (tokens == 1) {
    for (int64_t r = begin; r < end; ++r) out[r] = dot(w + r * k, xs[0], k);
    return;
  }
  int64_t r = begin;
  for (; r < end; r += kBlockRows) {
    const int rows_here = static_cast<int>(std::min<int64_t>(kBlockRows, end - r));
    const float* rows[kBlockRows];
    for (int j = 0; j < kBlockRows; ++j) rows[j] = w + (r + std::min(j, rows_here - 1)) * k;
    for (int64_t t = 0; t < tokens; t += kBlockTokens) {
      const int here = static_cast<int>(std::min<int64_t>(kBlockTokens, tokens - t));
      float block[kBlockRows * kBlockTokens];
      dot_rows_tokens<kBlockRows>(rows, xs + t, here, k, block, kBlockTokens, 1);
      for (int j = 0; j < rows_here; ++j)
        for (int u = 0; u < here; ++u) out[(t + u) * token_stride + r + j] = block[j * kBlockTokens + u];
    }
  }
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
static_assert(kRowBlock % kPanel == 0, "a task's rows must be whole panels");

struct Pair {  // one token routed to one expert
  int64_t token, expert;
  float weight;
};

struct Shapes {
  int64_t tokens = 0, hidden = 0, experts = 0, inter = 0;
};

// What one chunk of tokens works on: pointers into ONNX Runtime's tensors, and scratch of its own.
// Pairs are grouped by expert, so each expert's weights are read once for all its tokens.
struct Step {
  Shapes s;  // s.tokens: the chunk's
  bool interleaved = false, panels = false;
  const float* x = nullptr;  // the chunk's first row, as y
  float* y = nullptr;
  const char* nan_row = nullptr;
  std::vector<const float*> w1, w3, w2;  // per expert
  std::vector<Pair> pairs;               // by expert, then token (tokens counted from the chunk's first)
  std::vector<int64_t> expert_first;     // pairs of expert e: [expert_first[e], expert_first[e + 1])
  std::vector<int64_t> token_first, token_pairs;  // token n's pairs, in expert order: token_pairs[token_first[n]..]
  std::vector<const float*> pair_x, pair_h;  // each pair's input row and hidden activation
  std::vector<float> gate_up;  // per pair: 2I (gate and up; interleaved as the weight is)
  std::vector<float> h;        // per pair: I
  std::vector<float> down;     // per pair: H
  int64_t fc1_blocks = 0, down_blocks = 0;
  Activation act;
};

// Scratch floats a chunk may hold (pairs x (3I + H)) unless the attribute scratch_floats says
// otherwise: a long prompt goes through in chunks, its memory bounded (128 MB).
constexpr int64_t kScratchFloats = int64_t{32} << 20;

// Phase 1 task: one block of one expert's gate/up rows, for every token routed to the expert.
void fc1_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const int64_t e = static_cast<int64_t>(index) / w.fc1_blocks, block = static_cast<int64_t>(index) % w.fc1_blocks;
  const int64_t first = w.expert_first[e], count = w.expert_first[e + 1] - first;
  if (count == 0) return;
  const int64_t hidden = w.s.hidden, inter = w.s.inter;
  const float* const* xs = w.pair_x.data() + first;
  float* out = w.gate_up.data() + first * 2 * inter;
  if (w.interleaved) {
    const int64_t begin = block * kRowBlock, end = std::min(begin + kRowBlock, 2 * inter);
    rows_times_tokens(w.w1[e], hidden, begin, end, xs, count, out, 2 * inter, w.panels);
    return;
  }
  const int64_t half = (inter + kRowBlock - 1) / kRowBlock;  // blocks [0, half) gate, [half, 2 half) up
  const bool up = block >= half;
  const int64_t begin = (up ? block - half : block) * kRowBlock, end = std::min(begin + kRowBlock, inter);
  rows_times_tokens(up ? w.w3[e] : w.w1[e], hidden, begin, end, xs, count, out + (up ? inter : 0), 2 * inter,
                    w.panels);
}

// Between the phases: one pair's hidden activation from its gate and up.
void act_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const int64_t q = static_cast<int64_t>(index), inter = w.s.inter;
  const float* gu = w.gate_up.data() + q * 2 * inter;
  float* h = w.h.data() + q * inter;
  if (w.interleaved)
    for (int64_t i = 0; i < inter; ++i) h[i] = w.act(gu[2 * i], gu[2 * i + 1]);
  else
    for (int64_t i = 0; i < inter; ++i) h[i] = w.act(gu[i], gu[inter + i]);
}

// Phase 2 task: one block of one expert's output rows, for every token routed to the expert.
void down_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const int64_t e = static_cast<int64_t>(index) / w.down_blocks, block = static_cast<int64_t>(index) % w.down_blocks;
  const int64_t first = w.expert_first[e], count = w.expert_first[e + 1] - first;
  if (count == 0) return;
  const int64_t begin = block * kRowBlock, end = std::min(begin + kRowBlock, w.s.hidden);
  rows_times_tokens(w.w2[e], w.s.inter, begin, end, w.pair_h.data() + first, count,
                    w.down.data() + first * w.s.hidden, w.s.hidden, w.panels);
}

// Phase 3 task: one token's output, its experts' rows summed in expert index order.
void sum_task(void* data, size_t index) {
  auto& w = *static_cast<Step*>(data);
  const int64_t n = static_cast<int64_t>(index), hidden = w.s.hidden;
  float* y = w.y + n * hidden;
  if (w.nan_row[n]) {
    std::fill(y, y + hidden, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  std::fill(y, y + hidden, 0.f);
  for (int64_t i = w.token_first[n]; i < w.token_first[n + 1]; ++i) {
    const int64_t q = w.token_pairs[i];
    const float* part = w.down.data() + q * hidden;
    const float weight = w.pairs[q].weight;
    for (int64_t r = 0; r < hidden; ++r) y[r] += part[r] * weight;
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
    panels_ = attribute<int64_t>(kernel_info, "panels", 0) != 0;
    act_.alpha = attribute<float>(kernel_info, "activation_alpha", 1.f);
    act_.beta = attribute<float>(kernel_info, "activation_beta", 0.f);
    act_.limit = attribute<float>(kernel_info, "swiglu_limit", std::numeric_limits<float>::infinity());
    scratch_floats_ = std::max<int64_t>(1, attribute<int64_t>(kernel_info, "scratch_floats", kScratchFloats));
    // Constant initializers (what the lowering gives) keep their shapes for the session's life,
    // so their check is kept while their addresses stay; a weight that is a graph input may
    // come back at the same address with another shape, so then every run checks.
    for (size_t i = 2; i < kernel_info.GetInputCount(); ++i) {
      int is_constant = 0;
      kernel_info.GetTensorConstantInput(i, &is_constant);
      weights_constant_ = weights_constant_ && is_constant != 0;
    }
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
    w.panels = panels_;
    w.w1.resize(w.s.experts);
    w.w3.assign(w.s.experts, nullptr);
    w.w2.resize(w.s.experts);
    for (int64_t e = 0; e < w.s.experts; ++e) {
      w.w1[e] = ctx.GetInput(2 + e).GetTensorData<float>();
      if (!interleaved_) w.w3[e] = ctx.GetInput(2 + w.s.experts + e).GetTensorData<float>();
      w.w2[e] = ctx.GetInput(2 + (per_expert - 1) * w.s.experts + e).GetTensorData<float>();
    }
    {  // the weights' shapes: checked on the first run, and again whenever any tensor or H changes
      // (at every run where a weight is not a constant initializer)
      std::lock_guard<std::mutex> guard(check_lock_);
      bool moved = !weights_constant_ || checked_.size() != ctx.GetInputCount() || w.s.hidden != checked_hidden_;
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
    const float* all_x = x.GetTensorData<float>();
    const float* all_r = r.GetTensorData<float>();
    float* all_y = ctx.GetOutput(0, {w.s.tokens, w.s.hidden}).GetTensorMutableData<float>();
    const int64_t tokens = w.s.tokens, hidden = w.s.hidden, experts = w.s.experts;
    std::vector<char> nan_row(tokens);
    std::vector<int64_t> routed(tokens);  // experts each token takes
    for (int64_t n = 0; n < tokens; ++n) {
      nan_row[n] = not_finite(all_x + n * hidden, hidden, all_r + n * experts, experts);
      routed[n] = 0;
      for (int64_t e = 0; e < experts && !nan_row[n]; ++e) routed[n] += all_r[n * experts + e] > 0.f;
    }
    w.interleaved = interleaved_;
    w.act = act_;
    const int64_t budget = std::max<int64_t>(1, scratch_floats_ / (3 * w.s.inter + hidden));
    for (int64_t t0 = 0; t0 < tokens;) {  // chunks of tokens whose pairs fit the scratch budget
      int64_t t1 = t0, pairs = 0;
      while (t1 < tokens && (t1 == t0 || pairs + routed[t1] <= budget)) pairs += routed[t1++];
      w.s.tokens = t1 - t0;
      w.x = all_x + t0 * hidden;
      w.y = all_y + t0 * hidden;
      w.nan_row = nan_row.data() + t0;
      run_chunk(ctx, all_r + t0 * experts, w);
      t0 = t1;
    }
    return nullptr;
  }

  // Whether eager PyTorch gives this token a NaN row: a non-finite input, or a routing row with
  // NaN or +Inf, or only -Inf (a softmax over it is NaN).
  static bool not_finite(const float* x, int64_t hidden, const float* r, int64_t experts) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < hidden; ++i)
      if (!std::isfinite(x[i])) return true;
    bool all_minus_inf = true;
    for (int64_t e = 0; e < experts; ++e) {
      if (std::isnan(r[e]) || r[e] == inf) return true;
      all_minus_inf &= r[e] == -inf;
    }
    return all_minus_inf;
  }

  // One chunk: its pairs grouped by expert, then gate/up, activation, down and the sums.
  void run_chunk(Ort::KernelContext& ctx, const float* r, Step& w) const {
    const int64_t tokens = w.s.tokens, hidden = w.s.hidden, experts = w.s.experts, inter = w.s.inter;
    w.pairs.clear();
    w.expert_first.assign(experts + 1, 0);
    for (int64_t e = 0; e < experts; ++e) {
      w.expert_first[e] = static_cast<int64_t>(w.pairs.size());
      for (int64_t n = 0; n < tokens; ++n)
        if (!w.nan_row[n] && r[n * experts + e] > 0.f) w.pairs.push_back({n, e, r[n * experts + e]});
    }
    w.expert_first[experts] = static_cast<int64_t>(w.pairs.size());
    const int64_t pairs = w.expert_first[experts];
    w.token_first.assign(tokens + 1, 0);  // each token's pairs, in the order above: by expert
    for (const Pair& p : w.pairs) ++w.token_first[p.token + 1];
    for (int64_t n = 0; n < tokens; ++n) w.token_first[n + 1] += w.token_first[n];
    w.token_pairs.resize(pairs);
    std::vector<int64_t> next(w.token_first.begin(), w.token_first.end() - 1);
    for (int64_t q = 0; q < pairs; ++q) w.token_pairs[next[w.pairs[q].token]++] = q;
    w.gate_up.resize(pairs * 2 * inter);
    w.h.resize(pairs * inter);
    w.down.resize(pairs * hidden);
    w.pair_x.resize(pairs);
    w.pair_h.resize(pairs);
    for (int64_t q = 0; q < pairs; ++q) {
      w.pair_x[q] = w.x + w.pairs[q].token * hidden;
      w.pair_h[q] = w.h.data() + q * inter;
    }
    if (pairs > 0) {
      w.fc1_blocks = interleaved_ ? (2 * inter + kRowBlock - 1) / kRowBlock : 2 * ((inter + kRowBlock - 1) / kRowBlock);
      ctx.ParallelFor(fc1_task, experts * w.fc1_blocks, 0, &w);
      ctx.ParallelFor(act_task, pairs, 0, &w);  // a prompt's pairs x I exponentials: spread them too
      w.down_blocks = (hidden + kRowBlock - 1) / kRowBlock;
      ctx.ParallelFor(down_task, experts * w.down_blocks, 0, &w);
    }
    if (tokens > 0) ctx.ParallelFor(sum_task, tokens, 0, &w);
  }

  // Every weight (rows, cols) as the layout says, or (rows / 16, cols, 16) panelled, W2's I the
  // same as W1's; sets s.inter.
  OrtStatusPtr check_weights(const Ort::KernelContext& ctx, Shapes& s) const {
    const int64_t experts = s.experts, hidden = s.hidden;
    const auto first = shape_of(ctx.GetInput(2));
    if (first.size() != (panels_ ? 3u : 2u))
      return error(api_, panels_ ? "with panels=1 each expert's weight must be (rows / 16, cols, 16)"
                                 : "each expert's weight must be 2-D");
    const int64_t rows = panels_ ? first[0] * kPanel : first[0];
    const int64_t inter = interleaved_ ? rows / 2 : rows;
    if (inter < 1 || hidden < 1) return error(api_, "H and I must be at least 1");
    const auto shaped = [this](int64_t r, int64_t c) {
      return panels_ ? std::vector<int64_t>{r / kPanel, c, kPanel} : std::vector<int64_t>{r, c};
    };
    const std::string how = panels_ ? " in 16-row panels" : "";
    if (panels_ && (hidden % kPanel != 0 || inter % (interleaved_ ? kPanel / 2 : kPanel) != 0))
      return error(api_, "panels=1 needs H and " + std::string(interleaved_ ? "2I" : "I") + " multiples of 16");
    for (int64_t e = 0; e < experts; ++e) {
      const auto w1 = shape_of(ctx.GetInput(2 + e));
      if (w1 != shaped(interleaved_ ? 2 * inter : inter, hidden))
        return error(api_, "expert " + std::to_string(e) + "'s W1 is not (" + (interleaved_ ? "2I" : "I") + ", H)" + how);
      if (!interleaved_ && shape_of(ctx.GetInput(2 + experts + e)) != shaped(inter, hidden))
        return error(api_, "expert " + std::to_string(e) + "'s W3 is not (I, H)" + how);
      const size_t down = 2 + (interleaved_ ? 1 : 2) * experts + e;
      if (shape_of(ctx.GetInput(down)) != shaped(hidden, inter))
        return error(api_, "expert " + std::to_string(e) + "'s W2 is not (H, I)" + how);
    }
    s.inter = inter;
    return nullptr;
  }

  const OrtApi& api_;
  bool interleaved_ = false, panels_ = false;
  int64_t scratch_floats_ = kScratchFloats;
  Activation act_;
  std::mutex check_lock_;
  std::vector<const float*> checked_;  // the weight tensors whose shapes were checked
  bool weights_constant_ = true;       // every weight a constant initializer (the constructor asks)
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
