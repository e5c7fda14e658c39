// The CPU kernels' interface: what cpu_kernels.cpp defines and bindings.cpp hands to Python. Split from the
// bindings so the kernels' translation unit includes ATen only (~6 s of headers) and the two compile in
// parallel: a first build took 41 s as one file with torch/extension.h on 2 cores, ~21 s split.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

// Decode attention from the paged KV cache (layouts at the top of cpu_kernels.cpp); window 0: full attention.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, at::Tensor query_start, double scale, int64_t window);
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale,
                                       at::Tensor v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                                       at::Tensor query_start, double scale, int64_t window);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor int4pack_dequantize_t(at::Tensor packed, at::Tensor scales_and_zeros, int64_t group_size,
                                 int64_t block_n, bool full_halves, bool planes);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                         at::Tensor v_cache, at::Tensor slots, int64_t num_heads, int64_t num_kv_heads);
at::Tensor rope_decode_attention(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                 at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor block_tables,
                                 at::Tensor seq_lens, at::Tensor query_start, int64_t num_heads,
                                 int64_t num_kv_heads, double scale, int64_t window);
bool q8act_fast_path();
at::Tensor q8act_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, bool q4, bool fast);

// ---------------------------------------------------------------------------------------------------------
// A whole decode step's decoder layers in one call (models/llama.py `DecodePlan`): the same kernels, in the same
// order, with the same rounding as the model's Python forward, which made ~10 Python-level calls a layer (a
// module call, an argument check, a dispatch each: ~2 ms of a ~10 ms single-stream token on 2 cores). Built once
// over the model's tensors; each step passes only what changes (the tokens' embeddings, positions and the
// attention metadata). A linear layer is dense (at::linear on its weight and bias) or an int8-activation kernel's
// codes (q8act_linear, int4 or int8), bias added after it as QuantizedLinear adds it, up to its packed rows and
// past them the layer's own dense path, as QuantizedLinear takes it.

// oneDNN's linear on its prepacked weight (mkldnn::_linear_pointwise, as layers/quant.py `prepacked_linear` calls it).
at::Tensor prepacked_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

struct PlanLinear {
  int64_t kind;  // 0 dense, 1 q8act int4, 2 q8act int8
  at::Tensor w, scales, mins, bias;  // dense: w (N, K); q8act: w the codes. bias: numel 0 for none
  // A q8act layer past `packed_rows` rows takes its dense path, as QuantizedLinear.dense_linear does: oneDNN's
  // prepacked weight up to `prepacked_rows` rows where it has one (an mkldnn tensor), else at::linear on `dense`
  // (numel 0: none, and the plan never gives this layer more than packed_rows rows).
  int64_t packed_rows = 0, prepacked_rows = 0;
  at::Tensor dense, prepacked;

  // K: int4 codes hold two inputs a byte.
  int64_t in_features() const { return w.size(1) * (kind == 1 ? 2 : 1); }

  at::Tensor operator()(const at::Tensor& x) const {
    const auto b = bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
    if (kind == 0) return at::linear(x, w, b);
    if (x.size(0) > packed_rows) {
      if (prepacked.is_mkldnn() && x.size(0) <= prepacked_rows) return prepacked_linear(x.contiguous(), prepacked, b);
      TORCH_CHECK(dense.numel(), "DecodePlan: a packed layer got more rows than its packed kernel takes");
      return at::linear(x, dense, b);
    }
    auto y = q8act_linear(x.is_contiguous() ? x : x.contiguous(), w, scales, mins, kind == 1, true);
    return bias.numel() ? y + bias : y;
  }
};

struct PlanLayer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  PlanLinear qkv, o, gate_up, down;
  int64_t window;
};

class DecodePlan {
 public:
  // Per layer, 28 tensors: input_norm, post_norm, k_cache, v_cache, then (w, scales, mins, bias, dense, prepacked)
  // of qkv, o, gate_up and down; `kinds` and `packed_rows` 4 per layer, `windows` one (0: full attention);
  // `prepacked_rows`: the most rows a prepacked weight takes.
  DecodePlan(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& kinds,
             const std::vector<int64_t>& packed_rows, const std::vector<int64_t>& windows, int64_t num_heads,
             int64_t num_kv_heads, double scale, double eps, int64_t prepacked_rows)
      : nh_(num_heads), nkv_(num_kv_heads), scale_(scale), eps_(eps) {
    const size_t n = windows.size();
    TORCH_CHECK(tensors.size() == 28 * n && kinds.size() == 4 * n && packed_rows.size() == 4 * n,
                "DecodePlan: 28 tensors, 4 kinds and 4 packed row limits a layer");
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor* t = tensors.data() + 28 * i;
      auto linear = [&](int j) {
        const int64_t kind = kinds[4 * i + j];
        TORCH_CHECK(kind >= 0 && kind <= 2, "DecodePlan: a linear layer is dense (0) or q8act int4/int8 (1/2)");
        const at::Tensor* l = t + 4 + 6 * j;
        if (kind != 0) region_rows_ = std::min(region_rows_, packed_rows[4 * i + j]);
        return PlanLinear{kind, l[0], l[1], l[2], l[3], packed_rows[4 * i + j], prepacked_rows, l[4], l[5]};
      };
      layers_.push_back(PlanLayer{t[0], t[1], t[2], t[3], linear(0), linear(1), linear(2), linear(3),
                                  windows[i]});
    }
    one_region_ = region_possible();
  }

  // x (T, h): the tokens' embeddings, updated in place as the residual stream -> the hidden states before the
  // final norm. Every row a decode row (no prefill span). In one parallel region where it can (`one_region`).
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                    at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                    at::Tensor query_start) const {
    if (one_region_ && x.dim() == 2 && x.size(0) <= region_rows_ && x.scalar_type() == at::kBFloat16) {
      auto y = run_region(x, positions, cos, sin, slots, block_tables, seq_lens, query_start, nullptr);
      if (y.defined()) return y;
    }
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodePlan.run: x must be contiguous (T, h)");
    at::Tensor delta;
    for (const PlanLayer& l : layers_) {
      auto hidden = delta.defined() ? add_rms_norm(x, delta, l.input_norm, eps_) : rms_norm(x, l.input_norm, eps_);
      auto attn = rope_decode_attention(l.qkv(hidden).contiguous(), positions, cos, sin, l.k_cache, l.v_cache,
                                        slots, block_tables, seq_lens, query_start, nh_, nkv_, scale_, l.window);
      hidden = add_rms_norm(x, l.o(attn).contiguous(), l.post_norm, eps_);
      delta = l.down(silu_mul(l.gate_up(hidden).contiguous()));
    }
    return delta.defined() ? x + delta : x;
  }

  // The whole step in one OpenMP parallel region, its ops separated by barriers rather than each forking and
  // joining the threads and allocating its output (~150 of each a token at one row): the same kernels and
  // rounding, so the same bits. Possible when every linear layer is on the int8-activation fast path; an
  // undefined tensor where this step cannot run so (not one row a sequence), which `run` then runs op by op.
  // `head`: also the final norm and the LM head of every row, in the same region (`run_logits`); nullptr: the
  // hidden states.
  struct HeadOut;
  at::Tensor run_region(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                        at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start,
                        const HeadOut* head) const;

  // The embedding (`embed`, (V, h)), and the final norm (`norm`, (h,)) and the LM head after the layers, for steps
  // whose every row samples (`run_logits`): the head as a PlanLinear's 6 tensors (w, scales, mins, bias, dense,
  // prepacked), an int8-activation kernel's (kind 1 or 2) up to its packed rows. Returns whether the region can run it.
  bool set_head(at::Tensor embed, at::Tensor norm, const std::vector<at::Tensor>& tensors, int64_t kind,
                int64_t packed_rows);

  // The tokens' embedding rows, `run`, then the final norm and the LM head of every row in the same parallel region:
  // (logits (T, V) float32, as the head's bfloat16 output widened; each row's index of its first largest logit (T,)
  // int64, the first NaN where there is one, as torch's `max(dim=-1)`). Undefined tensors where the region cannot run
  // this step (no head, more rows than the head takes packed, not one row a sequence): run it as `run`, then the
  // head. A token id outside the embedding is an error, as nn.Embedding's.
  std::tuple<at::Tensor, at::Tensor> run_logits(at::Tensor ids, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                                at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                                                at::Tensor query_start) const;

  // Whether `run` takes the one-region path: asked for (`on`) and possible. Returns the state now.
  bool set_one_region(bool on) {
    one_region_ = on && region_possible();
    return one_region_;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  bool region_possible() const;

  std::vector<PlanLayer> layers_;
  int64_t nh_, nkv_;
  double scale_, eps_;
  bool one_region_ = false;
  int64_t region_rows_ = INT64_MAX;  // the most rows every linear layer takes packed: the region's limit
  at::Tensor embed_, final_norm_;  // undefined: no head (set_head)
  PlanLinear head_;
};
