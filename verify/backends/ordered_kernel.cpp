// Position-ordered attention for decoding forwards (a step, a chain, a tree), one query at a time.
//
// Why: a tree node must get the bits its root-to-node path gets when decoded one token at a time, and a row of a
// batch the bits it gets alone. Here each (row, head, query) walks its own visible keys in position order (its
// context slots 0 .. ctx - 1, then the listed window slots: a tree node's ancestors, then itself) and every sum
// runs over that list with the same code, whatever else the forward verifies beside it: the scores one key at a
// time, their maximum, the exponentials and their sum in lanes of 16 keys counted from the query's first key, and
// the weighted values one key after another. So the result depends only on the query and its keys in order; a
// batch's rows read only their own keys (no padding, no span of the longest row); nothing is gathered or copied.
//
// The arithmetic is explicit (intrinsics, or plain loops built with -ffp-contract=off): a compiler may not
// regroup it, so a query's bits do not depend on where its keys sit in memory or how many queries share a call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// One row of dim_head values, as float32: keys are stored float32 (or bf16), values bf16 (or float32).
template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

constexpr int LANES = 16;  // keys per lane group of the exp-sum, and floats per vector

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 -> float32 is exact: the 16 bits become the high half of the float's 32
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for 16 lanes of x <= 0 (Cephes' expf polynomial; within 2 ulp of exp). Inputs below -104 give 0, as
// exp's float result does (2^-150 is under the smallest denormal).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// q . k over NV * 16 dims: the products of each lane added in dim order, then the 16 lanes in a fixed tree.
template <int NV, typename K>
inline float dot(const __m512 (&q)[NV], const K* k) {
  __m512 acc = _mm512_mul_ps(q[0], load16(k));
  for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[i], load16(k + LANES * i), acc);
  return _mm512_reduce_add_ps(acc);
}

// The exponentials of scores s[0, L) (in place) and their sum: 16 lanes, lane l summing keys l, l + 16, ...
inline float exp_sum(float* s, int64_t L, float top) {
  __m512 lanes = _mm512_setzero_ps(), m = _mm512_set1_ps(top);
  int64_t j = 0;
  for (; j + LANES <= L; j += LANES) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  if (j < L) {  // the last keys: missing lanes add exact zeros
    __mmask16 live = static_cast<__mmask16>((1u << (L - j)) - 1u);
    __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m)));
    _mm512_mask_storeu_ps(s + j, live, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  return _mm512_reduce_add_ps(lanes);
}

// out[0, NV * 16) = sum_j e[j] * v(slot j) / z, the keys one after another.
template <int NV, typename V, typename Slot>
inline void weighted(const float* e, int64_t L, Slot slot, const V* v, int64_t sv, float z, float* out) {
  __m512 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const V* row = v + sv * slot(j);
    __m512 w = _mm512_set1_ps(e[j]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(w, load16(row + LANES * i), acc[i]);
  }
  __m512 zz = _mm512_set1_ps(z);
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + LANES * i, _mm512_div_ps(acc[i], zz));
}

template <int NV, typename Q>
inline void load_query(const Q* q, __m512 (&out)[NV]) {
  for (int i = 0; i < NV; ++i) out[i] = load16(q + LANES * i);
}

#else  // portable: the same sums in plain loops (built with -ffp-contract=off, so no fused multiply-adds)

template <int NV>
struct Vec {
  float x[NV * LANES];
};

template <int NV, typename K>
inline float dot(const Vec<NV>& q, const K* k) {
  float lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = q.x[l] * as_float(k[l]);
  for (int i = 1; i < NV; ++i)
    for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + q.x[LANES * i + l] * as_float(k[LANES * i + l]);
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  return lanes[0];
}

inline float exp_sum(float* s, int64_t L, float top) {
  float lanes[LANES] = {0};
  for (int64_t j = 0; j < L; ++j) {
    s[j] = std::exp(s[j] - top);
    lanes[j % LANES] = lanes[j % LANES] + s[j];
  }
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  return lanes[0];
}

template <int NV, typename V, typename Slot>
inline void weighted(const float* e, int64_t L, Slot slot, const V* v, int64_t sv, float z, float* out) {
  float acc[NV * LANES] = {0};
  for (int64_t j = 0; j < L; ++j) {
    const V* row = v + sv * slot(j);
    for (int d = 0; d < NV * LANES; ++d) acc[d] = acc[d] + e[j] * as_float(row[d]);
  }
  for (int d = 0; d < NV * LANES; ++d) out[d] = acc[d] / z;
}

template <int NV, typename Q>
inline void load_query(const Q* q, Vec<NV>& out) {
  for (int d = 0; d < NV * LANES; ++d) out.x[d] = as_float(q[d]);
}

#endif

template <typename T>
const T* data(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}

// One (row, query, head): scores over its keys in position order, softmax, weighted values -> out (dim_head,).
template <int NV, typename Q, typename K, typename V>
void attend_one(const Q* q, const K* k, const V* v, int64_t sk, int64_t sv, int64_t ctx, const int64_t* extra,
                int64_t count, float scale, std::vector<float>& s, float* out) {
  const int64_t L = ctx + count;
  if (static_cast<int64_t>(s.size()) < L) s.resize(L);
#if defined(__AVX512F__)
  __m512 qv[NV];
#else
  Vec<NV> qv;
#endif
  load_query<NV>(q, qv);
  auto slot = [&](int64_t j) { return j < ctx ? j : extra[j - ctx]; };
  float top = -INFINITY;
  for (int64_t j = 0; j < ctx; ++j) {
    s[j] = dot<NV>(qv, k + sk * j) * scale;
    top = s[j] > top ? s[j] : top;
  }
  for (int64_t j = ctx; j < L; ++j) {
    s[j] = dot<NV>(qv, k + sk * extra[j - ctx]) * scale;
    top = s[j] > top ? s[j] : top;
  }
  const float z = exp_sum(s.data(), L, top);
  weighted<NV>(s.data(), L, slot, v, sv, z, out);
}

template <int NV, typename Q, typename K, typename V>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
                const at::Tensor& extra, const at::Tensor& count, double scale, at::Tensor& out) {
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), d = q.size(3), g = k.size(1), m = extra.size(2);
  const int64_t r = h / g;
  const Q* qd = data<Q>(q);
  const K* kd = data<K>(k);
  const V* vd = data<V>(v);
  const int64_t *cd = data<int64_t>(ctx), *ed = data<int64_t>(extra), *nd = data<int64_t>(count);
  float* od = static_cast<float*>(out.data_ptr());
  // work items: (row, query, head), each one query's whole attention
  at::parallel_for(0, b * n * h, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bi = w / (n * h), i = (w / h) % n, head = w % h, gi = head / r;
      const int64_t bn = bi * n + i;
      attend_one<NV>(qd + w * d, kd + bi * k.stride(0) + gi * k.stride(1), vd + bi * v.stride(0) + gi * v.stride(1),
                     k.stride(2), v.stride(2), cd[bn], ed + bn * m, nd[bn], static_cast<float>(scale), s, od + w * d);
    }
  });
}

template <int NV>
void dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
              const at::Tensor& extra, const at::Tensor& count, double scale, at::Tensor& out) {
  using BF = c10::BFloat16;
  const auto bf = at::kBFloat16, f32 = at::kFloat;
  const auto qt = q.scalar_type(), kt = k.scalar_type(), vt = v.scalar_type();
  if (qt == bf && kt == f32 && vt == bf) return attend_all<NV, BF, float, BF>(q, k, v, ctx, extra, count, scale, out);
  if (qt == bf && kt == bf && vt == bf) return attend_all<NV, BF, BF, BF>(q, k, v, ctx, extra, count, scale, out);
  if (qt == f32 && kt == f32 && vt == f32)
    return attend_all<NV, float, float, float>(q, k, v, ctx, extra, count, scale, out);
  TORCH_CHECK(false, "ordered attention kernel: q, k, v dtypes ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type(), " are not one of (bf16, f32, bf16), (bf16, bf16, bf16), (f32, f32, f32)");
}


#if defined(__AVX512BF16__)
// bf16 queries, keys and values on a CPU with AVX512-BF16 (the lean Llama engine's bf16 cache): products of bf16
// pairs (exact in float32) accumulated by vdpbf16ps, 16 keys' scores at a time. The same per-query order as above:
// a key's score sums its own products in a fixed tree (lane t of a block of 16 logical positions); the weights are
// rounded to bf16 and taken in pairs of logical positions (2p, 2p + 1), keys one pair after another.
using BF = c10::BFloat16;
alignas(64) const BF ZERO_ROW[128] = {};  // the key and value of positions past a query's last (weight 0)

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
inline __m512bh load_bh(const BF* p) { return as_bh(_mm512_loadu_si512(p)); }

// a[0..15] -> one vector whose lane t is the sum of a[t]'s 16 lanes, by the same tree for every t
inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 s1[8], s2[4], s3[2];
  for (int t = 0; t < 8; ++t)
    s1[t] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * t], a[2 * t + 1]), _mm512_unpackhi_ps(a[2 * t], a[2 * t + 1]));
  for (int t = 0; t < 4; ++t)
    s2[t] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * t], s1[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s1[2 * t], s1[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int t = 0; t < 2; ++t)
    s3[t] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * t], s2[2 * t + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s2[2 * t], s2[2 * t + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// R heads of one kv group (their q rows consecutive), one query: out (R, 32 W) float32.
template <int W, int R>
void attend_heads_bf16(const BF* q, const BF* k, const BF* v, int64_t sk, int64_t sv, int64_t ctx,
                       const int64_t* extra, int64_t count, float scale, std::vector<float>& buf, float* out) {
  constexpr int D = 32 * W;
  const int64_t L = ctx + count, blocks = (L + LANES - 1) / LANES, padded = blocks * LANES;
  if (static_cast<int64_t>(buf.size()) < R * padded * 2) buf.resize(R * padded * 2);
  float* scores = buf.data();                              // (R, padded)
  BF* weights = reinterpret_cast<BF*>(buf.data() + R * padded);  // (R, padded) bf16
  auto row = [&](const BF* base, int64_t stride, int64_t j) -> const BF* {
    return j < ctx ? base + stride * j : (j < L ? base + stride * extra[j - ctx] : ZERO_ROW);
  };
  __m512bh qv[R][W];
  for (int h = 0; h < R; ++h)
    for (int w = 0; w < W; ++w) qv[h][w] = load_bh(q + h * D + 32 * w);
  __m512 top[R];
  for (int h = 0; h < R; ++h) top[h] = _mm512_set1_ps(-INFINITY);
  const __m512 sv_scale = _mm512_set1_ps(scale);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const BF* keys[LANES];
    for (int t = 0; t < LANES; ++t) keys[t] = row(k, sk, blk * LANES + t);
    const int64_t left = L - blk * LANES;
    const __mmask16 live = left >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    for (int h = 0; h < R; ++h) {
      __m512 acc[LANES];
      for (int t = 0; t < LANES; ++t) {
        acc[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], load_bh(keys[t]));
        for (int w = 1; w < W; ++w) acc[t] = _mm512_dpbf16_ps(acc[t], qv[h][w], load_bh(keys[t] + 32 * w));
      }
      __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(sum_lanes16(acc), sv_scale));
      _mm512_storeu_ps(scores + h * padded + blk * LANES, sc);
      top[h] = _mm512_max_ps(top[h], sc);
    }
  }
  float z[R];
  for (int h = 0; h < R; ++h) {  // weights exp(s - max) rounded to bf16, and their sum as rounded
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top[h]));
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t left = L - blk * LANES;
      const __mmask16 live = left >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
      __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + h * padded + blk * LANES), m)));
      __m256bh eb = _mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + h * padded + blk * LANES), reinterpret_cast<__m256i&>(eb));
      lanes = _mm512_add_ps(lanes, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(eb)), 16)));
    }
    z[h] = _mm512_reduce_add_ps(lanes);
  }
  // values in pairs of positions: vdpbf16ps adds w[2p] v[2p] + w[2p+1] v[2p+1] per dim, the dims interleaved by
  // unpacklo/hi (lane (l, e) of lo: dim 8 l + e; of hi: 8 l + 4 + e, per 128-bit lane l)
  __m512 acc[R][2 * W];
  for (int h = 0; h < R; ++h)
    for (int w = 0; w < 2 * W; ++w) acc[h][w] = _mm512_setzero_ps();
  for (int64_t p = 0; p < padded / 2; ++p) {
    const BF *a = row(v, sv, 2 * p), *b = row(v, sv, 2 * p + 1);
    for (int w = 0; w < W; ++w) {
      const __m512i va = _mm512_loadu_si512(a + 32 * w), vb = _mm512_loadu_si512(b + 32 * w);
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(va, vb)), hi = as_bh(_mm512_unpackhi_epi16(va, vb));
      for (int h = 0; h < R; ++h) {
        const __m512bh pair = as_bh(_mm512_set1_epi32(reinterpret_cast<const int32_t*>(weights + h * padded)[p]));
        acc[h][2 * w] = _mm512_dpbf16_ps(acc[h][2 * w], lo, pair);
        acc[h][2 * w + 1] = _mm512_dpbf16_ps(acc[h][2 * w + 1], hi, pair);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < R; ++h) {
    const __m512 zz = _mm512_set1_ps(z[h]);
    for (int w = 0; w < W; ++w) {
      __m512 lo = acc[h][2 * w], hi = acc[h][2 * w + 1];
      _mm512_storeu_ps(out + h * D + 32 * w, _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), zz));
      _mm512_storeu_ps(out + h * D + 32 * w + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), zz));
    }
  }
}

template <int W, int R>
void attend_all_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
                     const at::Tensor& extra, const at::Tensor& count, double scale, at::Tensor& out) {
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), d = q.size(3), g = k.size(1), m = extra.size(2);
  const int64_t per = h / g / R;  // items per (row, query, kv head): its heads R at a time
  const BF* qd = data<BF>(q);
  const BF* kd = data<BF>(k);
  const BF* vd = data<BF>(v);
  const int64_t *cd = data<int64_t>(ctx), *ed = data<int64_t>(extra), *nd = data<int64_t>(count);
  float* od = static_cast<float*>(out.data_ptr());
  at::parallel_for(0, b * n * g * per, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t bi = w / (n * g * per), i = (w / (g * per)) % n, head = (w % (g * per)) * R, gi = head / (h / g);
      const int64_t bn = bi * n + i, at = (bn * h + head) * d;
      attend_heads_bf16<W, R>(qd + at, kd + bi * k.stride(0) + gi * k.stride(1), vd + bi * v.stride(0) + gi * v.stride(1),
                              k.stride(2), v.stride(2), cd[bn], ed + bn * m, nd[bn], static_cast<float>(scale), buf,
                              od + at);
    }
  });
}

// R heads together where that leaves every thread work (a batch-1 step has only g x r heads); each head's sums are
// the same whichever R computes them.
template <int W>
bool dispatch_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
                   const at::Tensor& extra, const at::Tensor& count, double scale, at::Tensor& out) {
  const int64_t r = q.size(2) / k.size(1), items = q.size(0) * q.size(1) * k.size(1);
  const bool few = items < 4 * at::get_num_threads();
  if (!few && r % 4 == 0) attend_all_bf16<W, 4>(q, k, v, ctx, extra, count, scale, out);
  else if (!few && r % 3 == 0) attend_all_bf16<W, 3>(q, k, v, ctx, extra, count, scale, out);
  else if (!few && r % 2 == 0) attend_all_bf16<W, 2>(q, k, v, ctx, extra, count, scale, out);
  else attend_all_bf16<W, 1>(q, k, v, ctx, extra, count, scale, out);
  return true;
}

bool try_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
              const at::Tensor& extra, const at::Tensor& count, double scale, at::Tensor& out) {
  const bool all_bf16 = q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                        v.scalar_type() == at::kBFloat16;
  if (!all_bf16) return false;
  switch (q.size(3)) {
    case 32: return dispatch_bf16<1>(q, k, v, ctx, extra, count, scale, out);
    case 64: return dispatch_bf16<2>(q, k, v, ctx, extra, count, scale, out);
    case 128: return dispatch_bf16<4>(q, k, v, ctx, extra, count, scale, out);
    default: return false;
  }
}
constexpr bool FAST_BF16 = true;
#else
bool try_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, double, at::Tensor&) {
  return false;
}
constexpr bool FAST_BF16 = false;
#endif

// q (b, n, h, dh) contiguous; k, v (b, g, S, dh) with each slot's dh values contiguous; ctx, count (b, n) and
// extra (b, n, m) int64 contiguous: query i of row b sees slots [0, ctx) then extra[:count] -> (b, n, h, dh) float32.
at::Tensor attend_ordered(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx,
                          const at::Tensor& extra, const at::Tensor& count, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "ordered attention kernel: q, k, v must be 4-d");
  TORCH_CHECK(q.is_contiguous() && ctx.is_contiguous() && extra.is_contiguous() && count.is_contiguous(),
              "ordered attention kernel: q, ctx, extra, count must be contiguous");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "ordered attention kernel: k, v rows must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "ordered attention kernel: CPU only");
  TORCH_CHECK(ctx.scalar_type() == at::kLong && extra.scalar_type() == at::kLong && count.scalar_type() == at::kLong,
              "ordered attention kernel: ctx, extra, count must be int64");
  TORCH_CHECK(q.size(2) % k.size(1) == 0, "ordered attention kernel: heads must be a multiple of kv heads");
  const int64_t d = q.size(3);
  at::Tensor out = q.new_empty(q.sizes(), q.options().dtype(at::kFloat));
  if (try_bf16(q, k, v, ctx, extra, count, scale, out)) return out;
  switch (d) {
    case 16: dispatch<1>(q, k, v, ctx, extra, count, scale, out); break;
    case 32: dispatch<2>(q, k, v, ctx, extra, count, scale, out); break;
    case 64: dispatch<4>(q, k, v, ctx, extra, count, scale, out); break;
    case 128: dispatch<8>(q, k, v, ctx, extra, count, scale, out); break;
    default: TORCH_CHECK(false, "ordered attention kernel: dim_head ", d, " is not one of 16, 32, 64, 128");
  }
  return out;
}

// Whether bf16 keys take the vdpbf16ps path (else a bf16 cache's keys are better stored float32).
bool fast_bf16() { return FAST_BF16; }

}  // namespace

TORCH_LIBRARY(prophet_medusa, m) {
  m.def("attend_ordered(Tensor q, Tensor k, Tensor v, Tensor ctx, Tensor extra, Tensor count, float scale) -> Tensor");
  m.def("fast_bf16() -> bool", &fast_bf16);
}

TORCH_LIBRARY_IMPL(prophet_medusa, CPU, m) { m.impl("attend_ordered", &attend_ordered); }
