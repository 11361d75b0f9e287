import pytest
import torch

from kvarn.analysis.errors import DecompositionAccumulator, decompose_error, kl_and_top1, worst_fraction_summary
from kvarn.config import KVarNConfig
from kvarn.methods import TileCodec


def test_decomposition_parts_sum_to_total_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 16, generator=g) * torch.rand(2, 3, 50, 1, generator=g) * 5
    x_hat = x + 0.3 * torch.randn(x.shape, generator=g)
    mag, dirn, nsq = decompose_error(x, x_hat)
    total = ((x.double() - x_hat.double()) ** 2).sum(-1)
    torch.testing.assert_close(mag + dirn, total, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nsq, (x.double() ** 2).sum(-1))
    assert (mag >= 0).all() and (dirn >= 0).all()


@pytest.mark.parametrize("method", ["kivi", "kvarn", "rtn"])
def test_decomposition_on_codec_roundtrip(method):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 128, 64, generator=g) * torch.linspace(0.1, 4, 128)[:, None]
    kq, _ = TileCodec(method, KVarNConfig.from_name("k2v2_g64")).roundtrip(k, k)
    mag, dirn, _ = decompose_error(k, kq)
    torch.testing.assert_close(mag + dirn, ((k.double() - kq.double()) ** 2).sum(-1), rtol=1e-9, atol=1e-9)


def test_pure_scale_error_is_all_magnitude_and_rotation_all_direction():
    x = torch.randn(10, 8)
    mag, dirn, _ = decompose_error(x, 1.5 * x)
    assert dirn.max() < 1e-9 and mag.min() > 0
    x_hat = torch.roll(x, 1, dims=-1)  # same norm, other direction
    mag, dirn, _ = decompose_error(x, x_hat)
    assert mag.max() < 1e-9


def test_worst_fraction_and_accumulator():
    mag = torch.tensor([0.0, 0.0, 0.0, 10.0] + [0.1] * 16, dtype=torch.float64)
    dirn = torch.tensor([1.0] * 20, dtype=torch.float64)
    s = worst_fraction_summary(mag, dirn, 0.05)
    assert s["magnitude_top"] == 10.0 and s["direction_top"] == 1.0 and s["tokens"] == 20
    acc = DecompositionAccumulator()
    x = torch.randn(1, 2, 20, 8)
    acc.add(0, x, x * 1.1)
    m, d, layers = acc.normalized()
    assert m.numel() == 40 and (layers == 0).all() and d.max() < 1e-9


def test_kl_zero_for_identical_logits():
    logits = torch.randn(5, 11)
    kl, top1 = kl_and_top1(logits, logits.clone())
    assert kl.abs().max() < 1e-6 and top1.all()
    kl2, _ = kl_and_top1(logits, logits + torch.randn(5, 11))
    assert (kl2 > 0).all()
