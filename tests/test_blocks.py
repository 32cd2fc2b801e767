"""Blocking, padding and the orthonormal DCT-II."""

import pytest
import torch

from hf_demo.compression import dct_matrix, decode, encode, from_blocks, plan, to_blocks


@pytest.mark.parametrize("n", [1, 2, 7, 29, 64, 256])
def test_dct_is_orthonormal(n):
    d = dct_matrix(n).double()
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)


def test_dct_matches_the_cosine_formula():
    d = dct_matrix(8).double()
    import math

    for k in range(8):
        for i in range(8):
            a = math.sqrt(1 / 8) if k == 0 else math.sqrt(2 / 8)
            assert abs(d[k, i].item() - a * math.cos(math.pi * (2 * i + 1) * k / 16)) < 1e-6


@pytest.mark.parametrize(
    "shape", [(), (1,), (5,), (64,), (100,), (128, 64), (130, 70), (3, 1000), (8, 4, 3, 3), (50257, 8)]
)
def test_round_trip(shape, device):
    torch.manual_seed(0)
    x = torch.randn(shape).to(device)
    layout = plan(tuple(shape), 64, 32)
    coeffs = encode(x, layout)
    assert coeffs.shape == (layout.nblocks, layout.bsize)
    torch.testing.assert_close(decode(coeffs, layout), x, atol=1e-5, rtol=1e-5)
    # orthonormal: energy preserved (padding adds zeros only)
    torch.testing.assert_close(coeffs.square().sum(), x.square().sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(5,), (100,), (130, 70), (688, 256), (3, 1000), (8, 4, 3, 3), (200, 129)])
def test_encode_and_decode_match_the_slow_per_block_transform(shape, device):
    """Each block's coefficients are ``D0 @ block @ D1.T`` and back (float64 reference, block by block)."""
    torch.manual_seed(1)
    x = torch.randn(shape).to(device)
    layout = plan(tuple(shape), 64, 32)
    d0, d1 = dct_matrix(layout.b0).double(), dct_matrix(layout.b1).double()
    blocks = to_blocks(x.cpu(), layout).double()
    grid = [(i, j) for i in range(layout.block_rows) for j in range(layout.block_cols)]
    expected = torch.stack([d0 @ blocks[i, j] @ d1.T for i, j in grid]).reshape(layout.nblocks, layout.bsize)
    coeffs = encode(x, layout)
    torch.testing.assert_close(coeffs.cpu().double(), expected, atol=1e-5, rtol=1e-5)
    back = torch.stack([d0.T @ c.view(layout.b0, layout.b1) @ d1 for c in coeffs.cpu().double()])
    back = from_blocks(back.view(layout.block_rows, layout.block_cols, layout.b0, layout.b1), layout)
    torch.testing.assert_close(decode(coeffs, layout).cpu().double(), back, atol=1e-5, rtol=1e-5)


def test_dct_matrix_is_cached_per_device_with_the_same_bits(device):
    d = dct_matrix(43, device)
    assert d.device == device and d.dtype == torch.float32 and dct_matrix(43, device) is d
    assert torch.equal(d.cpu(), dct_matrix(43))  # built once on the CPU, copied: the same matrix everywhere


def test_padding_round_trip_and_zero_fill():
    layout = plan((130, 67), 64, 32)  # neither has a divisor in [32, 64]: padded
    assert layout.padded and (layout.block_rows, layout.block_cols) == (3, 2)
    x = torch.randn(130, 67)
    blocks = to_blocks(x, layout)
    assert blocks.shape == (3, 2, 64, 64)
    dense = blocks.permute(0, 2, 1, 3).reshape(192, 128)
    assert dense[130:].abs().sum() == 0 and dense[:, 67:].abs().sum() == 0
    torch.testing.assert_close(from_blocks(blocks, layout), x, atol=0, rtol=0)


def test_a_divisor_of_at_least_half_the_chunk_is_used_else_padding():
    mlp = plan((688, 256), 64, 32)  # 688 = 16 x 43: the reference's blocking, no padding
    assert (mlp.b0, mlp.b1, mlp.block_rows, mlp.padded) == (43, 64, 16, False)
    vocab = plan((50257, 576), 64, 32)  # 50257 = 29 x 1733: no divisor in [32, 64]: padded, not 29-long blocks
    assert (vocab.b0, vocab.b1, vocab.block_rows, vocab.block_cols, vocab.padded) == (64, 64, 786, 9, True)


def test_small_and_scalar_tensors():
    scalar = plan((), 64, 32)
    assert (scalar.nblocks, scalar.bsize, scalar.k) == (1, 1, 1)  # sent whole
    vec = plan((10,), 64, 32)
    assert (vec.b0, vec.b1, vec.k) == (1, 10, 10)  # one block, all of it sent
    long = plan((200,), 64, 32)
    assert (long.b0, long.b1, long.nblocks, long.k) == (1, 50, 4, 32)
    conv = plan((8, 4, 3, 3), 64, 32)
    assert (conv.rows, conv.cols, conv.b0, conv.b1) == (8, 36, 8, 36)


def test_empty_parameter_is_rejected():
    with pytest.raises(ValueError, match="empty parameter"):
        plan((0, 5), 64, 32)
