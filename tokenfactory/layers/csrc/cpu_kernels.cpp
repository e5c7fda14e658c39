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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

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

// The checks every entry point shares: shapes, index dtypes, and that each sequence's rows and the blocks it
// will read (those from its first window on) lie inside the cache.
void check_decode_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& tables, const torch::Tensor& lens, const torch::Tensor& starts,
                       int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "not contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong &&
                  starts.scalar_type() == torch::kLong, "index dtype");
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
void run_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const c10::Half* ks, const c10::Half* vs, const torch::Tensor& tables, const torch::Tensor& lens,
                const torch::Tensor& starts, double scale, int64_t window, torch::Tensor& out) {
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
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     torch::Tensor query_start, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_start.contiguous();
  check_decode_args(q, k_cache, v_cache, tables, lens, starts, window);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    run_decode<scalar_t, scalar_t>(q, k_cache, v_cache, nullptr, nullptr, tables, lens, starts, scale, window, out);
  });
  return out;
}

// int8 caches with float16 scales (num_kv_heads, num_blocks, block_size) for keys and values.
torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                          torch::Tensor seq_lens, torch::Tensor query_start, double scale,
                                          int64_t window) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kChar && v_cache.scalar_type() == torch::kChar, "int8 caches");
  TORCH_CHECK(k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf, "float16 scales");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.dim() == 3 &&
                  k_scale.size(0) == k_cache.size(0) && k_scale.size(1) == k_cache.size(1) &&
                  k_scale.size(2) == k_cache.size(2) && v_scale.sizes() == k_scale.sizes(), "scale shapes");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_start.contiguous();
  check_decode_args(q, k_cache, v_cache, tables, lens, starts, window);
  auto out = torch::empty_like(q);
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

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm takes contiguous (T, H) rows and an (H,) weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto w = weight.contiguous();
  auto out = torch::empty_like(x);
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

torch::Tensor int4pack_dequantize_t(torch::Tensor packed, torch::Tensor scales_and_zeros, int64_t group_size,
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
  auto out = torch::empty({k_out, n}, packed.options().dtype(at::kBFloat16));
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
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * h;
      const T* dr = delta + r * h;
      for (int64_t i = 0; i < h; ++i) xr[i] = static_cast<T>(to_float(xr[i]) + to_float(dr[i]));
      rms_norm_row(xr, w, out + r * h, h, eps);
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "add_rms_norm takes contiguous (T, H) x and delta and an (H,) weight");
  TORCH_CHECK(x.scalar_type() == delta.scalar_type() && x.scalar_type() == weight.scalar_type(), "dtypes");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up (T, 2I) -> silu(gate) * up (T, I), SiLU in float32 rounded, then the product rounded (as F.silu, *).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul takes contiguous (T, 2I)");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * inner, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / inner, c = i % inner;
        const float g = to_float(gu[r * 2 * inner + c]);
        const scalar_t act = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
        o[i] = static_cast<scalar_t>(to_float(act) * to_float(gu[r * 2 * inner + inner + c]));
      }
    });
  });
  return out;
}

// RoPE (rotate-half) on the query and key heads of a fused qkv (T, (nh + 2 nkv) d), the rotated keys and the
// values written into the paged cache at their slots. cos/sin: the float32 tables (P, d/2), rounded to the
// model's dtype as Rotary.forward does; each product and the sum rounded as apply_rope's ops round them.
// Returns the rotated queries and keys (T, nh + nkv, d), contiguous.
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
      for (int64_t h = 0; h < nh + nkv; ++h) {
        const T* x = row + h * d;
        T* o = out + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float c = to_float(static_cast<T>(ct[i])), s = to_float(static_cast<T>(st[i]));
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          o[i] = static_cast<T>(to_float(static_cast<T>(x1 * c)) - to_float(static_cast<T>(x2 * s)));
          o[i + half] = static_cast<T>(to_float(static_cast<T>(x2 * c)) + to_float(static_cast<T>(x1 * s)));
        }
      }
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < nkv; ++h) {
        std::memcpy(k_cache + (h * cache_slots + slot) * d, out + (nh + h) * d, d * sizeof(T));
        std::memcpy(v_cache + (h * cache_slots + slot) * d, row + (nh + nkv + h) * d, d * sizeof(T));
      }
    }
  });
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads,
                            int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(), "rope_write_kv: shapes");
  const int64_t rows = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && k_cache.size(0) == num_kv_heads && d % 2 == 0,
              "rope_write_kv: qkv must be (T, (nh + 2 nkv) d)");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: a cache in the model's dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d / 2 && sin.sizes() == cos.sizes(),
              "rope_write_kv: float32 (P, d/2) tables");
  auto pos = positions.contiguous();
  auto sl = slots.contiguous();
  TORCH_CHECK(pos.scalar_type() == torch::kLong && sl.scalar_type() == torch::kLong && pos.numel() == rows &&
                  sl.numel() == rows, "rope_write_kv: one long position and slot per row");
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rope_write_kv: position outside the tables");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache_slots, "rope_write_kv: slot outside the cache");
  }
  auto qk = torch::empty({rows, num_heads + num_kv_heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_rows<scalar_t>(qkv.data_ptr<scalar_t>(), pp, cos.data_ptr<float>(), sin.data_ptr<float>(),
                              qk.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              sp, rows, num_heads, num_kv_heads, d, cache_slots);
  });
  return qk;
}

// A decode section's attention in one call: RoPE and the KV write (rope_write_kv), then the paged kernel on
// the rotated queries. Returns (T, nh * d).
torch::Tensor rope_decode_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                    torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                                    torch::Tensor query_start, int64_t num_heads, int64_t num_kv_heads, double scale,
                                    int64_t window) {
  auto qk = rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  auto q = qk.narrow(1, 0, num_heads);
  if (!q.is_contiguous()) q = q.contiguous();
  auto out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window);
  return out.view({qkv.size(0), num_heads * k_cache.size(3)});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL like PyTorch's own ops: the server's event loop runs while the engine thread computes.
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"), py::arg("scale"),
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start"), py::arg("scale"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("int4pack_dequantize_t", &int4pack_dequantize_t, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("rope_decode_attention", &rope_decode_attention, py::call_guard<py::gil_scoped_release>());
}
