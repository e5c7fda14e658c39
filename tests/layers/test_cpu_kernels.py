"""The CPU decode-attention kernel against the PyTorch path it replaces, on random paged caches."""

import pytest
import torch

from tokenfactory.layers.attention import decode_attention_torch
from tokenfactory.layers.cpu_kernels import paged_decode_kernel

kernel = paged_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernel could not be built here")


def one_row_each(lens) -> torch.Tensor:
    return torch.arange(len(lens) + 1)


def paged_case(lens: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype, block_size: int = 16,
               head_dim: int = 64, num_blocks: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long)  # padded with block 0, as the runner does
    # Scattered blocks, not one contiguous run; block 0 is left to pad the tables.
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[i, b] = free.pop()
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_torch_path(dtype, tol, num_heads, num_kv_heads):
    # One key, a block exactly full, one past it, long and short together.
    lens = [1, 16, 17, 200, 5, 333]
    q, k, v, tables, seq_lens = paged_case(lens, num_heads, num_kv_heads, dtype)
    scale = 64 ** -0.5
    want = decode_attention_torch(q, k, v, tables, seq_lens, scale)
    got = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 128, 80])  # compiled-in sizes, and any other
def test_every_head_size(head_dim):
    q, k, v, tables, seq_lens = paged_case([1, 33, 150], 8, 2, torch.float32, head_dim=head_dim)
    scale = head_dim ** -0.5
    want = decode_attention_torch(q, k, v, tables, seq_lens, scale)
    got = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_blocks_are_never_read():
    # Keys past a sequence's length are NaN: reading them (even masked) would turn the output to NaN.
    q, k, v, tables, seq_lens = paged_case([3, 40], 9, 3, torch.float32)
    for i, n in enumerate(seq_lens.tolist()):
        last = tables[i, (n - 1) // 16]
        k[:, last, n % 16 or 16:] = float("nan")
        v[:, last, n % 16 or 16:] = float("nan")
    k[:, 0], v[:, 0] = float("nan"), float("nan")  # block 0 pads the tables
    out = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), 0.125)
    assert torch.isfinite(out).all()


def test_single_key_returns_its_value():
    q, k, v, tables, seq_lens = paged_case([1], 9, 3, torch.float32)
    out = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), 0.125)
    block = tables[0, 0]
    torch.testing.assert_close(out[0], v[:, block, 0].repeat_interleave(3, dim=0))


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    q, k, v, tables, seq_lens = paged_case([20], 9, 3, torch.float32)
    with pytest.raises(RuntimeError, match="sequence length"):
        kernel(q, k, v, tables, torch.tensor([33]), one_row_each([0]), 0.125)  # 2 blocks in the table, 3 needed
    with pytest.raises(RuntimeError, match="block id"):
        kernel(q, k, v, torch.tensor([[0, 9999]]), seq_lens, one_row_each(seq_lens), 0.125)
    with pytest.raises(RuntimeError, match="query rows"):
        kernel(q, k, v, tables, torch.tensor([0]), one_row_each([0]), 0.125)
    with pytest.raises(RuntimeError, match="query rows"):
        kernel(q, k, v, tables, seq_lens, torch.tensor([0, 2]), 0.125)  # q has one row


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_several_rows_per_sequence_see_keys_up_to_their_own_position(dtype, tol):
    # A speculative chunk: sequence s brings n rows, row r at position len - n + r. Reference: each row as
    # its own one-row sequence with that many keys, through the PyTorch path.
    lens, rows = [40, 5, 16, 200], [5, 1, 3, 2]
    _, k, v, tables, seq_lens = paged_case(lens, 9, 3, dtype)
    q = torch.randn(sum(rows), 9, 64).to(dtype)
    starts = torch.tensor([0] + rows).cumsum(0)
    row_tables = torch.cat([tables[i].expand(n, -1) for i, n in enumerate(rows)])
    row_lens = torch.tensor([length - n + r + 1 for length, n in zip(lens, rows, strict=True) for r in range(n)])
    want = decode_attention_torch(q, k, v, row_tables, row_lens, 0.125)
    got = kernel(q, k, v, tables, seq_lens, starts, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    import torch.utils.cpp_extension

    import tokenfactory.layers.cpu_kernels as cpu_kernels

    def broken_load(**kwargs):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken_load)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    with caplog.at_level("WARNING", logger="tokenfactory.layers.cpu_kernels"):
        assert cpu_kernels.paged_decode_kernel() is None
        assert cpu_kernels.paged_decode_kernel() is None  # asked again: no second build, no second warning
    assert len(caplog.records) == 1 and "g++: command not found" in caplog.text and "PyTorch path" in caplog.text


def test_kernels_can_be_switched_off(monkeypatch):
    import tokenfactory.layers.cpu_kernels as cpu_kernels

    monkeypatch.setenv("TOKENFACTORY_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    assert cpu_kernels.paged_decode_kernel() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(dtype):
    from tokenfactory.layers.cpu_kernels import rms_norm_kernel

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    # Hugging Face's LlamaRMSNorm: float32 statistics, rounded to the input dtype, then times the weight.
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = rms_norm_kernel()(x, w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        rms_norm_kernel()(x.t(), w, 1e-5)


def test_the_fallback_splits_speculative_rows_as_the_kernel_does(monkeypatch):
    # Where the kernel is absent (CUDA, no compiler), attention.py expands a sequence's rows into one-row
    # "sequences" for the PyTorch path: the result must equal the kernel's.
    import tokenfactory.layers.attention as attention
    from tokenfactory.layers.attention import AttentionMetadata

    lens, rows = [40, 5, 16, 200], [5, 1, 3, 2]
    _, k, v, tables, seq_lens = paged_case(lens, 9, 3, torch.float32)
    q = torch.randn(sum(rows), 9, 64)
    starts = torch.tensor([0] + rows).cumsum(0)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), sum(rows), tables, seq_lens, (), starts)
    with_kernel = attention._decode_attention(q, k, v, meta, 0.125)
    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    torch.testing.assert_close(attention._decode_attention(q, k, v, meta, 0.125), with_kernel, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("window", [0, 1, 20, 64, 100])
def test_decode_rows_split_into_spans_match_the_reference(head_dim, window):
    # Decode rows (one per sequence) take the span-split path: lengths across one, two and six 64-key spans,
    # windows inside a span and across span edges. bfloat16 caches (the AVX-512 path where built), compared with
    # float32 arithmetic on the same rounded values: only the output's rounding to bfloat16 may differ.
    lens = [1, 63, 64, 65, 129, 333]
    q, k, v, tables, seq_lens = paged_case(lens, 9, 3, torch.bfloat16, head_dim=head_dim, seed=3)
    scale = head_dim ** -0.5
    want = decode_attention_torch(q.float(), k.float(), v.float(), tables, seq_lens, scale, window=window or None)
    got = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), scale, window)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


def test_a_decode_rows_attention_is_the_same_bits_beside_any_batch():
    # The spans are fixed by a sequence's positions, never by the batch or the threads' share of it: the same
    # sequence alone, first of three, last of eight.
    lens = [200, 7, 90, 333, 64, 1, 150, 200]
    q, k, v, tables, seq_lens = paged_case(lens, 9, 3, torch.bfloat16, seed=5)
    batch = kernel(q, k, v, tables, seq_lens, one_row_each(seq_lens), 0.125)
    for i in (0, 7):
        alone = kernel(q[i:i + 1].contiguous(), k, v, tables[i:i + 1], seq_lens[i:i + 1], one_row_each([0]), 0.125)
        assert torch.equal(alone[0], batch[i])
    three = kernel(q[:3].contiguous(), k, v, tables[:3], seq_lens[:3], one_row_each([0] * 3), 0.125)
    assert torch.equal(three, batch[:3])
