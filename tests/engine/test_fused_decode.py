"""The compiled decode step (models/llama.py DecodePlan) against the model's Python forward: the same bits for
every decode step, on tiny random-weight models (dense, int4 and int8 weights, q/k/v biases, sliding windows per
layer), op by op and in one parallel region, on one thread and two, and on the real bundled model as served by
default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.sampler import first_max
from tokenfactory.layers.quant import q8act_available, step_rows
from tokenfactory.models.llama import DecodePlan
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams


class Checked:
    """Wraps a runner's plan: each step it runs, the Python forward runs too (it writes the same K/V again) and
    must give the same hidden states, bit for bit; where the plan ran the LM head too (`logits`), the same logits
    as `compute_logits` and the same first maxima as the sampler's `first_max`."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan, self.max_rows, self.steps, self.rows = plan, plan.max_rows, 0, set()
        self.head_rows: set[int] = set()  # the row counts of steps that ran the head in the plan
        self.firsts: list[int] = []  # the first maxima those steps found

    def fits(self, meta, num_rows: int) -> bool:
        return self.plan.fits(meta, num_rows)

    def __call__(self, input_ids, positions, meta) -> torch.Tensor:
        fused = self.plan(input_ids, positions, meta)
        model = self.plan.model
        with step_rows(meta.num_decode_tokens):
            python = model(input_ids, positions, model_kv(model), meta)
        assert torch.equal(fused, python), (fused - python).abs().max()
        self.steps += 1
        self.rows.add(input_ids.shape[0])
        return fused

    def logits(self, input_ids, positions, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        fused = self.plan.logits(input_ids, positions, meta)
        if fused is None:
            return None
        model = self.plan.model
        with step_rows(meta.num_decode_tokens):
            expected = model.compute_logits(model(input_ids, positions, model_kv(model), meta))
        logits, first = fused
        assert logits.dtype == torch.float32 and torch.equal(logits.view(torch.int32), expected.view(torch.int32))
        assert first.tolist() == first_max(expected)
        self.steps += 1
        self.rows.add(input_ids.shape[0])
        self.head_rows.add(input_ids.shape[0])
        self.firsts += first.tolist()
        self.last_step = (input_ids, positions, meta)
        return fused


_KV: dict[int, list] = {}


def model_kv(model) -> list:
    return _KV[id(model)]


def run_checked(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 10,
                one_region: bool | None = None, temperature: float = 0.8) -> Checked:
    """`one_region`: asked for (True: it must be possible) or refused; None: the plan's default."""
    runner = engine.runner
    assert runner.decode_step is not None, "the plan applies to this model"
    if one_region is not None:
        assert runner.decode_step.set_one_region(one_region) == one_region
    checked = Checked(runner.decode_step)
    _KV[id(runner.model)] = runner.kv_caches
    runner.decode_step = checked  # type: ignore[assignment]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = engine.run_to_completion([engine.add_request(p, params) for p in prompts])
    finally:
        runner.decode_step = checked.plan
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs.values())
    return checked


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, 49152, (k,), generator=gen).tolist() for k in lengths]


@pytest.mark.parametrize(("arch", "quantization", "windows"), [
    ("llama", "none", None), ("qwen2", "none", None), ("llama", "int4", None), ("qwen2", "int8", None),
    ("llama", "int4", (7, None)), ("qwen2", "int8", (None, 20))])
def test_fused_decode_step_is_the_python_forward_bit_for_bit(tmp_path, arch, quantization, windows) -> None:
    if quantization != "none" and not q8act_available():
        pytest.skip("the int8-activation kernels need AVX-512 VNNI; other packed kernels keep the Python step")
    folder = tiny_random_model_dir(tmp_path, arch, hidden_size=128, intermediate_size=256, num_heads=4,
                                   num_kv_heads=2, attention_bias=None)
    loaded = load_model(folder)
    if windows is not None:  # a sliding window on some layers, full attention on others
        loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, layer_windows=windows))
    engine = LLMEngine(EngineConfig(dtype="bfloat16", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                    quantization=quantization, machine_profile="off"), loaded)
    # Every linear layer on the int8-activation kernel: one parallel region (possible, so asked for), then op by
    # op. A prompt past 128 tokens splits its attention into spans that the region merges.
    modes = [None] if quantization == "none" else [True, False]
    long_prompt = torch.randint(0, 49152, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    threads = torch.get_num_threads()
    try:
        for one_region in modes:
            for n in sorted({1, min(2, threads)}):
                torch.set_num_threads(n)
                checked = run_checked(engine, prompts(5) + [long_prompt], one_region=one_region)
                assert checked.steps >= 9 and max(checked.rows) > 1  # batched decode steps took the plan
                # Where the region runs, the int4 / int8 LM head runs in it too: every step here samples every row.
                assert bool(checked.head_rows) == bool(one_region), checked.head_rows
                assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        torch.set_num_threads(threads)
    if quantization == "none":  # a dense layer has no int8-activation kernel: always op by op
        assert engine.runner.decode_step.set_one_region(True) is False


def test_no_plan_where_it_cannot_match_the_forward(tmp_path) -> None:
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    for cfg in (dict(dtype="float32"), dict(dtype="bfloat16", kv_cache_dtype="int8"),
                dict(dtype="bfloat16", decode_step="eager")):
        engine = LLMEngine(EngineConfig(block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                        quantization="none", machine_profile="off", **cfg), load_model(folder))
        assert engine.runner.decode_step is None, cfg
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        rid = engine.add_request([1, 2, 3], params)
        assert len(engine.run_to_completion([rid])[rid].outputs[0].token_ids) == 4


def test_bundled_model_decodes_through_the_plan_as_served(bundled) -> None:
    """The bundled GGUF with the server's defaults (its own quantization, bfloat16): one stream and a batch."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512, machine_profile="off"), bundled)
    one_region = True if q8act_available() else None  # its int8/int4 layers in one parallel region where they can
    checked = run_checked(engine, prompts(1, seed=4), max_tokens=16, one_region=one_region, temperature=0)
    assert checked.head_rows == ({1} if one_region else set())  # its Q8_0 LM head in the region
    checked = run_checked(engine, prompts(6, seed=5), max_tokens=8)
    assert checked.steps >= 7 and max(checked.rows) == 6


@pytest.mark.parametrize(("dense", "packed_rows"), [  # serve's default in the quick suite, the rest in the full one
    pytest.param("copy", 16, marks=pytest.mark.slow), pytest.param("prepacked", 16, marks=pytest.mark.slow),
    pytest.param("copy", 4, marks=pytest.mark.slow), ("prepacked", 4)])
def test_bundled_model_plan_at_and_past_the_packed_rows(bundled, dense, packed_rows) -> None:
    """Steps of up to 14 rows through the plan, its layers packed up to `packed_rows` (16: every step packed, in one
    region; 4: the larger steps on the layers' dense path inside the plan, oneDNN's prepacked weight or the plain
    copy, op by op), bit for bit the forward's."""
    if not q8act_available():
        pytest.skip("the int8-activation kernels need AVX-512 VNNI")
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=16,
                                    quantization_dense=dense, machine_profile="off"), bundled)
    runner = engine.runner
    for m in runner._crossovers:
        runner._crossovers[m] = packed_rows
    assert runner.set_packed_rows(0) == packed_rows
    assert runner.decode_step.max_rows > 16  # every layer keeps a dense path: the plan takes any step
    checked = run_checked(engine, prompts(14, seed=6), max_tokens=6, one_region=True)
    assert max(checked.rows) == 14  # past 4 packed rows: the dense path; up to 16: packed
    # The LM head keeps its own crossover: in the region only for steps it takes packed, the rest after the plan.
    head_limit = min(runner.model.lm_head.max_packed_rows, packed_rows)
    assert head_limit < 14 and all(rows <= head_limit for rows in checked.head_rows), checked.head_rows
    assert run_checked(engine, prompts(2, seed=7), max_tokens=4, one_region=True).head_rows == {2}


def test_the_plans_lm_head_finds_the_first_max_as_torch_does(tmp_path) -> None:
    """The head's first max, found by two threads over their halves of the vocabulary and merged: a NaN beats every
    number and the first NaN wins, within a thread's half and across them; equal logits give the first (as torch's
    `max(dim=-1)`, which the Checked wrapper compares it with at every step)."""
    if not q8act_available():
        pytest.skip("the int8-activation kernels need AVX-512 VNNI")
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                                    quantization="int8", machine_profile="off"), load_model(folder))
    model = engine.runner.model
    assert engine.runner.decode_step.set_one_region(True) and engine.runner.decode_step.head_rows >= 3
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # halves [0, 24576) and [24576, 49152)
    try:
        with torch.inference_mode():
            for column, block in ((45_000, 1), (30_000, 0), (20_000, 2)):  # the tensors the plan holds
                model.lm_head.packed.scales[column, block] = float("nan")
                checked = run_checked(engine, prompts(3, seed=column), max_tokens=3, temperature=0)
                assert 3 in checked.head_rows and set(checked.firsts) == {column}
            model.lm_head.packed.scales.nan_to_num_(0.0)
            model.norm.zero_()  # every logit 0: a tie over the whole vocabulary, each half's first found
            checked = run_checked(engine, prompts(3, seed=9), max_tokens=3, temperature=0)
            assert 3 in checked.head_rows and set(checked.firsts) == {0}
            ids, positions, meta = checked.last_step  # the plan reads the embedding's rows itself: checked, as
            with pytest.raises(IndexError, match="out of range"):  # nn.Embedding checks them
                checked.plan.logits(torch.full_like(ids, 49152), positions, meta)
    finally:
        torch.set_num_threads(threads)
