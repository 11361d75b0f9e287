"""The paged kernels (vLLM's layout) against their torch twins in :mod:`kvarn.paged`.

Records are bit for bit the twin's where the kernel's arithmetic is the encoder's (the encoder's
own tests bound the rare tie); attention meets ``err(kernel) <= 2 * err(torch in fp16) + atol``
against the float32 twin, the bound of the other kernel tests.
"""

import pytest
import torch
from kernel_data import fast_cases

from kvarn import PRESETS
from kvarn import paged as twin
from kvarn.codec.hadamard import rotate
from kvarn.codec import decode_tiles
from kvarn.codec.record import record_field_views, store_records

kernels = pytest.importorskip("kvarn.kernels")
from kvarn.kernels.decode import paged_decode_attention  # noqa: E402
from kvarn.kernels.encode import encode_into_pages  # noqa: E402


def _rows(n, hk, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hk, d, generator=g) * (1 + 3 * torch.rand(1, 1, d, generator=g))  # channel outliers
    return x.to(device)


@pytest.mark.parametrize("preset", fast_cases(["k4v2_g64", "k2v2_g64"]))
@pytest.mark.parametrize("rotate_in_kernel", [False, True])
def test_encode_into_pages_is_the_encoder_at_indexed_rows(kdevice, preset, rotate_in_kernel):
    """Bit for bit the tile encoder's records for the same tiles (the same arithmetic), at the
    pages named; pages with no tile (-1) untouched; decoded, within the twin's rounding."""
    cfg = PRESETS[preset]
    hk, d, g = 2, 64, cfg.tile
    k, v = _rows(4 * g, hk, d, kdevice, 1), _rows(4 * g, hk, d, kdevice, 2)
    src = torch.tensor([0, 2 * g, g + 5, 3 * g], dtype=torch.int32, device=kdevice)
    dst = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=kdevice)  # -1: no tile there
    got = torch.full((6, hk, cfg.record_bytes(d)), 7, dtype=torch.uint8, device=kdevice)
    encode_into_pages(k, v, src, got, dst, cfg, rotate=rotate_in_kernel)
    assert (got[[1, 2, 4]] == 7).all()  # untouched pages stay as they were
    keep = [0, 2, 3]
    idx = src[keep].long()[:, None] + torch.arange(g, device=kdevice)
    kt = k[idx].permute(0, 2, 3, 1)  # [C, Hk, D, G]
    vt = v[idx].permute(0, 2, 1, 3)  # [C, Hk, G, D]
    fields = kernels.encode_tiles(kt, vt, cfg, rotate=True if rotate_in_kernel else None)
    assert torch.equal(got[dst[keep].long()], store_records(fields, cfg, d))
    # The twin's records: the encoder's own tests bound code flips and scale ulps (reduction order);
    # here the decoded tiles agree to a small fraction of the quantization step.
    want = torch.full_like(got.cpu(), 7)
    twin.encode_into_pages(k.cpu(), v.cpu(), src.cpu(), want, dst.cpu(), cfg, rotate=rotate_in_kernel)
    pages = dst[keep].long().cpu()
    a = decode_tiles(record_field_views(got.cpu()[pages], cfg, d), cfg)
    b = decode_tiles(record_field_views(want[pages], cfg, d), cfg)
    for x, y in zip(a, b):
        assert (x - y).abs().mean() <= 0.02 * y.abs().mean()


def _paged_case(device, cfg, hq=4, hk=2, d=64, rows=5, seed=0):
    g, s = cfg.tile, cfg.tile
    torch.manual_seed(seed)
    slots_total, length = rows + 2, s + g + 16
    stage_k = rotate(torch.randn(slots_total, length, hk, d)).to(device)
    stage_v = rotate(torch.randn(slots_total, length, hk, d)).to(device)
    nb, width = 24, 8
    pages = torch.zeros(nb, hk, cfg.record_bytes(d), dtype=torch.uint8, device=device)
    kr = rotate(torch.randn(nb * g, hk, d)).to(device)
    vr = rotate(torch.randn(nb * g, hk, d)).to(device)
    idx = torch.arange(nb, dtype=torch.int32, device=device)
    twin.encode_into_pages(kr, vr, idx * g, pages, idx, cfg)
    perm = torch.randint(0, nb, (rows, width), dtype=torch.int32).to(device)
    counts = torch.tensor([0, 1, 3, 6, 7], dtype=torch.int32)[:rows].to(device)
    sink_len = torch.tensor([5, s, s, s, s], dtype=torch.int32)[:rows].to(device)
    tail_len = torch.tensor([0, 1, g, g + 16, 17], dtype=torch.int32)[:rows].to(device)
    slots = torch.tensor([3, 0, 6, 1, 4], dtype=torch.int32)[:rows].to(device)
    q = torch.randn(rows, hq, d).to(device)
    return q, stage_k, stage_v, slots, sink_len, tail_len, pages, perm, counts


@pytest.mark.parametrize("preset,plan_rows", [("k4v2_g64", None), ("k2v2_g64", None), ("k4v2_g64", 512)])
def test_paged_decode_matches_twin(kdevice, preset, plan_rows):
    # plan_rows: the launch planned as for many rows (fewer splits, no fp split of its own) reads the same
    cfg = PRESETS[preset]
    q, sk, sv, slots, sl, tl_, pages, bt, counts = _paged_case(kdevice, cfg)
    kw = dict(sink_tokens=cfg.tile, max_tiles=7)
    got = paged_decode_attention(q, sk, sv, slots, sl, tl_, pages, bt, counts, cfg, plan_rows=plan_rows,
                                 **kw).float().cpu()
    args = [x.cpu() for x in (q, sk, sv, slots, sl, tl_, pages, bt, counts)]
    ref = twin.paged_decode_attention(*args, cfg, **kw)
    ref16 = twin.paged_decode_attention(args[0].half(), args[1].half(), args[2].half(), *args[3:], cfg, **kw)
    err_kernel = (got - ref).abs().max().item()
    err_torch16 = (ref16.float() - ref).abs().max().item()
    assert err_kernel <= 2 * err_torch16 + 1e-3, (err_kernel, err_torch16)
    # A row with 0 tiles sees only its sink: the records it does not own change nothing.
    assert torch.isfinite(got).all()


def test_paged_decode_row_without_keys_is_zero(kdevice):
    cfg = PRESETS["k4v2_g64"]
    q, sk, sv, slots, sl, tl_, pages, bt, counts = _paged_case(kdevice, cfg)
    sl, tl_, counts = torch.zeros_like(sl), torch.zeros_like(tl_), torch.zeros_like(counts)
    got = paged_decode_attention(q, sk, sv, slots, sl, tl_, pages, bt, counts, cfg, sink_tokens=cfg.tile, max_tiles=7)
    assert torch.equal(got.cpu(), torch.zeros_like(got.cpu()))


def test_paged_decode_refuses_bad_lengths_dtype(kdevice):
    cfg = PRESETS["k4v2_g64"]
    q, sk, sv, slots, sl, tl_, pages, bt, counts = _paged_case(kdevice, cfg)
    with pytest.raises(ValueError, match="plan_rows=2 must be at least the 5 query rows"):
        paged_decode_attention(q, sk, sv, slots, sl, tl_, pages, bt, counts, cfg, sink_tokens=cfg.tile, max_tiles=7,
                               plan_rows=2)
    with pytest.raises(ValueError, match="tile_counts must be int32"):
        paged_decode_attention(q, sk, sv, slots, sl, tl_, pages, bt, counts.long(), cfg, sink_tokens=cfg.tile,
                               max_tiles=7)
