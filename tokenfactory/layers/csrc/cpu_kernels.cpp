// The engine's CPU kernels: decode attention straight from the paged KV cache, RMSNorm, and int4 weights
// dequantized from torch's packed layout (so a quantized layer keeps its codes once).
//
// Decode attention.
// The PyTorch fallback gathers every sequence's blocks into a padded copy, then runs two batched matmuls over
// it: the KV cache is read once, written once and read again, and at 64 sequences of ~500 tokens that copy
// was a third of the decode step. Here each (sequence, KV head) is one task that walks its block table and
// reads each key and value once, in place: scores, softmax and the weighted sum of values in float32,
// for the `group` query heads that share the KV head (grouped-query attention without repeating K/V).
//
// A sequence may bring several query rows (a speculative chunk: its last token and the drafts); its rows are
// one task too, so its keys are still read once, each row seeing keys up to its own position.
//
// Layouts (as in attention.py): q (T, num_heads, d); caches (num_kv_heads, num_blocks, block_size, d);
// block_tables (S, max_blocks) int64; seq_lens (S,) int64: keys of each sequence, this step's included;
// query_start (S + 1,) int64: sequence s owns rows [query_start[s], query_start[s + 1]) of q, and its row r
// of n sits at position seq_lens[s] - n + r. Returns (T, num_heads, d) in q's dtype.
// An int8 cache (paged_decode_attention_int8) carries one float16 scale per (KV head, slot) for keys and for
// values; a sliding window (window > 0) limits each row to its last `window` keys.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
#include <immintrin.h>  // decode attention's AVX-512 path (any AVX-512 CPU)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TF_Q8ACT_VNNI 1  // the int8-activation kernels' fast path (see q8act_linear)
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(double x) { return static_cast<float>(x); }

// Blocks are scattered over the pool (the free list is LRU order after any churn): the hardware prefetcher
// does not follow a jump to the next block, so ask for it while this one is being computed.
template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
}

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* __restrict v, float* __restrict acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * to_float(v[i]);
}

// D > 0: the head size known at compile time (64, 128: the common ones), so the per-token loops unroll and
// their partial sums stay in registers; D == 0: any head size, read from `head_dim`.
// C is the cache's element type: T itself, or int8_t for an int8 KV cache, whose one scale per (head, slot)
// (float16, beside the blocks: k_scale/v_scale (num_kv_heads, num_blocks, block_size)) multiplies a key's dot
// product and a value's weight, so an int8 block is read in place, never expanded.
// window > 0: row r at position p sees only keys [p - window + 1, p] (sliding-window attention); blocks
// wholly before the first row's window are never touched (they may have been freed and reused).
template <typename T, typename C, int64_t D>
void attend_task(const T* q, const C* k_cache, const C* v_cache, const c10::Half* k_scale,
                 const c10::Half* v_scale, const int64_t* table, int64_t len, int64_t num_rows, int64_t num_heads,
                 int64_t head, int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                 int64_t window, float scale, T* out, std::vector<float>& buf) {
  constexpr bool quantized = std::is_same<C, int8_t>::value;
  const int64_t d = D > 0 ? D : head_dim;
  // Queries: num_rows x group, row r (of this sequence's chunk) sees keys [lo_r, len - num_rows + r].
  // Keys are indexed from `base` (the first block any row sees); span = len - base.
  const int64_t first_lo = window > 0 ? std::max<int64_t>(0, len - num_rows - window + 1) : 0;
  const int64_t base = first_lo / block_size * block_size;
  const int64_t span = len - base;
  // buf: queries * d query floats, queries * span scores, queries * d accumulators.
  const int64_t nq = num_rows * group;
  buf.resize(static_cast<size_t>(nq * (2 * d + span)));
  float* qf = buf.data();
  float* scores = qf + nq * d;
  float* acc = scores + nq * span;
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t i = 0; i < group * d; ++i) qf[r * group * d + i] = to_float(q[r * num_heads * d + i]) * scale;
  const int64_t head_offset = head * num_blocks * block_size * d;
  const int64_t scale_offset = head * num_blocks * block_size;
  // This head's part of the block holding tokens t0.. (of keys or values), the next one prefetched.
  auto block = [&](const C* cache, int64_t t0) {
    const C* head_cache = cache + head_offset;
    if (t0 + block_size < len) prefetch_block(head_cache + table[t0 / block_size + 1] * block_size * d, block_size * d);
    return head_cache + table[t0 / block_size] * block_size * d;
  };
  // Every query scores every key (a row's few keys outside its window are zeroed below): one pass
  // over the keys serves all rows of a speculative chunk.
  for (int64_t t0 = base; t0 < len; t0 += block_size) {
    const C* kb = block(k_cache, t0);
    const int64_t n = std::min(block_size, len - t0);
    float* st = scores + (t0 - base);
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (quantized) {
        const float ks = static_cast<float>(k_scale[scale_offset + table[t0 / block_size] * block_size + t]);
        for (int64_t j = 0; j < nq; ++j) st[j * span + t] = dot(qf + j * d, kb + t * d, d) * ks;
      } else {
        for (int64_t j = 0; j < nq; ++j) st[j * span + t] = dot(qf + j * d, kb + t * d, d);
      }
    }
  }
  std::fill(acc, acc + nq * d, 0.f);
  std::vector<float> denom(static_cast<size_t>(nq));
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t pos = len - num_rows + j / group;  // this row's position: its last visible key
    const int64_t lo = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - base;
    const int64_t visible = pos + 1 - base;
    float* s = scores + j * span;
    const float m = *std::max_element(s + lo, s + visible);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = lo; t < visible; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    std::fill(s, s + lo, 0.f);
    std::fill(s + visible, s + span, 0.f);
    denom[j] = sum;
  }
  for (int64_t t0 = base; t0 < len; t0 += block_size) {
    const C* vb = block(v_cache, t0);
    const int64_t n = std::min(block_size, len - t0);
    const float* st = scores + (t0 - base);
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (quantized) {
        const float vs = static_cast<float>(v_scale[scale_offset + table[t0 / block_size] * block_size + t]);
        for (int64_t j = 0; j < nq; ++j) axpy(st[j * span + t] * vs, vb + t * d, acc + j * d, d);
      } else {
        for (int64_t j = 0; j < nq; ++j) axpy(st[j * span + t], vb + t * d, acc + j * d, d);
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const float inv = 1.f / denom[j];
    T* o = out + (j / group) * num_heads * d + (j % group) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(acc[j * d + i] * inv);
  }
}

// Decode rows (one query row per sequence, the cache in the model's dtype): the keys are cut into spans of
// KSPAN positions, each (sequence, KV head, span) one task with its own softmax (its maximum m, its sum l and its
// weighted values), and the spans are merged after, in order (flash-decoding's split). One sequence's three KV
// heads on two threads left one thread idle a third of the time; spans keep both busy at any batch size. The
// spans are fixed by positions alone, never by the batch, so a sequence's attention is the same bits beside any
// other sequence. The group's queries share each key and value row, converted to float once.
constexpr int64_t KSPAN = 64;

// s[t] = e^(s[t] - m) for t < n (every s[t] <= m), returning their sum: the softmax's weights. (An AVX-512
// polynomial exp measured no faster here: the exponentials are a small part of a span.)
inline float exp_shifted_sum(float* s, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// f(j, row) for the rows of positions t0 + j in [t0, t1) of one head's paged cache, block by block (t0 and t1 need
// not be block-aligned), the next block prefetched.
template <typename T, typename F>
inline void span_rows(const T* head_cache, const int64_t* table, int64_t block_size, int64_t d, int64_t t0,
                      int64_t t1, F&& f) {
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / block_size, t_end = std::min(t1, (b + 1) * block_size);
    if (t_end < t1) prefetch_block(head_cache + table[b + 1] * block_size * d, block_size * d);
    const T* r = head_cache + (table[b] * block_size + t - b * block_size) * d;
    for (; t < t_end; ++t, r += d) f(t - t0, r);
  }
}

#ifdef __AVX512F__
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Sixteen vectors' horizontal sums as one vector (lane j: the sum of v[j]'s lanes), by a transposing tree: 45
// instructions where sixteen separate reductions take ~140.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// decode_span for bfloat16 caches and a head size a multiple of 16, in AVX-512 registers: g++ kept the generic
// loops to 256-bit vectors, one horizontal sum a score and the weighted values in memory (~80 cycles a key and
// head on a Xeon). Here each key and value row is widened once for the group's queries, a query's products with
// sixteen keys are summed together (hsum16), and the weighted values of up to GC queries stay in registers.
template <int64_t D>
void decode_span_bf16(const c10::BFloat16* q, const c10::BFloat16* k_head, const c10::BFloat16* v_head,
                      const int64_t* table, int64_t block_size, int64_t t0, int64_t t1, int64_t group, float scale,
                      float* part) {
  constexpr int NV = D / 16, GC = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  const int64_t n = t1 - t0;
  thread_local std::vector<__m512> buf;
  buf.resize(static_cast<size_t>(group * (NV + KSPAN + KSPAN / 16)));
  float* qf = reinterpret_cast<float*>(buf.data());          // group x D
  __m512* products = buf.data() + group * NV;                // group x KSPAN: a query's products with a key
  float* scores = reinterpret_cast<float*>(products + group * KSPAN);  // group x KSPAN
  for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(q[i]) * scale;
  // The span's keys and values asked for at once (KSPAN rows of each): at a large batch the cache streams from
  // memory, and one block ahead kept ~12 GB/s in flight where a plain read of memory takes 25.
  for (int64_t b = t0 / block_size; b * block_size < t1; ++b) {
    prefetch_block(k_head + table[b] * block_size * D, block_size * D);
    prefetch_block(v_head + table[b] * block_size * D, block_size * D);
  }
  span_rows(k_head, table, block_size, D, t0, t1, [&](int64_t j, const c10::BFloat16* kr) {
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = load_bf16x16(kr + 16 * v);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      __m512 a = _mm512_mul_ps(k[0], _mm512_loadu_ps(qg));
      for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(k[v], _mm512_loadu_ps(qg + 16 * v), a);
      products[g * KSPAN + j] = a;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * KSPAN;
    for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(sg + j, hsum16(products + g * KSPAN + j));  // past n: unused
    float* pg = part + g * (D + 2);
    pg[0] = *std::max_element(sg, sg + n);
    pg[1] = exp_shifted_sum(sg, n, pg[0]);
  }
  for (int64_t g0 = 0; g0 < group; g0 += GC) {
    const int64_t gc = std::min<int64_t>(GC, group - g0);
    __m512 acc[GC][NV];
    for (int c = 0; c < GC; ++c)
      for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_setzero_ps();
    span_rows(v_head, table, block_size, D, t0, t1, [&](int64_t j, const c10::BFloat16* vr) {
      __m512 x[NV];
      for (int v = 0; v < NV; ++v) x[v] = load_bf16x16(vr + 16 * v);
      for (int c = 0; c < GC; ++c) {
        if (c >= gc) break;
        const __m512 w = _mm512_set1_ps(scores[(g0 + c) * KSPAN + j]);
        for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_fmadd_ps(w, x[v], acc[c][v]);
      }
    });
    for (int64_t c = 0; c < gc; ++c)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(part + (g0 + c) * (D + 2) + 2 + 16 * v, acc[c][v]);
  }
}
#endif

template <typename T, int64_t D>
void decode_span(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t block_size,
                 int64_t t0, int64_t t1, int64_t group, int64_t head_dim, float scale, float* part) {
  const int64_t d = D > 0 ? D : head_dim, n = t1 - t0;
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(group * (d + KSPAN) + d));
  float* qf = buf.data();
  float* scores = qf + group * d;  // group x KSPAN
  float* row = scores + group * KSPAN;
  for (int64_t i = 0; i < group * d; ++i) qf[i] = to_float(q[i]) * scale;
  span_rows(k_head, table, block_size, d, t0, t1, [&](int64_t j, const T* kr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) row[i] = to_float(kr[i]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * d;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += qg[i] * row[i];
      scores[g * KSPAN + j] = sum;
    }
  });
  // part: per query of the group, m, l, then d weighted values.
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * KSPAN;
    const float m = *std::max_element(s, s + n);
    const float l = exp_shifted_sum(s, n, m);
    float* pg = part + g * (d + 2);
    pg[0] = m;
    pg[1] = l;
    std::fill(pg + 2, pg + 2 + d, 0.f);
  }
  span_rows(v_head, table, block_size, d, t0, t1, [&](int64_t j, const T* vr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) row[i] = to_float(vr[i]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * KSPAN + j];
      float* acc = part + g * (d + 2) + 2;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += w * row[i];
    }
  });
}

// The tasks of one decode step's attention: one per (sequence, KSPAN-aligned span from its window's start, KV head),
// in that order; offsets[s]: the sequence's first task. Thread slot t runs the tasks [bounds[t], bounds[t + 1]),
// each into its part (per query of the group: m, l, then d weighted values); the merge then joins a (sequence, KV
// head)'s parts. Shared by run_decode_spans and the decode plan's one parallel region.
struct SpanPlan {
  struct Task {
    int64_t s, h, t0, t1;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> offsets, bounds;
  std::vector<float> parts;
  int64_t num_kv_heads = 0, group = 0, d = 0, part_size = 0, threads = 0;

  void build(const int64_t* lens_p, int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
             int64_t window, int64_t max_threads) {
    num_kv_heads = kv_heads, group = num_heads / kv_heads, d = head_dim, part_size = group * (d + 2);
    tasks.clear();
    offsets.assign(num_seqs + 1, 0);
    std::vector<int64_t> work(1, 0);  // work[task]: the keys before it (a prefix sum)
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, lens_p[s] - window) : 0;
      for (int64_t c = lo / KSPAN; c * KSPAN < lens_p[s]; ++c)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          tasks.push_back({s, h, std::max(lo, c * KSPAN), std::min(lens_p[s], (c + 1) * KSPAN)});
          work.push_back(work.back() + tasks.back().t1 - tasks.back().t0);
        }
      offsets[s + 1] = static_cast<int64_t>(tasks.size());
    }
    const int64_t num_tasks = offsets[num_seqs], total = work[num_tasks];
    parts.resize(static_cast<size_t>(num_tasks * part_size));
    // Each thread takes the tasks whose middle key falls in its equal share of all the keys: equal numbers of
    // tasks would not do, as a sequence's last span is usually short (one sequence of 200 keys split 384 / 216 key
    // rows over two threads).
    threads = std::max<int64_t>(1, std::min<int64_t>(max_threads, num_tasks));
    bounds.assign(threads + 1, num_tasks);
    bounds[0] = 0;
    for (int64_t task = 0, th = 1; task < num_tasks && th < threads; ++task)
      while (th < threads && (work[task] + work[task + 1]) * threads > 2 * th * total) bounds[th++] = task;
  }

  // Thread slot `slot`'s spans of q (T, num_heads, d) against one layer's caches.
  template <typename T, int64_t D>
  void run(int64_t slot, const T* qp, const T* kp, const T* vp, const int64_t* tables_p, int64_t max_blocks,
           int64_t num_heads, int64_t num_blocks, int64_t block_size, float scale) {
    const int64_t head_stride = num_blocks * block_size * d;
    for (int64_t task = bounds[slot]; task < bounds[slot + 1]; ++task) {
      const Task& k = tasks[task];
      const T* qs = qp + (k.s * num_heads + k.h * group) * d;
      const int64_t* table = tables_p + k.s * max_blocks;
      float* part = parts.data() + task * part_size;
#ifdef __AVX512F__
      if constexpr (std::is_same<T, c10::BFloat16>::value && D > 0) {
        decode_span_bf16<D>(qs, kp + k.h * head_stride, vp + k.h * head_stride, table, block_size, k.t0, k.t1, group,
                            scale, part);
        continue;
      }
#endif
      decode_span<T, D>(qs, kp + k.h * head_stride, vp + k.h * head_stride, table, block_size, k.t0, k.t1, group, d,
                        scale, part);
    }
  }

  // The (sequence, KV head) pairs [sh0, sh1)'s spans merged, in order, into their rows of op (T, num_heads, d).
  template <typename T>
  void merge(int64_t sh0, int64_t sh1, int64_t num_heads, T* op) const {
    std::vector<float> out(static_cast<size_t>(d));
    for (int64_t sh = sh0; sh < sh1; ++sh) {
      const int64_t s = sh / num_kv_heads, h = sh % num_kv_heads;
      const int64_t spans = (offsets[s + 1] - offsets[s]) / num_kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        auto part = [&](int64_t c) {
          return parts.data() + (offsets[s] + c * num_kv_heads + h) * part_size + g * (d + 2);
        };
        float m = part(0)[0];
        for (int64_t c = 1; c < spans; ++c) m = std::max(m, part(c)[0]);
        float l = 0.f;
        std::fill(out.begin(), out.end(), 0.f);
        for (int64_t c = 0; c < spans; ++c) {
          const float* pc = part(c);
          const float w = std::exp(pc[0] - m);
          l += w * pc[1];
          for (int64_t i = 0; i < d; ++i) out[i] += w * pc[2 + i];
        }
        const float inv = 1.f / l;
        T* o = op + (s * num_heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(out[i] * inv);
      }
    }
  }
};

template <typename T, int64_t D>
void run_decode_spans(const T* qp, const T* kp, const T* vp, const int64_t* tables_p, const int64_t* lens_p,
                      int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t num_blocks, int64_t block_size, int64_t window, float scale, T* op) {
  SpanPlan plan;
  plan.build(lens_p, num_seqs, num_heads, num_kv_heads, D > 0 ? D : head_dim, window, at::get_num_threads());
  at::parallel_for(0, plan.threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot)
      plan.run<T, D>(slot, qp, kp, vp, tables_p, max_blocks, num_heads, num_blocks, block_size, scale);
  });
  at::parallel_for(0, num_seqs * num_kv_heads, 16, [&](int64_t begin, int64_t end) {
    plan.merge<T>(begin, end, num_heads, op);
  });
}

// The checks every entry point shares: shapes, index dtypes, and that each sequence's rows and the blocks it
// will read (those from its first window on) lie inside the cache.
void check_decode_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                       int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "not contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong, "index dtype");
  const int64_t num_seqs = tables.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && num_heads % num_kv_heads == 0, "head dims");
  TORCH_CHECK(lens.size(0) == num_seqs && starts.size(0) == num_seqs + 1, "one length and start per sequence");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const int64_t max_blocks = tables.size(1);
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* starts_p = starts.data_ptr<int64_t>();
  const int64_t* tables_p = tables.data_ptr<int64_t>();
  TORCH_CHECK(starts_p[0] == 0 && starts_p[num_seqs] == q.size(0), "query rows must cover q");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = starts_p[s + 1] - starts_p[s];
    TORCH_CHECK(rows >= 1 && rows <= lens_p[s], "query rows of a sequence must be 1..its length");
    TORCH_CHECK(lens_p[s] <= max_blocks * block_size, "sequence length outside its table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens_p[s] - rows - window + 1) : 0;
    for (int64_t b = lo / block_size; b < (lens_p[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables_p[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id outside the cache");
    }
  }
}

template <typename T, typename C>
void run_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const c10::Half* ks, const c10::Half* vs, const at::Tensor& tables, const at::Tensor& lens,
                const at::Tensor& starts, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = tables.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = tables.size(1);
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* starts_p = starts.data_ptr<int64_t>();
  const int64_t* tables_p = tables.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  T* op = out.data_ptr<T>();
  if constexpr (std::is_same<T, C>::value) {
    bool decode = true;
    for (int64_t s = 0; s < num_seqs && decode; ++s) decode = starts_p[s + 1] - starts_p[s] == 1;
    if (decode) {
      const float sc = static_cast<float>(scale);
      if (d == 64)
        run_decode_spans<T, 64>(qp, kp, vp, tables_p, lens_p, num_seqs, max_blocks, num_heads, num_kv_heads, d,
                                num_blocks, block_size, window, sc, op);
      else if (d == 128)
        run_decode_spans<T, 128>(qp, kp, vp, tables_p, lens_p, num_seqs, max_blocks, num_heads, num_kv_heads, d,
                                 num_blocks, block_size, window, sc, op);
      else
        run_decode_spans<T, 0>(qp, kp, vp, tables_p, lens_p, num_seqs, max_blocks, num_heads, num_kv_heads, d,
                               num_blocks, block_size, window, sc, op);
      return;
    }
  }
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t offset = (starts_p[s] * num_heads + h * group) * d;
      const int64_t rows = starts_p[s + 1] - starts_p[s];
      const float sc = static_cast<float>(scale);
      const int64_t* table = tables_p + s * max_blocks;
      if (d == 64)
        attend_task<T, C, 64>(qp + offset, kp, vp, ks, vs, table, lens_p[s], rows, num_heads, h, group, d,
                              num_blocks, block_size, window, sc, op + offset, buf);
      else if (d == 128)
        attend_task<T, C, 128>(qp + offset, kp, vp, ks, vs, table, lens_p[s], rows, num_heads, h, group, d,
                               num_blocks, block_size, window, sc, op + offset, buf);
      else
        attend_task<T, C, 0>(qp + offset, kp, vp, ks, vs, table, lens_p[s], rows, num_heads, h, group, d,
                             num_blocks, block_size, window, sc, op + offset, buf);
    }
  });
}

}  // namespace

// Caches in q's dtype; window 0: full attention.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens,
                                     at::Tensor query_start, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_start.contiguous();
  check_decode_args(q, k_cache, v_cache, tables, lens, starts, window);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    run_decode<scalar_t, scalar_t>(q, k_cache, v_cache, nullptr, nullptr, tables, lens, starts, scale, window, out);
  });
  return out;
}

// int8 caches with float16 scales (num_kv_heads, num_blocks, block_size) for keys and values.
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                          at::Tensor k_scale, at::Tensor v_scale, at::Tensor block_tables,
                                          at::Tensor seq_lens, at::Tensor query_start, double scale,
                                          int64_t window) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar, "int8 caches");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf, "float16 scales");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.dim() == 3 &&
                  k_scale.size(0) == k_cache.size(0) && k_scale.size(1) == k_cache.size(1) &&
                  k_scale.size(2) == k_cache.size(2) && v_scale.sizes() == k_scale.sizes(), "scale shapes");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_start.contiguous();
  check_decode_args(q, k_cache, v_cache, tables, lens, starts, window);
  auto out = at::empty_like(q);
  const c10::Half* ks = k_scale.data_ptr<c10::Half>();
  const c10::Half* vs = v_scale.data_ptr<c10::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_int8", [&] {
    run_decode<scalar_t, int8_t>(q, k_cache, v_cache, ks, vs, tables, lens, starts, scale, window, out);
  });
  return out;
}

// RMSNorm over the rows of x (T, H), as the Hugging Face reference computes it: in float32,
// x * rsqrt(mean(x^2) + eps), rounded to x's dtype, then times the weight (rounded again). At decode, a
// step of a 135M model norms 61 rows of 576: PyTorch's op spent ~18 us on each (casts, pow, mean, rsqrt,
// two muls as separate kernels), here ~1 us.
// One row; add_rms_norm shares it, so a fused norm sums in the same order and rounds the same.
template <typename T>
inline void rms_norm_row(const T* xr, const T* w, T* o, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    const T normed = static_cast<T>(to_float(xr[i]) * inv);
    o[i] = static_cast<T>(to_float(w[i]) * to_float(normed));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * h, w, out + r * h, h, eps);
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm takes contiguous (T, H) rows and an (H,) weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
  return out;
}

// Int4 weights dequantized straight from torch's CPU int4 pack (_convert_weight_to_int4pack_for_cpu), so a
// quantized layer keeps one copy of its codes: the packed kernel's, read by decode steps and, through this,
// by large steps, which multiply by the dense weight. The pack is blocks of `block_n` output rows, each
// (K, nb / 2) bytes (nb = the block's rows: block_n, or fewer for the last); byte j of a block's k-th line
// holds two rows' codes at input k:
//     halves   low nibble row j, high nibble row j + nb / 2   (full blocks on AVX-512 and AVX2)
//     pairs    low nibble row 2j, high nibble row 2j + 1       (the last, partial block; non-vector builds)
// layers/quant.py probes which one this torch uses. scales_and_zeros (K / g, N, 2): w = (q - 8) * s + z, in
// float32 as the packed kernel computes it, rounded once to bfloat16. `planes`: the pack holds two planes
// side by side along K (Q8_0 as 16d * hi + d * lo); their sum, rounded once, is the weight. Returns W^T
// (K_out, N): each block's rows are contiguous along a line of W^T, so the writes stream.

// float -> bfloat16 bits, rounded to nearest even, for finite values (no NaN branch, so loops vectorize).
inline uint16_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One line of a block (nb rows at one input), in row order: acc[r] (+)= (q - 8) * scale[r] + zero[r].
inline void dequantize_line(const uint8_t* line, const float* scale, const float* zero, int64_t nb, bool halves,
                            bool add, float* acc) {
  const int64_t half = nb / 2;
  if (halves) {
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float lo = static_cast<float>((line[j] & 0x0F) - 8) * scale[j] + zero[j];
      const float hi = static_cast<float>((line[j] >> 4) - 8) * scale[j + half] + zero[j + half];
      acc[j] = add ? acc[j] + lo : lo;
      acc[j + half] = add ? acc[j + half] + hi : hi;
    }
  } else {
    for (int64_t j = 0; j < half; ++j) {
      const float lo = static_cast<float>((line[j] & 0x0F) - 8) * scale[2 * j] + zero[2 * j];
      const float hi = static_cast<float>((line[j] >> 4) - 8) * scale[2 * j + 1] + zero[2 * j + 1];
      acc[2 * j] = add ? acc[2 * j] + lo : lo;
      acc[2 * j + 1] = add ? acc[2 * j + 1] + hi : hi;
    }
  }
}

at::Tensor int4pack_dequantize_t(at::Tensor packed, at::Tensor scales_and_zeros, int64_t group_size,
                                    int64_t block_n, bool full_halves, bool planes) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4pack_dequantize_t: packed must be contiguous (N, K/2) uint8");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, k_out = planes ? k / 2 : k;
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) * group_size == k &&
                  scales_and_zeros.size(1) == n && scales_and_zeros.size(2) == 2,
              "int4pack_dequantize_t: scales_and_zeros must be contiguous (K/g, N, 2) bfloat16");
  TORCH_CHECK(block_n > 0 && block_n % 2 == 0 && n % 2 == 0 && k_out % group_size == 0,
              "int4pack_dequantize_t: bad block or group size");
  auto out = at::empty({k_out, n}, packed.options().dtype(at::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const c10::BFloat16* sz = scales_and_zeros.data_ptr<c10::BFloat16>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t num_blocks = (n + block_n - 1) / block_n, num_groups = k_out / group_size;
  const int64_t num_planes = planes ? 2 : 1, plane_groups = num_groups;  // plane p's groups start at p * it
  at::parallel_for(0, num_blocks * num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(2 * block_n), zero(2 * block_n), acc(block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_groups, grp = task % num_groups;
      const int64_t n0 = b * block_n, nb = std::min(block_n, n - n0);
      const bool halves = full_halves && nb == block_n;
      for (int64_t p = 0; p < num_planes; ++p) {
        for (int64_t r = 0; r < nb; ++r) {
          const c10::BFloat16* s = sz + ((grp + p * plane_groups) * n + n0 + r) * 2;
          scale[p * block_n + r] = static_cast<float>(s[0]);
          zero[p * block_n + r] = static_cast<float>(s[1]);
        }
      }
      for (int64_t kk = grp * group_size; kk < (grp + 1) * group_size; ++kk) {
        for (int64_t p = 0; p < num_planes; ++p) {
          const uint8_t* line = src + n0 * k / 2 + (kk + p * k_out) * (nb / 2);
          dequantize_line(line, &scale[p * block_n], &zero[p * block_n], nb, halves, p > 0, acc.data());
        }
        uint16_t* o = dst + kk * n + n0;
#pragma omp simd
        for (int64_t r = 0; r < nb; ++r) o[r] = bf16_bits(acc[r]);
      }
    }
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------------
// The small ops between a decoder layer's matmuls, fused: a decode token of the bundled model ran ~35
// PyTorch ops a layer besides its four matmuls (norms, the rotation's chunk/mul/sub/cat, two index_copy_ KV
// writes, splits, views, SiLU, mul, residual adds) at 1-3 us each, ~2.7 ms of a 9.5 ms token on one core.
// Each keeps the reference's rounding: every op's result is rounded to the model's dtype where PyTorch's
// would be, so a fused layer computes what the unfused one did.

// x += delta (rounded to x's dtype), then RMSNorm of the sum into out: the residual add and the next norm.
// One row of the residual stream: x += delta, rounded to x's dtype.
template <typename T>
inline void add_row(T* x, const T* delta, int64_t h) {
  for (int64_t i = 0; i < h; ++i) x[i] = static_cast<T>(to_float(x[i]) + to_float(delta[i]));
}

template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_row(x + r * h, delta + r * h, h);
      rms_norm_row(x + r * h, w, out + r * h, h, eps);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "add_rms_norm takes contiguous (T, H) x and delta and an (H,) weight");
  TORCH_CHECK(x.scalar_type() == delta.scalar_type() && x.scalar_type() == weight.scalar_type(), "dtypes");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// x / (1 + exp(-x)) in place over n floats, one glibc expf at a time: a compiler-vectorized expf (libmvec, under
// -ffast-math) differs from PyTorch's in the last bit of a few bf16 results in 10^4, and the scalar expf has
// matched it (tests/layers/test_fused_ops.py).
__attribute__((optimize("no-tree-vectorize"))) void silu_inplace(float* act, int64_t n) {
  for (int64_t c = 0; c < n; ++c) act[c] = act[c] / (1.f + std::exp(-act[c]));
}

// gate_up (T, 2I) -> silu(gate) * up (T, I), SiLU in float32 rounded, then the product rounded (as F.silu, *).
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul takes contiguous (T, 2I)");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Row by row in contiguous runs (the conversions vectorize; no integer division per element): a decode row of
    // 1536 took 16 us, now 9 (1 thread, AMD EPYC Zen 4); 64 rows 463 us, now 238.
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(inner, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = gu + r * 2 * inner;
        const scalar_t* u = g + inner;
        scalar_t* out_row = o + r * inner;
        alignas(64) float act[256];
        for (int64_t c0 = 0; c0 < inner; c0 += 256) {
          const int64_t n = std::min<int64_t>(256, inner - c0);
          for (int64_t c = 0; c < n; ++c) act[c] = to_float(g[c0 + c]);
          silu_inplace(act, n);
          for (int64_t c = 0; c < n; ++c)
            out_row[c0 + c] = static_cast<scalar_t>(to_float(static_cast<scalar_t>(act[c])) * to_float(u[c0 + c]));
        }
      }
    });
  });
  return out;
}

// RoPE (rotate-half) on the query and key heads of a fused qkv (T, (nh + 2 nkv) d), the rotated keys and the
// values written into the paged cache at their slots. cos/sin: the float32 tables (P, d/2), rounded to the
// model's dtype as Rotary.forward does; each product and the sum rounded as apply_rope's ops round them.
// Returns the rotated queries and keys (T, nh + nkv, d), contiguous.
// One head of d = 2 * half values rotated by the tables' row (ct, st) into o.
template <typename T>
inline void rope_head(const T* x, const float* ct, const float* st, int64_t half, T* o) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = to_float(static_cast<T>(ct[i])), s = to_float(static_cast<T>(st[i]));
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    o[i] = static_cast<T>(to_float(static_cast<T>(x1 * c)) - to_float(static_cast<T>(x2 * s)));
    o[i + half] = static_cast<T>(to_float(static_cast<T>(x2 * c)) + to_float(static_cast<T>(x1 * s)));
  }
}

template <typename T>
void rope_write_rows(const T* qkv, const int64_t* pos, const float* cos, const float* sin, T* qk, T* k_cache,
                     T* v_cache, const int64_t* slots, int64_t rows, int64_t nh, int64_t nkv, int64_t d,
                     int64_t cache_slots) {
  const int64_t half = d / 2, width = (nh + 2 * nkv) * d;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const float* ct = cos + pos[t] * half;
      const float* st = sin + pos[t] * half;
      T* out = qk + t * (nh + nkv) * d;
      for (int64_t h = 0; h < nh + nkv; ++h) rope_head(row + h * d, ct, st, half, out + h * d);
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < nkv; ++h) {
        std::memcpy(k_cache + (h * cache_slots + slot) * d, out + (nh + h) * d, d * sizeof(T));
        std::memcpy(v_cache + (h * cache_slots + slot) * d, row + (nh + nkv + h) * d, d * sizeof(T));
      }
    }
  });
}

// rope_write_kv's checks: float32 (P, d/2) tables, and one position inside them and one slot inside the cache
// (of cache_slots) a row.
void check_rope_args(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos, const at::Tensor& sl,
                     int64_t rows, int64_t d, int64_t cache_slots) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d / 2 && sin.sizes() == cos.sizes(),
              "rope_write_kv: float32 (P, d/2) tables");
  TORCH_CHECK(pos.scalar_type() == at::kLong && sl.scalar_type() == at::kLong && pos.numel() == rows &&
                  sl.numel() == rows && pos.is_contiguous() && sl.is_contiguous(),
              "rope_write_kv: one long position and slot per row");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rope_write_kv: position outside the tables");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache_slots, "rope_write_kv: slot outside the cache");
  }
}

at::Tensor rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                            at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, int64_t num_heads,
                            int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(), "rope_write_kv: shapes");
  const int64_t rows = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && k_cache.size(0) == num_kv_heads && d % 2 == 0,
              "rope_write_kv: qkv must be (T, (nh + 2 nkv) d)");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: a cache in the model's dtype");
  auto pos = positions.contiguous();
  auto sl = slots.contiguous();
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  check_rope_args(cos, sin, pos, sl, rows, d, cache_slots);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  auto qk = at::empty({rows, num_heads + num_kv_heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_rows<scalar_t>(qkv.data_ptr<scalar_t>(), pp, cos.data_ptr<float>(), sin.data_ptr<float>(),
                              qk.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              sp, rows, num_heads, num_kv_heads, d, cache_slots);
  });
  return qk;
}

// A decode section's attention in one call: RoPE and the KV write (rope_write_kv), then the paged kernel on
// the rotated queries. Returns (T, nh * d).
at::Tensor rope_decode_attention(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                                    at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                                    at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                                    at::Tensor query_start, int64_t num_heads, int64_t num_kv_heads, double scale,
                                    int64_t window) {
  auto qk = rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  auto q = qk.narrow(1, 0, num_heads);
  if (!q.is_contiguous()) q = q.contiguous();
  auto out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window);
  return out.view({qkv.size(0), num_heads * k_cache.size(3)});
}

// ---------------------------------------------------------------------------------------------------------
// Quantized weights against int8-quantized activations, for steps of a few rows (decode): the scheme of
// llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products. torch's int4 kernel (_weight_int4pack_mm_for_cpu)
// widens every code to float32 and spends ~3 vector ops a weight, so a single-stream decode step of the bundled
// model was bound by those instructions, not by memory; here one VNNI instruction multiplies and adds 64 codes
// by 64 activations in integers.
//
// Activations: each row's K inputs in blocks of 32, each block scaled to int8 by its own absolute maximum
// (q = round(x * 127 / amax), d = amax / 127), and the sum of its rounded values d * sum(q) kept: the int4
// minimum multiplies it, the int8 codes' +128 offset is cancelled by it. So the result is exactly w . x' for x'
// the rounded activations, whose error scales with w (an exact sum instead would leave it scaling with
// q * scale = w - min, measured 2x the error on Gaussian weights).
// Weights, per output row, in blocks of 32 inputs with float16 scales (and minimums for int4):
//     int4  codes (N, K/2) uint8: a block's byte j holds code j (low nibble) and code j + 16 (high), GGUF's
//           Q4_1 order; w = q * scale + min, q in [0, 15]
//     int8  codes (N, K) uint8: q + 128, so that they are the unsigned operand; w = q * scale, q in [-128, 127]
// y[m, n] = sum_b (scale[n, b] * d[m, b] * sum_i code[n, b, i] * xq[m, b, i] + min'[n, b] * xs[m, b]), in float32,
// rounded once to x's dtype. The AVX-512 VNNI path takes two blocks (64 codes) per instruction; other builds run
// the same arithmetic in plain loops (layers/quant.py uses this kernel only where the fast path was compiled).

constexpr int64_t QBLOCK = 32;

bool q8act_fast_path() {
#ifdef TF_Q8ACT_VNNI
  return true;
#else
  return false;
#endif
}

// Blocks [b0, b1) of one row of activations quantized (b0 even: a pair of int4 blocks is never split). int4
// order: for each pair of blocks (2p, 2p + 1) 64 bytes, the first 16 values of each block, then the last 16 of
// each, matching the nibbles of 32 code bytes split low | high.
template <typename T>
void quantize_blocks(const T* x, int64_t b0, int64_t b1, int64_t nb, bool q4, int8_t* xq, float* d, float* xs) {
  for (int64_t b = b0; b < b1; ++b) {
    float v[QBLOCK];
    float amax = 0.f;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      v[i] = to_float(x[b * QBLOCK + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t q[QBLOCK];
    int32_t qsum = 0;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      qsum += q[i];
    }
    d[b] = amax / 127.f;
    xs[b] = (q4 ? 1.f : -128.f) * d[b] * static_cast<float>(qsum);
    if (q4 && nb % 2 == 0) {
      int8_t* pair = xq + (b / 2) * 2 * QBLOCK;
      const int64_t half = b % 2;
      std::memcpy(pair + half * 16, q, 16);
      std::memcpy(pair + QBLOCK + half * 16, q + 16, 16);
    } else {
      std::memcpy(xq + b * QBLOCK, q, QBLOCK);
    }
  }
}

// One row of activations quantized (K values, K / 32 blocks).
template <typename T>
void quantize_row(const T* x, int64_t k, bool q4, int8_t* xq, float* d, float* xs) {
  quantize_blocks(x, 0, k / QBLOCK, k / QBLOCK, q4, xq, d, xs);
}

// Plain loops: any build (the reference the fast path is tested against, through the same entry point).
void q8act_rows_plain(const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, bool q4, int64_t n0,
                      int64_t n1, int64_t k, const int8_t* xq, const float* d, const float* xs, float* out) {
  const int64_t nb = k / QBLOCK, row_bytes = q4 ? k / 2 : k;
  for (int64_t r = n0; r < n1; ++r) {
    const uint8_t* c = codes + r * row_bytes;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t dot = 0;
      for (int64_t i = 0; i < QBLOCK; ++i) {
        int32_t code, x;
        if (q4) {
          const int64_t j = i % 16, byte = c[b * 16 + j];
          code = i < 16 ? (byte & 0x0F) : (byte >> 4);
          // xq's int4 order (pairs of blocks): see quantize_row
          x = nb % 2 == 0 ? xq[(b / 2) * 64 + (i / 16) * 32 + (b % 2) * 16 + j] : xq[b * QBLOCK + i];
        } else {
          code = c[b * QBLOCK + i];
          x = xq[b * QBLOCK + i];
        }
        dot += code * x;
      }
      const float s = static_cast<float>(scales[r * nb + b]);
      acc += s * d[b] * static_cast<float>(dot) + (q4 ? static_cast<float>(mins[r * nb + b]) : s) * xs[b];
    }
    out[r] = acc;
  }
}

#ifdef TF_Q8ACT_VNNI
// R output rows from r0 against MR activation rows from m0: per 16-block chunk, each (row, activation row)'s
// scales times d; per pair of blocks, each weight row's codes widened once and multiplied by every activation row
// (so a few rows cost little more than one), into R * MR independent accumulators (which hide the FMA latency).
template <bool Q4, int R, int MR>
inline void q8act_tile_vnni(const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, int64_t r0,
                            int64_t n, int64_t k, const int8_t* xq, const float* d, const float* xs,
                            const __m512i* idx, float* out) {
  const int64_t nb = k / QBLOCK, row_bytes = Q4 ? k / 2 : k;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[R][MR];
  for (int t = 0; t < R; ++t)
    for (int j = 0; j < MR; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += 16) {
    const int cb = static_cast<int>(std::min<int64_t>(16, nb - c0));
    const __mmask16 mask = static_cast<__mmask16>((1u << cb) - 1u);
    __m512 sd[R][MR];
    for (int t = 0; t < R; ++t) {
      const int64_t at = (r0 + t) * nb + c0;
      const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + at));
      const __m512 mn = Q4 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + at)) : s;
      for (int j = 0; j < MR; ++j) {
        sd[t][j] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, d + j * nb + c0));
        acc[t][j] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(mask, xs + j * nb + c0), acc[t][j]);
      }
    }
    for (int p = 0; p < cb / 2; ++p) {
      __m512i xv[MR];
      for (int j = 0; j < MR; ++j) xv[j] = _mm512_loadu_si512(xq + j * k + (c0 + 2 * p) * QBLOCK);
      for (int t = 0; t < R; ++t) {
        __m512i w;
        // The rows a few tiles on: a GEMV streams its weights once, and the hardware prefetcher alone kept ~6 GB/s
        // in flight on one core where a plain sum reads 12.
        _mm_prefetch(reinterpret_cast<const char*>(codes + (r0 + t + 4 * R) * row_bytes + (c0 + 2 * p) * 64 /
                                                   (Q4 ? 2 : 1)), _MM_HINT_T0);
        if constexpr (Q4) {
          const __m256i c = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(codes + (r0 + t) * row_bytes + (c0 + 2 * p) * 16));
          const __m256i lo = _mm256_and_si256(c, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
          w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
          w = _mm512_loadu_si512(codes + (r0 + t) * row_bytes + (c0 + 2 * p) * QBLOCK);
        }
        for (int j = 0; j < MR; ++j) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[j]);
          acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx[p], sd[t][j]), acc[t][j]);
        }
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int j = 0; j < MR; ++j) out[j * n + r0 + t] = _mm512_reduce_add_ps(acc[t][j]);
}

// Output rows [n0, n1) of activation rows [m0, m0 + MR): R at a time, the rest one by one.
template <bool Q4, int R, int MR>
void q8act_rows_vnni(const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, int64_t n0, int64_t n1,
                     int64_t n, int64_t k, const int8_t* xq, const float* d, const float* xs, const __m512i* idx,
                     float* out) {
  int64_t r = n0;
  for (; r + R <= n1; r += R) q8act_tile_vnni<Q4, R, MR>(codes, scales, mins, r, n, k, xq, d, xs, idx, out);
  for (; r < n1; ++r) q8act_tile_vnni<Q4, 1, MR>(codes, scales, mins, r, n, k, xq, d, xs, idx, out);
}

// Every activation row: four at a time (two weight rows a tile), then the rest (1 to 3).
template <bool Q4>
void q8act_vnni(const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, int64_t n0, int64_t n1,
                int64_t n, int64_t m, int64_t k, const int8_t* xq, const float* d, const float* xs, float* out) {
  __m512i idx[8];  // lane -> the block of the chunk whose scale it takes, for pair p
  for (int p = 0; p < 8; ++p) {
    alignas(64) int32_t lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = 2 * p + (Q4 ? (i >> 2) & 1 : i >> 3);
    idx[p] = _mm512_load_si512(lanes);
  }
  const int64_t nb = k / QBLOCK;
  int64_t j = 0;
  for (; j + 4 <= m; j += 4)
    q8act_rows_vnni<Q4, 2, 4>(codes, scales, mins, n0, n1, n, k, xq + j * k, d + j * nb, xs + j * nb, idx,
                              out + j * n);
  const int64_t rest = m - j;
  const int8_t* xr = xq + j * k;
  float* o = out + j * n;
  if (rest == 3) q8act_rows_vnni<Q4, 2, 3>(codes, scales, mins, n0, n1, n, k, xr, d + j * nb, xs + j * nb, idx, o);
  if (rest == 2) q8act_rows_vnni<Q4, 2, 2>(codes, scales, mins, n0, n1, n, k, xr, d + j * nb, xs + j * nb, idx, o);
  if (rest == 1) q8act_rows_vnni<Q4, 4, 1>(codes, scales, mins, n0, n1, n, k, xr, d + j * nb, xs + j * nb, idx, o);
}
#endif

// One int8-activation linear layer's weights (see above); bias: nullptr for none, else (N,) in the activations'
// dtype, added to the rounded product and rounded again (as `y + bias`).
struct Q8Weights {
  const uint8_t* codes;
  const c10::Half *scales, *mins;
  const void* bias;
  bool q4, vnni;
};

// A layer's output rows go to threads in units of 16 (whole tiles), each thread's as one contiguous run: a 576-row
// layer splits 288 / 288 over 2 threads, where units of 64 split it 320 / 256 (the slower thread sets its time).
constexpr int64_t Q8_UNIT = 16;
inline int64_t q8act_units(int64_t n) { return (n + Q8_UNIT - 1) / Q8_UNIT; }

// Output columns [n0, n1) of every activation row (xq, dx, xs from quantize_row) into acc (M, N) float32, then
// rounded into out (M, N): each thread rounds its own columns (one pass on the calling thread after the join was
// a serial stretch of every call, the other threads waiting).
template <typename T>
void q8act_columns(const Q8Weights& w, int64_t n0, int64_t n1, int64_t n, int64_t m, int64_t k, const int8_t* xq,
                   const float* dx, const float* xs, float* acc, T* out) {
  if (n0 >= n1) return;
  const int64_t nb = k / QBLOCK;
#ifdef TF_Q8ACT_VNNI
  if (w.vnni) {
    (w.q4 ? q8act_vnni<true> : q8act_vnni<false>)(w.codes, w.scales, w.mins, n0, n1, n, m, k, xq, dx, xs, acc);
  } else
#endif
  {
    for (int64_t r = 0; r < m; ++r)
      q8act_rows_plain(w.codes, w.scales, w.mins, w.q4, n0, n1, k, xq + r * k, dx + r * nb, xs + r * nb,
                       acc + r * n);
  }
  const T* bias = static_cast<const T*>(w.bias);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = n0; i < n1; ++i) {
      const T y = static_cast<T>(acc[r * n + i]);
      out[r * n + i] = bias ? static_cast<T>(to_float(y) + to_float(bias[i])) : y;
    }
}

// x (M, K) float32 / bfloat16 / float16 -> (M, N) in x's dtype. `mins` is ignored for int8 codes.
at::Tensor q8act_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                           bool q4, bool fast) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "q8act_linear: x must be contiguous (M, K)");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), nb = k / QBLOCK;
  TORCH_CHECK(k % QBLOCK == 0 && codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == (q4 ? k / 2 : k),
              "q8act_linear: codes must be contiguous (N, K/2) (int4) or (N, K) (int8) uint8, K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == nb, "q8act_linear: scales must be (N, K/32) float16");
  TORCH_CHECK(!q4 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.sizes() == scales.sizes()),
              "q8act_linear: int4 codes need (N, K/32) float16 minimums");
  const bool vnni = fast && q8act_fast_path() && nb % 2 == 0;
  // Scratch kept by the calling thread between calls: a decode step makes ~120 of them, and four tensors
  // allocated each time cost more than a small layer's arithmetic (measured ~10 us a call).
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dx_buf, xs_buf, acc_buf;
  xq_buf.resize(m * k);
  dx_buf.resize(m * nb);
  xs_buf.resize(m * nb);
  acc_buf.resize(m * n);
  int8_t* xq = xq_buf.data();
  float *dx = dx_buf.data(), *xs = xs_buf.data(), *acc = acc_buf.data();
  auto out = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8act_quantize", [&] {
    for (int64_t r = 0; r < m; ++r)
      quantize_row<scalar_t>(x.data_ptr<scalar_t>() + r * k, k, q4, xq + r * k, dx + r * nb, xs + r * nb);
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8act_out", [&] {
    const Q8Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
                      q4 ? mins.data_ptr<c10::Half>() : nullptr, nullptr, q4, vnni};
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, q8act_units(n), 1, [&](int64_t begin, int64_t end) {
      q8act_columns<scalar_t>(w, begin * Q8_UNIT, std::min(n, end * Q8_UNIT), n, m, k, xq, dx, xs, acc, o);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
at::Tensor prepacked_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                 c10::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// DecodePlan's one parallel region (cpu_kernels.h). Op by op, a one-row decode token of the bundled model forked
// and joined the threads ~150 times and allocated ~200 tensors, and each op checked its arguments again; here the
// checks run once, the scratch is kept by the calling thread, and the team meets at barriers. Serial work stays
// serial where it was (a row's norm and quantization, its rotation) and is spread over rows where a step has
// several; SiLU·mul and the down layer's quantization are spread over a row's pairs of blocks.

namespace {

// Whether the region can run this linear layer: an int8-activation kernel's contiguous codes, scales (and minimums)
// and bias, its input a whole number of pairs of blocks.
bool region_takes(const PlanLinear& p) {
  const int64_t k = p.in_features(), blocks = p.w.size(0) * (k / QBLOCK);
  return p.kind != 0 && k % (2 * QBLOCK) == 0 && p.w.is_contiguous() && p.scales.is_contiguous() &&
         p.scales.numel() == blocks && (p.kind != 1 || (p.mins.is_contiguous() && p.mins.numel() == blocks)) &&
         (!p.bias.numel() || (p.bias.scalar_type() == at::kBFloat16 && p.bias.is_contiguous() &&
                              p.bias.numel() == p.w.size(0)));
}

}  // namespace

bool DecodePlan::region_possible() const {
#if defined(_OPENMP) && defined(TF_Q8ACT_VNNI)
  if (layers_.empty()) return false;
  const auto& cache = layers_[0].k_cache;
  for (const PlanLayer& l : layers_) {
    if (l.k_cache.sizes() != cache.sizes() || l.v_cache.sizes() != cache.sizes() || !l.k_cache.is_contiguous() ||
        !l.v_cache.is_contiguous() || l.k_cache.scalar_type() != at::kBFloat16 ||
        l.v_cache.scalar_type() != at::kBFloat16 || !l.input_norm.is_contiguous() || !l.post_norm.is_contiguous() ||
        l.input_norm.scalar_type() != at::kBFloat16 || l.post_norm.scalar_type() != at::kBFloat16)
      return false;
    const int64_t h = l.input_norm.numel(), inner = l.down.in_features();
    const int64_t heads = nh_ * cache.size(3);
    if (l.post_norm.numel() != h || l.qkv.w.size(0) != heads + 2 * nkv_ * cache.size(3) ||
        l.qkv.in_features() != h || l.o.w.size(0) != h || l.o.in_features() != heads ||
        l.gate_up.w.size(0) != 2 * inner || l.gate_up.in_features() != h || l.down.w.size(0) != h)
      return false;
    for (const PlanLinear* p : {&l.qkv, &l.o, &l.gate_up, &l.down})
      if (!region_takes(*p)) return false;
  }
  return cache.dim() == 4 && cache.size(0) == nkv_ && cache.size(3) % 2 == 0;
#else
  return false;
#endif
}

#if defined(_OPENMP) && defined(TF_Q8ACT_VNNI)
namespace {

using bf16 = c10::BFloat16;

// One linear layer of the region: its weights and shapes.
struct RegionLinear {
  Q8Weights w;
  int64_t n, k;
};

RegionLinear region_linear(const PlanLinear& p) {
  const bool q4 = p.kind == 1;
  return {{p.w.data_ptr<uint8_t>(), p.scales.data_ptr<c10::Half>(), q4 ? p.mins.data_ptr<c10::Half>() : nullptr,
           p.bias.numel() ? p.bias.data_ptr<bf16>() : nullptr, q4, true},
          p.w.size(0), p.in_features()};
}

// [begin, end) of `total` items for thread `tid` of `team`, in equal contiguous shares.
inline void share(int64_t total, int64_t tid, int64_t team, int64_t& begin, int64_t& end) {
  begin = total * tid / team;
  end = total * (tid + 1) / team;
}

// The activations of the next linear layer, quantized: a thread's rows of (rows, k) values.
struct Quantized {
  int8_t* xq;
  float *d, *xs;
  void row(const bf16* x, int64_t r, int64_t k, bool q4) const {
    const int64_t nb = k / QBLOCK;
    quantize_row(x, k, q4, xq + r * k, d + r * nb, xs + r * nb);
  }
};

// A thread's share of one linear layer over the quantized rows: whole units of output columns, rounded into out.
inline void region_matmul(const RegionLinear& l, int64_t rows, const Quantized& in, float* acc, bf16* out,
                          int64_t tid, int64_t team) {
  int64_t u0, u1;
  share(q8act_units(l.n), tid, team, u0, u1);
  q8act_columns<bf16>(l.w, u0 * Q8_UNIT, std::min(l.n, u1 * Q8_UNIT), l.n, rows, l.k, in.xq, in.d, in.xs, acc,
                      out);
}

// A thread's columns [c0, c1) of one row of the head's output: widened to float32 into dst, and the first largest of
// them (the first NaN where there is one: NaN beats every number in torch's `max`). index -1: no columns.
struct RowMax {
  float value;
  int64_t index;
  bool nan;
};

inline RowMax widen_first_max(const bf16* src, float* dst, int64_t c0, int64_t c1) {
  if (c0 >= c1) return {0.f, -1, false};
  float m = -INFINITY;
  uint16_t top = 0;  // the largest magnitude's bits: above 0x7F80 is a NaN (the bits, since -ffast-math assumes none)
#pragma omp simd reduction(max : m, top)
  for (int64_t c = c0; c < c1; ++c) {
    const float v = to_float(src[c]);
    dst[c] = v;
    m = std::max(m, v);
    top = std::max<uint16_t>(top, src[c].x & 0x7FFF);
  }
  const bool nan = top > 0x7F80;
  for (int64_t c = c0; c < c1; ++c)
    if (nan ? (src[c].x & 0x7FFF) > 0x7F80 : dst[c] == m) return {dst[c], c, nan};
  return {m, c0, nan};  // not reached: m is one of the values
}

// One row's first max over the threads' parts (stride apart), thread t's columns before thread t + 1's.
inline int64_t merge_first_max(const RowMax* parts, int64_t stride, int64_t team) {
  const RowMax* best = nullptr;
  for (int64_t t = 0; t < team; ++t) {
    const RowMax& p = parts[t * stride];
    if (p.index >= 0 && (best == nullptr || (p.nan && !best->nan) || (!p.nan && !best->nan && p.value > best->value)))
      best = &p;
  }
  return best->index;
}

}  // namespace
#endif

// Where run_logits writes: logits (T, V) float32 and each row's first max (T,).
struct DecodePlan::HeadOut {
  float* logits;
  int64_t* first;
};

bool DecodePlan::set_head(at::Tensor embed, at::Tensor norm, const std::vector<at::Tensor>& t, int64_t kind,
                          int64_t packed_rows) {
  TORCH_CHECK(t.size() == 6, "DecodePlan.set_head: a linear layer's 6 tensors (w, scales, mins, bias, dense, "
                             "prepacked)");
  embed_ = final_norm_ = at::Tensor();
  head_ = PlanLinear{kind, t[0], t[1], t[2], t[3], packed_rows, 0, t[4], t[5]};
  const int64_t h = layers_.empty() ? 0 : layers_[0].input_norm.numel();
  if (!region_possible() || (kind != 1 && kind != 2) || packed_rows < 1 || !region_takes(head_) ||
      head_.in_features() != h || norm.numel() != h || !norm.is_contiguous() ||
      norm.scalar_type() != at::kBFloat16 || head_.scales.scalar_type() != at::kHalf ||
      (kind == 1 && head_.mins.scalar_type() != at::kHalf) || embed.dim() != 2 || embed.size(1) != h ||
      !embed.is_contiguous() || embed.scalar_type() != at::kBFloat16)
    return false;
  embed_ = embed, final_norm_ = norm;
  return true;
}

std::tuple<at::Tensor, at::Tensor> DecodePlan::run_logits(at::Tensor ids, at::Tensor positions, at::Tensor cos,
                                                          at::Tensor sin, at::Tensor slots, at::Tensor block_tables,
                                                          at::Tensor seq_lens, at::Tensor query_start) const {
  const int64_t rows = ids.dim() == 1 ? ids.size(0) : 0;
  if (!final_norm_.defined() || !one_region_ || rows < 1 || rows > std::min(region_rows_, head_.packed_rows))
    return {at::Tensor(), at::Tensor()};
  // The embedding's rows, as nn.Embedding copies them (the residual stream the region updates in place).
  TORCH_CHECK(ids.scalar_type() == at::kLong, "DecodePlan.run_logits: ids must be int64");
  const int64_t vocab = embed_.size(0), h = embed_.size(1);
  auto id = ids.contiguous();
  const int64_t* idp = id.data_ptr<int64_t>();
  auto x = at::empty({rows, h}, embed_.options());
  c10::BFloat16 *xp = x.data_ptr<c10::BFloat16>(), *ep = embed_.data_ptr<c10::BFloat16>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_INDEX(idp[r] >= 0 && idp[r] < vocab, "index ", idp[r], " is out of range for an embedding of ", vocab,
                      " rows");
    std::memcpy(xp + r * h, ep + idp[r] * h, h * sizeof(c10::BFloat16));
  }
  auto logits = at::empty({rows, head_.w.size(0)}, x.options().dtype(at::kFloat));
  auto first = at::empty({rows}, x.options().dtype(at::kLong));
  const HeadOut head{logits.data_ptr<float>(), first.data_ptr<int64_t>()};
  if (!run_region(x, positions, cos, sin, slots, block_tables, seq_lens, query_start, &head).defined())
    return {at::Tensor(), at::Tensor()};
  return {logits, first};
}

at::Tensor DecodePlan::run_region(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                  at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                                  at::Tensor query_start, const HeadOut* head) const {
#if defined(_OPENMP) && defined(TF_Q8ACT_VNNI)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "DecodePlan.run: x must be contiguous (T, h) bfloat16");
  const PlanLayer& first = layers_[0];
  const int64_t rows = x.size(0), h = x.size(1), nh = nh_, nkv = nkv_, d = first.k_cache.size(3);
  TORCH_CHECK(h == first.input_norm.numel(), "DecodePlan.run: x must be (T, hidden size)");
  const int64_t num_blocks = first.k_cache.size(1), block_size = first.k_cache.size(2);
  auto pos = positions.contiguous(), sl = slots.contiguous(), tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous(), starts = query_start.contiguous();
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.numel() == rows + 1,
              "DecodePlan.run: query_start must be (S + 1,) int64");
  const int64_t* starts_p = starts.data_ptr<int64_t>();
  for (int64_t s = 0; s <= rows; ++s)
    if (starts_p[s] != s) return at::Tensor();  // not one row a sequence: op by op
  check_rope_args(cos, sin, pos, sl, rows, d, num_blocks * block_size);
  auto q = at::empty({rows, nh, d}, x.options());
  // One span plan a distinct window (every layer's caches have the first's shape: region_possible).
  std::vector<std::pair<int64_t, SpanPlan>> plans;
  const int64_t team_max = at::in_parallel_region() ? 1 : at::get_num_threads();
  for (const PlanLayer& l : layers_) {
    bool seen = false;
    for (const auto& p : plans) seen = seen || p.first == l.window;
    if (seen) continue;
    check_decode_args(q, first.k_cache, first.v_cache, tables, lens, starts, l.window);
    plans.emplace_back(l.window, SpanPlan());
    plans.back().second.build(lens.data_ptr<int64_t>(), rows, nh, nkv, d, l.window, team_max);
  }
  std::vector<std::array<RegionLinear, 4>> lin;
  int64_t max_k = h, max_n = h;
  for (const PlanLayer& l : layers_) {
    lin.push_back({region_linear(l.qkv), region_linear(l.o), region_linear(l.gate_up), region_linear(l.down)});
    for (const RegionLinear& r : lin.back()) max_k = std::max(max_k, r.k), max_n = std::max(max_n, r.n);
  }
  const RegionLinear hl = head != nullptr ? region_linear(head_) : RegionLinear{};
  // Scratch kept by the calling thread between steps (its own: the team uses these pointers, not the names).
  thread_local std::vector<bf16> hidden_buf, wide_buf, attn_buf, delta_buf, act_buf;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dx_buf, xs_buf, acc_buf;
  thread_local std::vector<bf16> head_buf;  // the head's output (rows, V), before widening
  thread_local std::vector<RowMax> parts_buf;  // (team, rows): each thread's first max of each row
  if (head != nullptr) head_buf.resize(rows * hl.n), parts_buf.resize(team_max * rows);
  hidden_buf.resize(rows * h), delta_buf.resize(rows * h), attn_buf.resize(rows * nh * d);
  wide_buf.resize(rows * max_n), act_buf.resize(rows * max_k), xq_buf.resize(rows * max_k);
  dx_buf.resize(rows * max_k / QBLOCK), xs_buf.resize(rows * max_k / QBLOCK);
  acc_buf.resize(rows * std::max(max_n, hl.n));
  bf16 *hidden = hidden_buf.data(), *wide = wide_buf.data(), *attn = attn_buf.data(), *delta = delta_buf.data();
  bf16 *act = act_buf.data(), *head_out = head_buf.data();
  RowMax* parts = parts_buf.data();
  float* acc = acc_buf.data();
  const Quantized in{xq_buf.data(), dx_buf.data(), xs_buf.data()};
  bf16 *xp = x.data_ptr<bf16>(), *qp = q.data_ptr<bf16>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const int64_t* tables_p = tables.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1), half = d / 2, slots_per_head = num_blocks * block_size;
  const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
#pragma omp parallel num_threads(team_max) if (team_max > 1)
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    int64_t r0, r1;
    share(rows, tid, team, r0, r1);
    // This thread's rows: the residual add (`add`), the norm into `hidden`, quantized for the next linear layer.
    auto add_norm_quantize = [&](bool add, const at::Tensor& norm, bool q4) {
      for (int64_t r = r0; r < r1; ++r) {
        if (add) add_row(xp + r * h, delta + r * h, h);
        rms_norm_row(xp + r * h, norm.data_ptr<bf16>(), hidden + r * h, h, eps);
        in.row(hidden + r * h, r, h, q4);
      }
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const PlanLayer& l = layers_[i];
      const RegionLinear &qkv = lin[i][0], &o = lin[i][1], &gate_up = lin[i][2], &down = lin[i][3];
      SpanPlan* plan = nullptr;
      for (auto& p : plans)
        if (p.first == l.window) plan = &p.second;
      // The residual add (after the first layer) and the input norm of this thread's rows, quantized for qkv.
      add_norm_quantize(i > 0, l.input_norm, qkv.w.q4);
#pragma omp barrier
      region_matmul(qkv, rows, in, acc, wide, tid, team);
#pragma omp barrier
      // Rotation: queries into q, keys and values into the caches at the rows' slots.
      bf16 *kc = l.k_cache.data_ptr<bf16>(), *vc = l.v_cache.data_ptr<bf16>();
      for (int64_t r = r0; r < r1; ++r) {
        const bf16* row = wide + r * qkv.n;
        const float *ct = cp + pp[r] * half, *st = snp + pp[r] * half;
        for (int64_t hd = 0; hd < nh; ++hd) rope_head(row + hd * d, ct, st, half, qp + (r * nh + hd) * d);
        for (int64_t hd = 0; hd < nkv; ++hd) {
          rope_head(row + (nh + hd) * d, ct, st, half, kc + (hd * slots_per_head + sp[r]) * d);
          std::memcpy(vc + (hd * slots_per_head + sp[r]) * d, row + (nh + nkv + hd) * d, d * sizeof(bf16));
        }
      }
#pragma omp barrier
      for (int64_t slot = tid; slot < plan->threads; slot += team) {
        if (d == 64)
          plan->run<bf16, 64>(slot, qp, kc, vc, tables_p, max_blocks, nh, num_blocks, block_size, scale);
        else if (d == 128)
          plan->run<bf16, 128>(slot, qp, kc, vc, tables_p, max_blocks, nh, num_blocks, block_size, scale);
        else
          plan->run<bf16, 0>(slot, qp, kc, vc, tables_p, max_blocks, nh, num_blocks, block_size, scale);
      }
#pragma omp barrier
      // Each sequence (one row) merged by the thread that owns its row, and quantized for o.
      plan->merge<bf16>(r0 * nkv, r1 * nkv, nh, attn);
      for (int64_t r = r0; r < r1; ++r) in.row(attn + r * nh * d, r, nh * d, o.w.q4);
#pragma omp barrier
      region_matmul(o, rows, in, acc, delta, tid, team);
#pragma omp barrier
      add_norm_quantize(true, l.post_norm, gate_up.w.q4);
#pragma omp barrier
      region_matmul(gate_up, rows, in, acc, wide, tid, team);
#pragma omp barrier
      // SiLU(gate) · up by pairs of blocks of the down layer's input, each pair quantized where it is made.
      {
        const int64_t inner = down.k, pairs = inner / (2 * QBLOCK), nb = inner / QBLOCK;
        int64_t p0, p1;
        share(rows * pairs, tid, team, p0, p1);
        for (int64_t item = p0; item < p1; ++item) {
          const int64_t r = item / pairs, c0 = (item % pairs) * 2 * QBLOCK;
          const bf16 *g = wide + r * 2 * inner + c0, *u = g + inner;
          bf16* out = act + r * inner;
          float a[2 * QBLOCK];
          for (int64_t c = 0; c < 2 * QBLOCK; ++c) a[c] = to_float(g[c]);
          silu_inplace(a, 2 * QBLOCK);
          for (int64_t c = 0; c < 2 * QBLOCK; ++c)
            out[c0 + c] = static_cast<bf16>(to_float(static_cast<bf16>(a[c])) * to_float(u[c]));
          const int64_t b = c0 / QBLOCK;
          quantize_blocks(out, b, b + 2, nb, down.w.q4, in.xq + r * inner, in.d + r * nb, in.xs + r * nb);
        }
      }
#pragma omp barrier
      region_matmul(down, rows, in, acc, delta, tid, team);
#pragma omp barrier
    }
    for (int64_t r = r0; r < r1; ++r) add_row(xp + r * h, delta + r * h, h);
    if (head != nullptr) {
      // As compute_logits: the final norm of this thread's rows, quantized for the head; the head, each thread
      // widening its own columns (still in its cache) and finding their first max; the rows' maxima merged.
      for (int64_t r = r0; r < r1; ++r) {
        rms_norm_row(xp + r * h, final_norm_.data_ptr<bf16>(), hidden + r * h, h, eps);
        in.row(hidden + r * h, r, h, hl.w.q4);
      }
#pragma omp barrier
      region_matmul(hl, rows, in, acc, head_out, tid, team);
      int64_t u0, u1;
      share(q8act_units(hl.n), tid, team, u0, u1);
      for (int64_t r = 0; r < rows; ++r)
        parts[tid * rows + r] = widen_first_max(head_out + r * hl.n, head->logits + r * hl.n,
                                                std::min(hl.n, u0 * Q8_UNIT), std::min(hl.n, u1 * Q8_UNIT));
#pragma omp barrier
      for (int64_t r = r0; r < r1; ++r) head->first[r] = merge_first_max(parts + r, rows, team);
    }
  }
  return x;
#else
  return at::Tensor();
#endif
}
