"""Decode-only steps at static shapes through `torch.compile` (issue 29): on CUDA with `mode="reduce-overhead"`,
one CUDA graph per shape bucket, replayed each step instead of ~15 kernel launches a layer from Python.

The CPU's own compiled step is the C++ `DecodePlan` (models/llama.py), whose pybind calls torch.compile cannot see
into; this is the step for devices where the model runs PyTorch ops. A decode-only step of B sequences (one row
each) is padded to a bucket of rows, and its block tables to a bucket of widths, so every step of a bucket has the
same shapes and replays the same graph:

    rows 0 .. B-1     the step's sequences
    rows B .. Bb-1    padding: token 0 at position 0 with one key, its K/V written to the scratch block (one block
                      past the block manager's pool, owned by no sequence); their outputs are dropped
    table columns     past a sequence's own blocks: the scratch block, never read (seq_lens masks them)

Row buckets are 1, 2, 4, then every 8 up to max_num_seqs (vLLM's capture sizes); widths powers of two up to the
blocks of max_model_len. After the first bucket Dynamo marks the changing sizes dynamic (its automatic dynamic
shapes), so a few compiles serve every bucket; CUDA graphs are recorded per bucket (`warm_up` records the row
buckets at start-up, the widths as first used). The arithmetic is the model's
own `forward`: bucketing changes shapes, never operations.

The CPU tests run this class on the PyTorch path (the C++ kernels off) with the compiler's eager backend and
fullgraph=True: bucketing, padding, the scratch block and a graph without a break are checked on every machine;
Inductor's CUDA code and the capture itself only where a GPU is (scripts/cuda_check.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfactory.layers.attention import AttentionMetadata
from tokenfactory.layers.cpu_kernels import fused_kernels
from tokenfactory.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class CompileSpec:
    """How `torch.compile` builds the step: `mode` ("reduce-overhead": Inductor's code, replayed as CUDA graphs)
    and `backend` ("eager": Dynamo's trace alone, no code generated: what the CPU tests check)."""

    mode: str | None
    backend: str = "inductor"
    warm_up_calls: int = 3  # a CUDA graph tree warms a new shape once, records it, then replays


# EngineConfig.decode_step -> how a decode-only step runs ("auto" is resolved per device by `resolve`).
DECODE_STEPS: dict[str, CompileSpec | None] = {
    "eager": None,  # the model's Python forward (vLLM's --enforce-eager)
    "cuda-graphs": CompileSpec("reduce-overhead"),
    "trace": CompileSpec(None, backend="eager", warm_up_calls=1),
}


RECOMPILE_LIMIT = 256  # Dynamo's per-function limit, raised for `_step` (see CompiledDecode.__init__)


def resolve(decode_step: str, device: torch.device) -> str:
    """"auto": CUDA graphs on CUDA; on the CPU the C++ DecodePlan, which the runner builds itself ("plan")."""
    if decode_step != "auto":
        return decode_step
    return "cuda-graphs" if device.type == "cuda" else "plan"


def row_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every 8, up to and including max_num_seqs."""
    return tuple(sorted({min(n, max_num_seqs) for n in (1, 2, 4, *range(8, max_num_seqs + 8, 8))}))


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths: powers of two, up to and including max_blocks."""
    return tuple(sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)}))


def bucket(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest size >= n, or None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CompiledDecode:
    """A decode-only step (one row a sequence, at most max_num_seqs of them) through `torch.compile`, padded to
    its bucket. Holds the model and the KV caches it was built over (the scratch block included): build a new one
    when either is replaced."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, ...]], *, spec: CompileSpec,
                 scratch_block: int, block_size: int, max_num_seqs: int, max_blocks: int) -> None:
        device = model.embed_tokens.weight.device
        if device.type == "cpu" and fused_kernels() is not None:
            raise ValueError("decode_step: torch.compile cannot see into the CPU's compiled kernels; on the CPU the "
                             "compiled step is the default (auto), or set TOKENFACTORY_CPU_KERNELS=0 to compile the "
                             "PyTorch path")
        if any(scratch_block >= kv[0].shape[1] for kv in kv_caches):
            raise ValueError(f"the scratch block {scratch_block} is not in the KV pool")
        self.model, self.kv_caches, self.spec = model, kv_caches, spec
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.row_sizes, self.width_sizes = row_buckets(max_num_seqs), width_buckets(max_blocks)
        for layer in kv_caches:  # written in place each step: a graph must see the same storage every replay
            for cache in layer:
                torch._dynamo.mark_static_address(cache)
        # Dynamo keeps compiled code per code object, so every CompiledDecode in a process (tests build many engines;
        # a server one) shares `_step`'s entries, told apart by guards: a few per engine (0/1 specialisation, the
        # quantized layers' packed/dense crossover), past the default limit of 8 with a second engine.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._compiled = torch.compile(self._step, mode=spec.mode, backend=spec.backend, fullgraph=True)
        self.bucket_to_steps: dict[tuple[int, int], int] = {}

    def fits(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """Decode rows only, one a sequence (no speculative chunk), within the largest buckets."""
        tables, starts = meta.decode_block_tables, meta.decode_query_start
        return (not meta.prefills and tables is not None and meta.num_decode_tokens == num_rows
                and (starts is None or starts.shape[0] == num_rows + 1)
                and num_rows <= self.row_sizes[-1] and tables.shape[1] <= self.width_sizes[-1])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (B,) -> hidden states (B, h), before the final norm, as `forward` returns them."""
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and lens is not None
        n = input_ids.shape[0]
        rows, width = bucket(self.row_sizes, n), bucket(self.width_sizes, tables.shape[1])
        assert rows is not None and width is not None, "fits() first"
        key = (rows, width)
        self.bucket_to_steps[key] = self.bucket_to_steps.get(key, 0) + 1
        pad = rows - n
        hidden = self._compiled(F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)),
                                F.pad(meta.slot_mapping, (0, pad), value=self.scratch_slot),
                                F.pad(tables, (0, width - tables.shape[1], 0, pad), value=self.scratch_block),
                                F.pad(lens, (0, pad), value=1))  # (rows, h)
        # A graph's output lives in its pool until the next replay: the caller gets its own copy of the real rows.
        return hidden[:n].clone()

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: the graph ends at the hidden states; the runner computes the logits after it."""
        return None

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
        """The traced function: the model's own forward over one bucket's static shapes."""
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=input_ids.shape[0], decode_block_tables=tables,
                                 decode_seq_lens=lens, prefills=())
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()  # as the runner's steps run: a graph is traced for the grad mode it runs in
    def warm_up(self) -> None:
        """Compile, and record each row bucket's graph at the narrowest width, now rather than in a user's step:
        every row is padding (token 0, the scratch block), so no sequence's cache is touched."""
        device = self.model.embed_tokens.weight.device
        for rows in self.row_sizes:
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            meta = AttentionMetadata(slot_mapping=torch.full_like(zeros, self.scratch_slot), num_decode_tokens=rows,
                                     decode_block_tables=torch.full((rows, 1), self.scratch_block, device=device),
                                     decode_seq_lens=torch.ones_like(zeros), prefills=())
            for _ in range(self.spec.warm_up_calls):
                self(zeros, zeros, meta)
        self.bucket_to_steps.clear()
