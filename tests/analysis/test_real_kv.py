"""The paper's diagnosis on real KV of the bundled SmolLM2: KVarN fixes the token scales.

Measured on 1024 WikiText-2 tokens (30 layers, 3 KV heads, D=64) at k2v2_g128:
KVarN max relative key-norm error 0.22 vs plain per-channel RTN (KIVI) 1.54; mean over the worst 5%
of tokens 0.116 vs 0.175. At 4 bits: max 0.037 vs 0.076. The margins below leave room for the
shorter 512-token excerpt used here.
"""

import torch

from kvarn import KVarNConfig, dequantize_kv, quantize_kv
from kvarn.analysis.reconstruction import reconstruction_report, sqnr_db


def _summary(kv, method, preset):
    rows = reconstruction_report(kv, method, KVarNConfig.from_name(preset))
    return {
        "k_max": max(r["k_norm_err_max"] for r in rows),
        "k_top5": sum(r["k_norm_err_top5"] for r in rows) / len(rows),
        "k_sqnr": sum(r["k_sqnr_db"] for r in rows) / len(rows),
        "v_sqnr": sum(r["v_sqnr_db"] for r in rows) / len(rows),
    }


def test_kvarn_worst_token_norm_error_well_below_per_channel_rtn(smollm2_kv):
    kvarn = _summary(smollm2_kv, "kvarn", "k2v2_g128")
    rtn = _summary(smollm2_kv, "kivi", "k2v2_g128")  # plain per-channel K / per-token V RTN
    assert kvarn["k_max"] < 0.4 * rtn["k_max"], (kvarn, rtn)
    assert kvarn["k_top5"] < 0.85 * rtn["k_top5"], (kvarn, rtn)
    # Values: normalization + rotation also help per-token V at 2 bits.
    assert kvarn["v_sqnr"] > rtn["v_sqnr"] + 0.5, (kvarn, rtn)


def test_real_kv_sqnr_floors(smollm2_kv):
    k2 = _summary(smollm2_kv, "kvarn", "k2v2_g128")
    k4 = _summary(smollm2_kv, "kvarn", "k4v4_g128")
    assert k2["k_sqnr"] > 9.0 and k2["v_sqnr"] > 6.0, k2
    assert k4["k_sqnr"] > 22.0 and k4["v_sqnr"] > 18.0, k4


def test_real_kv_record_roundtrip_is_exact(smollm2_kv):
    from kvarn import QuantizedKV

    k, v = smollm2_kv[3]
    cfg = KVarNConfig.from_name("k4v2_g64")
    q = quantize_kv(k, v, cfg)
    back = QuantizedKV.from_records(q.to_records(), cfg, k.shape[-1], k.dtype)
    assert torch.equal(dequantize_kv(back)[0], dequantize_kv(q)[0])
    assert sqnr_db(k, dequantize_kv(q)[0]) > 20
