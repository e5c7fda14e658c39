"""The Llama family (Llama 2/3, SmolLM/SmolLM2, Qwen2/2.5, Mistral) as one decoder over a flat batch.

The model sees the step's tokens as one flat batch (T, ...) with their positions; attention over the
paged KV cache is `paged_attention_qkv` (RoPE, the KV write and attention: on the CPU one kernel call for a
decode step), and each residual add is fused with the norm after it. Projections are plain `nn.Linear`
modules (q/k/v fused into one, gate/up fused into one) so that quantization can swap them for modules
holding packed weights without the model knowing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tokenfactory.config import ModelConfig
from tokenfactory.layers.activation import silu_mul
from tokenfactory.layers.attention import AttentionMetadata, paged_attention_qkv
from tokenfactory.layers.cpu_kernels import fused_kernels
from tokenfactory.layers.norm import add_rms_norm, rms_norm
from tokenfactory.layers.quant import PREPACKED_MAX_ROWS, plan_linear
from tokenfactory.layers.rotary import RopeBatch, Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.window(layer_idx)  # None: full attention
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope: RopeBatch, kv: tuple[torch.Tensor, ...],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, the previous layer's output delta not yet added) -> the same pair after this
        layer: each residual add is fused with the norm after it (layers/norm.py), x updated in place."""
        if delta is None:
            hidden = rms_norm(x, self.input_norm, self.eps)
        else:
            x, hidden = add_rms_norm(x, delta, self.input_norm, self.eps)
        # kv: (k_cache, v_cache), or with a quantized cache (k_cache, v_cache, k_scale, v_scale)
        attn = paged_attention_qkv(self.qkv_proj(hidden), rope, kv[0], kv[1], meta, self.scale, self.num_heads,
                                   self.num_kv_heads, scales=(kv[2], kv[3]) if len(kv) == 4 else None,
                                   window=self.window)  # (T, nh * d)
        x, hidden = add_rms_norm(x, self.o_proj(attn), self.post_norm, self.eps)
        return x, self.down_proj(silu_mul(self.gate_up_proj(hidden)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # Given its (uninitialised) weight, nn.Embedding skips its normal_ init: on the meta device placement builds
        # on, normal_ goes through torch._refs and imports torch._dynamo (~1.3 s of every process's start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, not two copies
        self.rotary = Rotary(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, h), before the final norm."""
        x = self.embed_tokens(input_ids)  # (T, h), a fresh tensor: the layers add into it in place
        rope = self.rotary.batch(positions, x.dtype)
        delta = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, rope, kv, meta)
        return x if delta is None else x + delta

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, h) from `forward` -> the last hidden states (S, h) (Hugging Face's `last_hidden_state`)."""
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, h) of the rows that sample -> logits (S, V) in float32."""
        return self.lm_head(self.final_norm(hidden)).float()

    def decode_plan(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> DecodePlan | None:
        """The decoder layers of a decode-only step as one compiled call over these caches (`DecodePlan`), or None
        where it cannot run them exactly as `forward` does: not the CPU, not bfloat16, a quantized KV cache, a
        linear layer on a kernel it does not call, or no compiled kernels. Each layer runs as `forward` would at
        the step's rows (its layers' crossovers as they are now: build the plan again when they change); a packed
        layer without a kept dense copy limits the plan to its packed rows."""
        kernels = fused_kernels()
        dtype = self.embed_tokens.weight.dtype
        if kernels is None or self.embed_tokens.weight.device.type != "cpu" or dtype != torch.bfloat16 \
                or any(len(kv) != 2 or kv[0].dtype != dtype for kv in kv_caches):
            return None
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        packed_rows: list[int] = []
        max_rows = 1 << 30
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            tensors += [layer.input_norm, layer.post_norm, k_cache, v_cache]
            for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                spec = plan_linear(proj, dtype)
                if spec is None:
                    return None
                kinds.append(spec.kind)
                packed_rows.append(spec.packed_rows)
                tensors += spec.tensors()
                max_rows = min(max_rows, spec.max_rows)
        if max_rows < 1:
            return None
        c = self.cfg
        plan = kernels.DecodePlan([t.detach() for t in tensors], kinds, packed_rows,
                                  [layer.window or 0 for layer in self.layers], c.num_heads, c.num_kv_heads,
                                  c.head_dim ** -0.5, c.rms_norm_eps, PREPACKED_MAX_ROWS)
        head = plan_linear(self.lm_head, dtype)
        head_rows = head.packed_rows if head is not None and head.kind != 0 and plan.set_head(
            self.embed_tokens.weight.detach(), self.norm.detach(), [t.detach() for t in head.tensors()], head.kind,
            head.packed_rows) else 0
        return DecodePlan(self, plan, max_rows, head_rows)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face checkpoints, fusing q/k/v and gate/up."""
        self.load_outer_weights(weights)
        for i in range(len(self.layers)):
            self.load_layer_weights(i, weights)

    def _take(self, weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"the checkpoint has no tensor {name!r}, which a "
                             f"{self.cfg.architecture} model with {self.cfg.num_layers} layers needs")
        return weights[name]

    @torch.no_grad()
    def load_outer_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The embedding, the final norm and the LM head (re-tied to the embedding when tied)."""
        self.embed_tokens.weight.copy_(self._take(weights, "model.embed_tokens.weight"))
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # re-tie: moving off the meta device unties
        else:
            self.lm_head.weight.copy_(self._take(weights, "lm_head.weight"))
        self.norm.copy_(self._take(weights, "model.norm.weight"))

    @torch.no_grad()
    def load_layer_weights(self, i: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Decoder layer i's weights (a loader may place and quantize the model one layer at a time)."""
        def take(name: str) -> torch.Tensor:
            return self._take(weights, name)

        layer = self.layers[i]
        p = f"model.layers.{i}."
        layer.input_norm.copy_(take(p + "input_layernorm.weight"))
        layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
        a = p + "self_attn."
        layer.qkv_proj.weight.copy_(torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]))
        if self.cfg.attention_bias:
            layer.qkv_proj.bias.copy_(torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"]))
        layer.o_proj.weight.copy_(take(a + "o_proj.weight"))
        m = p + "mlp."
        layer.gate_up_proj.weight.copy_(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
        layer.down_proj.weight.copy_(take(m + "down_proj.weight"))


class DecodePlan:
    """A decode-only step (every row a decode row, at most `max_rows` of them) as one compiled call for all the
    decoder layers (csrc/cpu_kernels.cpp `DecodePlan`): the kernels `forward` calls, in its order, with its
    rounding, so the outputs are the same bits; without ~10 Python-level calls a layer. It holds the model's
    tensors and the KV caches it was built over: build a new one when either is replaced."""

    def __init__(self, model: LlamaForCausalLM, plan: object, max_rows: int, head_rows: int = 0) -> None:
        self.model, self.plan, self.max_rows = model, plan, max_rows
        self.head_rows = head_rows  # the most rows `logits` takes: the LM head's packed rows (0: none)

    def fits(self, meta: AttentionMetadata, num_rows: int) -> bool:
        return not meta.prefills and meta.num_decode_tokens == num_rows <= self.max_rows

    def set_one_region(self, on: bool) -> bool:
        """Run a step's ops in one parallel region, meeting at barriers (the default where every linear layer is
        on the int8-activation kernel), or op by op; the same bits either way. Returns whether it now does."""
        return bool(self.plan.set_one_region(on))  # type: ignore[attr-defined]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, h), before the final norm, as `forward` returns them."""
        tables, lens, starts = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_start
        assert tables is not None and lens is not None
        if starts is None:
            starts = torch.arange(lens.shape[0] + 1)
        rotary = self.model.rotary
        return self.plan.run(self.model.embed_tokens(input_ids), positions, rotary.cos, rotary.sin,  # type: ignore[attr-defined]
                             meta.slot_mapping, tables, lens, starts)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step whose every row samples, in one call: the embedding's rows, then the layers, the final norm and the
        LM head in one parallel region. Returns (logits (T, V) float32, the same bits as `compute_logits(self(...))`;
        each row's first largest logit's index (T,), as `max(dim=-1)`), or None where the region cannot run the head
        too (then nothing has run). A single stream spent ~0.25 ms a token around the region otherwise: the Python
        calls of the embedding, the norm and the head, and widening and searching 49152 logits in PyTorch ops that
        read them cold from the other core's cache."""
        tables, lens, starts = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_start
        if not 0 < input_ids.shape[0] <= self.head_rows or tables is None or lens is None or starts is None:
            return None
        rotary = self.model.rotary
        logits, first = self.plan.run_logits(  # type: ignore[attr-defined]
            input_ids, positions, rotary.cos, rotary.sin, meta.slot_mapping, tables, lens, starts)
        return None if logits is None else (logits, first)


MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
}
