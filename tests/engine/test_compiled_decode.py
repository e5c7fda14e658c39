"""The torch.compile decode step (engine/compiled_decode.py), everything but Inductor and the CUDA graph capture:
on the CPU's PyTorch path (the C++ kernels off) with Dynamo's eager backend and fullgraph=True, so a graph break
fails here. Each compiled step is checked against the model's Python forward on the same unpadded inputs; the
padding rows write only the scratch block; steps it cannot take (prefill, speculative chunks) take the forward."""

from __future__ import annotations

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory import config
from tokenfactory.config import EngineConfig
from tokenfactory.engine.compiled_decode import (
    DECODE_STEPS,
    CompiledDecode,
    CompileSpec,
    bucket,
    resolve,
    row_buckets,
    width_buckets,
)
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.layers import cpu_kernels
from tokenfactory.layers.attention import AttentionMetadata, PrefillSpan
from tokenfactory.models.loader import load_model
from tokenfactory.types import ParameterError, SamplingParams


@pytest.fixture
def pytorch_path(monkeypatch):
    """The C++ kernels off in this process, as on a GPU: every op is PyTorch's."""
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_tried", True)


def test_buckets() -> None:
    assert row_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert row_buckets(5) == (1, 2, 4, 5) and row_buckets(1) == (1,)
    assert width_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128) and width_buckets(100)[-2:] == (64, 100)
    assert [bucket((1, 2, 4, 8), n) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    assert resolve("auto", torch.device("cpu")) == "plan" and resolve("auto", torch.device("cuda")) == "cuda-graphs"
    assert resolve("eager", torch.device("cuda")) == "eager"
    assert set(config.DECODE_STEPS) == {"auto", *DECODE_STEPS}  # what the config accepts is what the runner runs


def test_bad_settings_are_refused_by_name(tmp_path) -> None:
    with pytest.raises(ParameterError) as e:
        EngineConfig(decode_step="cuda-graphs")  # on the CPU
    assert e.value.param == "decode_step" and "CUDA" in str(e.value)
    with pytest.raises(ParameterError, match="decode_step must be one of"):
        EngineConfig(decode_step="fast")
    if cpu_kernels.fused_kernels() is not None:  # torch.compile cannot see into them: said at start-up
        folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=64, intermediate_size=128)
        with pytest.raises(ValueError, match="TOKENFACTORY_CPU_KERNELS=0"):
            LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=4 << 20, max_model_len=128, quantization="none",
                                   machine_profile="off", decode_step="trace"), load_model(folder))


class Checked:
    """Wraps the compiled step: each step it runs, the model's Python forward runs on the same rows (writing
    the same K/V again) and must agree to float32's batch rounding (the bucket pads the matmuls' row count)."""

    def __init__(self, compiled: CompiledDecode) -> None:
        self.compiled, self.steps = compiled, 0

    def fits(self, meta: AttentionMetadata, num_rows: int) -> bool:
        return self.compiled.fits(meta, num_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.compiled(input_ids, positions, meta)
        model = self.compiled.model
        eager = model(input_ids, positions, self.compiled.kv_caches, meta)
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
        self.steps += 1
        return out

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        assert self.compiled.logits(input_ids, positions, meta) is None  # the graph ends at the hidden states


@pytest.mark.parametrize("quantization", ["none", pytest.param("int8", marks=pytest.mark.slow)])
def test_compiled_steps_match_the_forward_in_every_bucket(tmp_path, pytorch_path, quantization) -> None:
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=128, intermediate_size=256, num_heads=4,
                                   num_kv_heads=2)
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                    max_num_seqs=8, quantization=quantization, machine_profile="off",
                                    decode_step="trace"), load_model(folder))
    runner = engine.runner
    compiled = runner.decode_step
    assert isinstance(compiled, CompiledDecode)
    num_blocks = engine.kv.num_blocks
    assert compiled.scratch_block == num_blocks and runner.kv_caches[0][0].shape[1] == num_blocks + 1
    assert compiled.row_sizes == (1, 2, 4, 8) and compiled.width_sizes[-1] == 256 // 8
    checked = Checked(compiled)
    runner.decode_step = checked  # type: ignore[assignment]
    for layer in runner.kv_caches:  # warm_up's padding wrote it: cleared, to see this run's padding write it again
        for cache in layer:
            cache[:, compiled.scratch_block] = 0
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=gen).tolist() for n in (5, 9, 30, 3, 17)]
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=n, ignore_eos=True) for n in (12, 8, 4, 40, 16)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got = engine.run_to_completion(ids)
    assert [len(got[i].outputs[0].token_ids) for i in ids] == [12, 8, 4, 40, 16]
    # Five sequences pad to 8 rows, then 4, 3 and 2 to 4 and 2, the last alone to 1; tables of 4 blocks (the
    # 30-token prompt's) to width 4, of 5 to 7 blocks (the last sequence growing to 43 tokens) to 8.
    rows = {r for r, _ in compiled.bucket_to_steps}
    widths = {w for _, w in compiled.bucket_to_steps}
    assert rows == {1, 2, 4, 8} and widths >= {4, 8} and checked.steps >= 39
    assert runner.kv_caches[0][0][:, compiled.scratch_block, 0].abs().sum() > 0  # the padding rows wrote there
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # The same requests on the eager engine: the same tokens (float32 rounding does not reach a sampled choice).
    eager = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                   max_num_seqs=8, quantization=quantization, machine_profile="off",
                                   decode_step="eager"), load_model(folder))
    assert eager.runner.decode_step is None and eager.runner.kv_caches[0][0].shape[1] == eager.kv.num_blocks
    eager_ids = [eager.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    want = eager.run_to_completion(eager_ids)
    assert [got[i].outputs[0].token_ids for i in ids] == [want[i].outputs[0].token_ids for i in eager_ids]


def test_steps_it_cannot_take_go_to_the_forward(tmp_path, pytorch_path) -> None:
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=64, intermediate_size=128)
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=64,
                                    max_num_seqs=4, quantization="none", machine_profile="off",
                                    decode_step="trace"), load_model(folder))
    compiled = engine.runner.decode_step
    assert isinstance(compiled, CompiledDecode)
    long = torch.zeros(1, dtype=torch.long)

    def meta(rows: int, starts: list[int] | None = None, prefill: bool = False) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=long.repeat(rows), num_decode_tokens=0 if prefill else rows,
                                 decode_block_tables=None if prefill else long.repeat(rows, 1),
                                 decode_seq_lens=None if prefill else long.repeat(rows),
                                 prefills=(PrefillSpan(0, rows, 0, long),) if prefill else (),
                                 decode_query_start=torch.tensor(starts) if starts else None)
    assert compiled.fits(meta(3), 3) and compiled.fits(meta(4, [0, 1, 2, 3, 4]), 4)
    assert not compiled.fits(meta(5), 5)  # past max_num_seqs
    assert not compiled.fits(meta(3, [0, 3]), 3)  # one sequence's speculative chunk of 3 rows
    assert not compiled.fits(meta(3, prefill=True), 3)
    # Speculative decoding's verify chunks and the prefills run the forward; the decodes the compiled step.
    spec = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=64,
                                  max_num_seqs=4, quantization="none", machine_profile="off", decode_step="trace",
                                  speculative="ngram"), load_model(folder))
    prompt = [7, 8, 9, 10] * 6
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = spec.run_to_completion([spec.add_request(prompt, params)])
    plain = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=64,
                                   max_num_seqs=4, quantization="none", machine_profile="off",
                                   decode_step="eager"), load_model(folder))
    want = plain.run_to_completion([plain.add_request(prompt, params)])
    assert [o.outputs[0].token_ids for o in got.values()] == [o.outputs[0].token_ids for o in want.values()]


@pytest.mark.slow
def test_inductor_compiles_the_step(tmp_path, pytorch_path, monkeypatch) -> None:
    """Inductor's own code for the step (its CPU backend here; on CUDA the same graph, then captured): it lowers
    the cache writes into a static-address input and the dynamic bucket shapes, and gives the eager tokens (~30 s)."""
    monkeypatch.setitem(DECODE_STEPS, "trace", CompileSpec("default", warm_up_calls=1))
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=128, intermediate_size=256, num_heads=4,
                                   num_kv_heads=2)
    outs = []
    for step in ("trace", "eager"):
        engine = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                        max_num_seqs=4, quantization="none", machine_profile="off",
                                        decode_step=step), load_model(folder))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ids = [engine.add_request(list(range(3 + i, 20 + 3 * i)), params) for i in range(3)]
        got = engine.run_to_completion(ids)
        outs.append([got[i].outputs[0].token_ids for i in ids])
        if step == "trace":
            assert {rows for rows, _ in engine.runner.decode_step.bucket_to_steps} == {4}  # type: ignore[union-attr]
    assert outs[0] == outs[1]
