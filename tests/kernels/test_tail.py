"""append_tail against its torch twin: the indexed write at each row's device tail length."""

import pytest
import torch
from kernel_data import fast_cases

from kvarn.kernels.tail import append_tail


def _twin(tail_k, tail_v, k, v, lengths, frozen, tile):
    tk, tv, n = tail_k.clone(), tail_v.clone(), lengths.clone()
    q = k.shape[2]
    for b in range(k.shape[0]):
        start = int(n[2, b]) - frozen * tile
        tk[b, :, start:start + q] = k[b].to(tk.dtype)
        tv[b, :, start:start + q] = v[b].to(tv.dtype)
        n[1, b] += frozen
        n[2, b] = start + q
    return tk, tv, n


@pytest.mark.parametrize("q,frozen", fast_cases([(1, 0), (1, 1), (3, 0), (3, 2)], fast=(0, 3)))
def test_append_tail_matches_the_indexed_write(q, frozen, kdevice):
    """Rows at different tail lengths, fp32 K/V from strided views into fp16 tails: the same tails
    and lengths as the twin, and nothing else of the tail written."""
    b, hk, r, d, tile = 3, 2, 40, 64, 8
    tail_k = torch.randn(b, hk, r, d, device=kdevice).half()
    tail_v = torch.randn(b, hk, r, d, device=kdevice).half()
    k = torch.randn(b, q, hk, d, device=kdevice).transpose(1, 2)  # [B, Hk, q, D], not contiguous
    v = torch.randn(b, q, hk, d, device=kdevice).transpose(1, 2)
    tails = torch.tensor([frozen * tile + 5, frozen * tile, frozen * tile + 20], dtype=torch.int32)
    lengths = torch.stack([torch.full((b,), 16, dtype=torch.int32), torch.tensor([4, 4, 7], dtype=torch.int32),
                           tails]).to(kdevice).contiguous()
    want_k, want_v, want_len = _twin(tail_k, tail_v, k, v, lengths, frozen, tile)
    append_tail(tail_k, tail_v, k, v, lengths, frozen, tile)
    assert torch.equal(tail_k, want_k) and torch.equal(tail_v, want_v)
    assert torch.equal(lengths, want_len)
    assert lengths[0].tolist() == [16] * b  # sink lengths are not the kernel's


def test_append_tail_never_writes_outside_the_tail(kdevice):
    """A device length at the end of its buffer: the token is not written past it (into the slot
    after row 0's tail in the underlying buffer here), and the length still advances as the host's
    does."""
    buf = torch.zeros(2, 1, 9, 64, device=kdevice).half()
    tail_k, tail_v = buf[:, :, :8], buf.clone()[:, :, :8]  # row 0's position 8 is row 0's slack slot
    k = torch.ones(2, 1, 1, 64, device=kdevice)
    lengths = torch.tensor([[0, 0], [0, 0], [8, 1]], dtype=torch.int32, device=kdevice)
    append_tail(tail_k, tail_v, k, k, lengths, 0, 8)
    assert buf[0, 0, 8].abs().sum() == 0 and buf[0, 0, :8].abs().sum() == 0
    assert torch.equal(buf[1, 0, 1], torch.ones(64, device=kdevice).half())
    assert lengths[2].tolist() == [9, 2]


def test_append_tail_errors(kdevice):
    tail = torch.zeros(2, 1, 8, 64, device=kdevice).half()
    k = torch.zeros(2, 1, 1, 64, device=kdevice)
    good = torch.zeros(3, 2, dtype=torch.int32, device=kdevice)
    with pytest.raises(ValueError, match="lengths must be contiguous int32 \\[3, 2\\], got torch.int64"):
        append_tail(tail, tail, k, k, good.long(), 0, 8)
    with pytest.raises(ValueError, match="k, v must be"):
        append_tail(tail, tail, k, k[:, :, :, :32], good, 0, 8)
    with pytest.raises(ValueError, match=r"same strides, got \(512, 512, 64, 1\) and \(1024, 1024, 64, 1\)"):
        append_tail(tail, torch.zeros(2, 1, 16, 64, device=kdevice).half()[:, :, :8], k, k, good, 0, 8)
    with pytest.raises(ValueError, match="frozen must be a tile count >= 0, got -1"):
        append_tail(tail, tail, k, k, good, -1, 8)
