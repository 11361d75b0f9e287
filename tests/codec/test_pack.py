import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.codec.pack import pack_codes, unpack_codes


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 9), groups=st.integers(1, 40), seed=st.integers(0, 999))
def test_roundtrip_bit_exact(bits, rows, groups, seed):
    cols = groups * (8 // bits)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, cols * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_layout_low_bits_first():
    c4 = torch.tensor([[0x1, 0x2, 0xA, 0xF]], dtype=torch.uint8)
    assert pack_codes(c4, 4).tolist() == [[0x21, 0xFA]]  # even index in the low nibble
    c2 = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]], dtype=torch.uint8)
    assert pack_codes(c2, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 0xFF]]
    c8 = torch.tensor([[7, 200]], dtype=torch.uint8)
    assert pack_codes(c8, 8).tolist() == [[7, 200]]


def test_batched_leading_dims():
    codes = torch.randint(0, 4, (2, 3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, 2)
    assert packed.shape == (2, 3, 5, 16)
    assert torch.equal(unpack_codes(packed, 2), codes)


def test_errors():
    with pytest.raises(ValueError, match="bits=3"):
        pack_codes(torch.zeros(1, 8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(torch.zeros(1, 6, dtype=torch.uint8), 2)
