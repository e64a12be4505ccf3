// Causal softmax attention on the CPU, forward and backward, as XLA FFI handlers.
//
// q, k, v, o, do, dq, dk, dv: float32 [B, L, H, K], row-major; lse: float32 [B, H, L], the
// log-sum-exp of each query row's scaled, masked scores (what the backward needs to rebuild
// the probabilities without a second softmax). The forward with statistics also returns each
// row's attention entropy and total variation distance from uniform, [B, H, L]. Scores are q.k / sqrt(K); key j is visible to
// query i when j <= i.
//
// Each (b, h) head is one work item, run on XLA's intra-op thread pool. Within a head the
// queries are taken W at a time, W the floats of one vector register of the target (16 with
// AVX-512, 8 with AVX or AVX2, 4 otherwise): scores are kept transposed, S^T[j, lane] for key j
// and query i0 + lane, so that the softmax, P.V and the backward's products are W-wide vector
// operations over queries, and the causal mask is a per-lane test on the diagonal block only.
// The tiles are sized so their accumulators fit the target's vector registers (32 with
// AVX-512, 16 below it on x86-64): an accumulator spilled to the stack costs a store and a
// load per multiply-add.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRegisters = 32;  // vector registers of the target
#else
constexpr int kRegisters = 16;
#endif
// Keys per tile, a divisor of W: independent accumulators that hide the FMA latency.
constexpr int kKeys = W < 8 ? W : 8;
constexpr int kAccumulators = kRegisters / 2;  // vector accumulators of one tile, at most
typedef float Vec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(W * sizeof(int32_t))));

constexpr float kMasked = -1e30f;

inline Vec splat(float x) { return Vec{} + x; }

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

// The larger of a and b, and NaN where a is NaN, so a NaN score reaches the output.
inline Vec vmax(Vec a, Vec b) { return (a > b) | (a != a) ? a : b; }

// exp(x) for x <= 0 to float32 precision (range reduction by ln 2, degree-6 polynomial);
// 0 below -87, where float32's exp underflows.
inline Vec vexp(Vec x) {
  const IVec underflow = x < -87.0f;
  x = vmax(x, splat(-87.0f));
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const Vec r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  Vec p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(Vec));
  return underflow ? splat(0.0f) : p * scale;
}

struct Shape {
  int64_t batch, length, heads, head_dim;
  int64_t padded;  // length rounded up to a multiple of W
  int64_t row_stride() const { return heads * head_dim; }
};

template <typename Dims>
Shape shape_of(const Dims& dims) {
  Shape s{dims[0], dims[1], dims[2], dims[3], 0};
  s.padded = (s.length + W - 1) / W * W;
  return s;
}

// One head's [L, K] slice of a [B, L, H, K] array, copied contiguous (rows past L are zero),
// optionally scaled; `transposed` gives [K, padded] instead.
void gather(const float* src, const Shape& s, int64_t b, int64_t h, float scale, bool transposed,
            float* dst) {
  const int64_t K = s.head_dim;
  std::fill(dst, dst + s.padded * K, 0.0f);
  for (int64_t i = 0; i < s.length; ++i) {
    const float* row = src + (b * s.length + i) * s.row_stride() + h * K;
    for (int64_t d = 0; d < K; ++d) {
      if (transposed) dst[d * s.padded + i] = row[d] * scale;
      else dst[i * K + d] = row[d] * scale;
    }
  }
}

// The inverse of gather for a [K, padded] transposed slice: rows past L are dropped.
void scatter_transposed(const float* src_t, const Shape& s, int64_t b, int64_t h, float scale,
                        float* dst) {
  const int64_t K = s.head_dim;
  for (int64_t i = 0; i < s.length; ++i) {
    float* row = dst + (b * s.length + i) * s.row_stride() + h * K;
    for (int64_t d = 0; d < K; ++d) row[d] = src_t[d * s.padded + i] * scale;
  }
}

// out^T[j, lane] = sum_d rows[j, d] * cols_t[d, i0 + lane] for keys j < n_keys (a multiple of
// W), with the causal mask (j > i0 + lane) applied on the diagonal block when `mask` is set.
template <int K>
void products_t(const float* rows, const float* cols_t, int64_t padded, int64_t i0,
                int64_t n_keys, bool mask, float* out_t) {
  // The K query columns stay in registers beside the kKeys accumulators where they fit;
  // otherwise each is loaded where it is used (an L1 load per kKeys multiply-adds).
  constexpr bool kResident = K + kKeys + 2 <= kRegisters;
  Vec c[kResident ? K : 1];
  if constexpr (kResident)
    for (int d = 0; d < K; ++d) c[d] = load(cols_t + d * padded + i0);
  for (int64_t j = 0; j < n_keys; j += kKeys) {
    Vec a[kKeys] = {};
    for (int d = 0; d < K; ++d) {
      Vec cd;
      if constexpr (kResident) cd = c[d];
      else cd = load(cols_t + d * padded + i0);
      for (int jj = 0; jj < kKeys; ++jj) a[jj] += rows[(j + jj) * K + d] * cd;
    }
    for (int jj = 0; jj < kKeys; ++jj) store(out_t + (j + jj) * W, a[jj]);
  }
  if (mask) {
    IVec lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    for (int64_t j = i0; j < n_keys; ++j) {
      const IVec hidden = lane < static_cast<int32_t>(j - i0);
      store(out_t + j * W, hidden ? splat(kMasked) : load(out_t + j * W));
    }
  }
}

// out_t[d * padded + i0 + lane] = scale[lane] * sum_{j < n_keys} rows[j, d] * weights_t[j, lane].
template <int K>
void weighted_sum_t(const float* rows, const float* weights_t, int64_t n_keys, int64_t padded,
                    int64_t i0, Vec scale, float* out_t) {
  constexpr int kChunk = K < kAccumulators ? K : kAccumulators;
  for (int d0 = 0; d0 < K; d0 += kChunk) {
    Vec acc[kChunk] = {};
    for (int64_t j = 0; j < n_keys; ++j) {
      const Vec w = load(weights_t + j * W);
      for (int d = 0; d < kChunk; ++d) acc[d] += rows[j * K + d0 + d] * w;
    }
    for (int d = 0; d < kChunk; ++d) store(out_t + (d0 + d) * padded + i0, acc[d] * scale);
  }
}

// out[j, :] += sum_lane weights_t[j, lane] * rows[i0 + lane, :] for j < n_keys (a multiple of
// W), W columns of the rows at a time (one vector) so the kKeys accumulators stay in registers.
template <int K>
void accumulate_rows(const float* weights_t, const float* rows, int64_t i0, int64_t n_keys,
                     float* out) {
  if constexpr (K >= W) {
    for (int64_t j = 0; j < n_keys; j += kKeys) {
      for (int d0 = 0; d0 < K; d0 += W) {
        Vec a[kKeys] = {};
        for (int l = 0; l < W; ++l) {
          const Vec r = load(rows + (i0 + l) * K + d0);
          for (int jj = 0; jj < kKeys; ++jj) a[jj] += weights_t[(j + jj) * W + l] * r;
        }
        for (int jj = 0; jj < kKeys; ++jj) {
          float* o = out + (j + jj) * K + d0;
          store(o, load(o) + a[jj]);
        }
      }
    }
  } else {  // rows narrower than a vector
    for (int64_t j = 0; j < n_keys; j += kKeys) {
      float a[kKeys][K] = {};
      for (int l = 0; l < W; ++l) {
        const float* r = rows + (i0 + l) * K;
        for (int jj = 0; jj < kKeys; ++jj) {
          const float w = weights_t[(j + jj) * W + l];
          for (int d = 0; d < K; ++d) a[jj][d] += w * r[d];
        }
      }
      for (int jj = 0; jj < kKeys; ++jj)
        for (int d = 0; d < K; ++d) out[(j + jj) * K + d] += a[jj][d];
    }
  }
}

// Runs body(item) for item in [0, n) on the caller and the pool's threads. The caller takes
// items too, so it finishes alone if no pool thread is free; a pool task that starts after
// the items are gone returns without touching them.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const F& body) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run] { run(); });
  run();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Per-head scratch: the gathered inputs and one query block's transposed scores.
struct Scratch {
  std::vector<float> q_t, k, v, scores_t;
  explicit Scratch(const Shape& s)
      : q_t(s.head_dim * s.padded), k(s.padded * s.head_dim), v(s.padded * s.head_dim),
        scores_t(s.padded * W) {}
};

// Per query row, the statistics of the diagnostic step
// (postnorm.diagnostics.stats.attention_row_stats): the entropy of its attention and the total
// variation distance from uniform attention over its i visible keys. Left null (both), they are not computed.
struct RowStats {
  float* entropy = nullptr;  // [B, H, L]
  float* tv_uniform = nullptr;  // [B, H, L]
};

template <int K>
void forward_head(const Shape& s, int64_t b, int64_t h, const float* q, const float* k,
                  const float* v, float* o, float* lse, RowStats stats) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  Scratch t(s);
  gather(q, s, b, h, scale, /*transposed=*/true, t.q_t.data());
  gather(k, s, b, h, 1.0f, false, t.k.data());
  gather(v, s, b, h, 1.0f, false, t.v.data());
  std::vector<float> o_t(K * s.padded);
  const int64_t row0 = (b * s.heads + h) * s.length;
  IVec lane;
  for (int l = 0; l < W; ++l) lane[l] = l;
  for (int64_t i0 = 0; i0 < s.padded; i0 += W) {
    const int64_t n_keys = i0 + W;
    float* p_t = t.scores_t.data();
    products_t<K>(t.k.data(), t.q_t.data(), s.padded, i0, n_keys, /*mask=*/true, p_t);
    Vec m = splat(kMasked);
    for (int64_t j = 0; j < n_keys; ++j) m = vmax(m, load(p_t + j * W));
    Vec total{}, weighted_log{};  // sum_j e_j and sum_j e_j (s_j - m), e_j = exp(s_j - m)
    for (int64_t j = 0; j < n_keys; ++j) {
      const Vec shifted = load(p_t + j * W) - m;
      const Vec p = vexp(shifted);
      store(p_t + j * W, p);
      total += p;
      if (stats.entropy) weighted_log += p * shifted;
    }
    const Vec inv_total = 1.0f / total;
    weighted_sum_t<K>(t.v.data(), p_t, n_keys, s.padded, i0, inv_total, o_t.data());
    Vec entropy{}, tv{};
    if (stats.entropy) {
      // H = log(total) - sum_j p_j (s_j - m); TV = 1/2 sum_{j <= i} |p_j - 1/(i + 1)|
      const Vec uniform = 1.0f / __builtin_convertvector(lane + static_cast<int32_t>(i0 + 1), Vec);
      for (int64_t j = 0; j < i0; ++j) {
        const Vec d = load(p_t + j * W) * inv_total - uniform;
        tv += d > 0 ? d : -d;
      }
      for (int64_t j = i0; j < n_keys; ++j) {
        const Vec d = load(p_t + j * W) * inv_total - uniform;
        const IVec visible = lane >= static_cast<int32_t>(j - i0);
        tv += visible ? (d > 0 ? d : -d) : splat(0.0f);
      }
      entropy = -weighted_log * inv_total;
    }
    for (int l = 0; l < W && i0 + l < s.length; ++l) {
      const float log_total = std::log(total[l]);
      lse[row0 + i0 + l] = m[l] + log_total;
      if (stats.entropy) {
        stats.entropy[row0 + i0 + l] = entropy[l] + log_total;
        stats.tv_uniform[row0 + i0 + l] = 0.5f * tv[l];
      }
    }
  }
  scatter_transposed(o_t.data(), s, b, h, 1.0f, o);
}

template <int K>
void backward_head(const Shape& s, int64_t b, int64_t h, const float* q, const float* k,
                   const float* v, const float* o, const float* lse, const float* d_o,
                   float* dq, float* dk, float* dv) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  Scratch t(s);
  gather(q, s, b, h, scale, /*transposed=*/true, t.q_t.data());
  gather(k, s, b, h, 1.0f, false, t.k.data());
  gather(v, s, b, h, 1.0f, false, t.v.data());
  std::vector<float> ds_scratch_t(s.padded * W), q_rows(s.padded * K), do_t(K * s.padded),
      do_rows(s.padded * K),
      o_t(K * s.padded), dq_t(K * s.padded), dk_rows(s.padded * K, 0.0f),
      dv_rows(s.padded * K, 0.0f);
  gather(q, s, b, h, scale, false, q_rows.data());
  gather(d_o, s, b, h, 1.0f, true, do_t.data());
  gather(d_o, s, b, h, 1.0f, false, do_rows.data());
  gather(o, s, b, h, 1.0f, true, o_t.data());
  const float* lse_row = lse + (b * s.heads + h) * s.length;
  for (int64_t i0 = 0; i0 < s.padded; i0 += W) {
    const int64_t n_keys = i0 + W;
    Vec lse_v{}, delta{};
    for (int l = 0; l < W && i0 + l < s.length; ++l) lse_v[l] = lse_row[i0 + l];
    for (int d = 0; d < K; ++d) delta += load(&do_t[d * s.padded + i0]) * load(&o_t[d * s.padded + i0]);
    float* p_t = t.scores_t.data();
    float* ds_t = ds_scratch_t.data();
    products_t<K>(t.k.data(), t.q_t.data(), s.padded, i0, n_keys, /*mask=*/true, p_t);
    for (int64_t j = 0; j < n_keys; ++j) store(p_t + j * W, vexp(load(p_t + j * W) - lse_v));
    products_t<K>(t.v.data(), do_t.data(), s.padded, i0, n_keys, /*mask=*/false, ds_t);
    for (int64_t j = 0; j < n_keys; ++j)
      store(ds_t + j * W, load(p_t + j * W) * (load(ds_t + j * W) - delta));
    accumulate_rows<K>(p_t, do_rows.data(), i0, n_keys, dv_rows.data());
    accumulate_rows<K>(ds_t, q_rows.data(), i0, n_keys, dk_rows.data());
    weighted_sum_t<K>(t.k.data(), ds_t, n_keys, s.padded, i0, splat(1.0f), dq_t.data());
  }
  scatter_transposed(dq_t.data(), s, b, h, scale, dq);
  for (int64_t j = 0; j < s.length; ++j) {
    float* dk_row = dk + (b * s.length + j) * s.row_stride() + h * K;
    float* dv_row = dv + (b * s.length + j) * s.row_stride() + h * K;
    std::memcpy(dk_row, &dk_rows[j * K], K * sizeof(float));
    std::memcpy(dv_row, &dv_rows[j * K], K * sizeof(float));
  }
}

template <typename Head>
ffi::Error for_each_head(ffi::ThreadPool& pool, const Shape& s, const Head& head) {
  parallel_for(pool, s.batch * s.heads, [&](int64_t item) { head(item / s.heads, item % s.heads); });
  return ffi::Error::Success();
}

#define POSTNORM_DISPATCH_HEAD_DIM(HEAD_DIM, CALL) \
  switch (HEAD_DIM) {                              \
    case 4: { constexpr int K = 4; CALL; }         \
    case 8: { constexpr int K = 8; CALL; }         \
    case 16: { constexpr int K = 16; CALL; }       \
    case 32: { constexpr int K = 32; CALL; }       \
    case 64: { constexpr int K = 64; CALL; }       \
    case 128: { constexpr int K = 128; CALL; }     \
    case 256: { constexpr int K = 256; CALL; }     \
    default:                                       \
      return ffi::Error::InvalidArgument(          \
          "causal_attention_cpu: head dimension must be 4, 8, 16, 32, 64, 128 or 256");  \
  }

ffi::Error ForwardWithStats(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                            ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, float* op,
                            float* lp, RowStats stats) {
  if (q.dimensions().size() != 4) return ffi::Error::InvalidArgument("q must be [B, L, H, K]");
  const Shape s = shape_of(q.dimensions());
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  POSTNORM_DISPATCH_HEAD_DIM(s.head_dim, return for_each_head(pool, s, [&](int64_t b, int64_t h) {
    forward_head<K>(s, b, h, qp, kp, vp, op, lp, stats);
  }))
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                   ffi::ResultBuffer<ffi::F32> lse) {
  return ForwardWithStats(pool, q, k, v, o->typed_data(), lse->typed_data(), RowStats{});
}

ffi::Error ForwardStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                        ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> entropy,
                        ffi::ResultBuffer<ffi::F32> tv_uniform) {
  return ForwardWithStats(pool, q, k, v, o->typed_data(), lse->typed_data(),
                          RowStats{entropy->typed_data(), tv_uniform->typed_data()});
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> d_o, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  if (q.dimensions().size() != 4) return ffi::Error::InvalidArgument("q must be [B, L, H, K]");
  const Shape s = shape_of(q.dimensions());
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(),
              *op = o.typed_data(), *lp = lse.typed_data(), *dop = d_o.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  POSTNORM_DISPATCH_HEAD_DIM(s.head_dim, return for_each_head(pool, s, [&](int64_t b, int64_t h) {
    backward_head<K>(s, b, h, qp, kp, vp, op, lp, dop, dqp, dkp, dvp);
  }))
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PostnormCausalAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PostnormCausalAttentionForwardStats, ForwardStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PostnormCausalAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
