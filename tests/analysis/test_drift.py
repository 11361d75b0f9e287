import math

import pytest
import torch

from kvarn.analysis import MethodSpec, free_run, parse_specs, pseudo_decode


def test_fp16_has_zero_error(tiny_llama, tiny_ids):
    # Run fp16 through the quantizing cache for real rather than reusing the shadow.
    run = pseudo_decode(tiny_llama, tiny_ids, [MethodSpec("fp16", "k2v2_g64")], reuse_shadow_for_fp16=False,
                        progress=False)
    r = run.methods["fp16:k2v2_g64"]
    assert run.positions == [64, 128, 192, 256]
    for per_layer in (r.static_mae_layers, r.accumulated_mae_layers, r.accumulated_k_rel_layers,
                      r.accumulated_v_rel_layers):
        assert all(x == 0.0 for row in per_layer for x in row)
    assert all(x == 0.0 for x in r.kl) and all(x == 1.0 for x in r.top1_agreement)
    assert math.isclose(r.perplexity, run.fp_perplexity, rel_tol=1e-6)


def test_lossy_methods_have_error_after_the_sink(tiny_llama, tiny_ids):
    specs = parse_specs(["kivi", "kvarn", "fp8"], ["k2v2_g64"])
    run = pseudo_decode(tiny_llama, tiny_ids, specs, progress=False)
    for spec in specs:
        r = run.methods[spec.key]
        static = [sum(col) / len(col) for col in zip(*r.static_mae_layers)]
        # Chunk 0 is the sink, chunk 1 attends to the sink only; later chunks see quantized tiles.
        assert static[0] == 0.0 and static[1] == 0.0
        assert all(x > 0 for x in static[2:])
        assert r.k_decomposition["tokens"] == 3 * 64 * 2 * 3  # 3 tiles x 64 tokens x 2 heads x 3 layers
    assert run.methods["fp8:k2v2_g64"].kl[-1] < run.methods["kivi:k2v2_g64"].kl[-1]


def test_accumulated_at_least_static_when_only_the_first_layer_is_quantized(tiny_llama, tiny_ids):
    # Layer 0 sees identical inputs in both regimes, so its errors agree; layers 1-2 are not quantized,
    # so their static error is exactly 0 while the accumulated regime carries layer 0's error into them.
    run = pseudo_decode(tiny_llama, tiny_ids, [MethodSpec("kivi", "k2v2_g64")], layers=[0], progress=False)
    r = run.methods["kivi:k2v2_g64"]
    assert r.quantized_layers == [0]
    torch.testing.assert_close(torch.tensor(r.accumulated_mae_layers[0]), torch.tensor(r.static_mae_layers[0]),
                               rtol=1e-4, atol=1e-7)
    for layer in (1, 2):
        assert all(x == 0.0 for x in r.static_mae_layers[layer])
        assert all(x > 0 for x in r.accumulated_mae_layers[layer][2:])
    static = [sum(c) for c in zip(*r.static_mae_layers)]
    acc = [sum(c) for c in zip(*r.accumulated_mae_layers)]
    assert all(a >= s for a, s in zip(acc, static)) and acc[-1] > static[-1]


def test_chunk_smaller_than_tile_quantizes_only_finished_tiles(tiny_llama, tiny_ids):
    run = pseudo_decode(tiny_llama, tiny_ids[:, :192], [MethodSpec("kivi", "k2v2_g64")], chunk=32, progress=False)
    r = run.methods["kivi:k2v2_g64"]
    assert run.positions == list(range(32, 193, 32))
    static = [sum(c) for c in zip(*r.static_mae_layers)]
    # Tile 1 (tokens 64-127) is frozen after the chunk ending at 128; only chunks from 128 on see it.
    assert all(x == 0.0 for x in static[:4]) and all(x > 0 for x in static[4:])


def test_sliding_window_layers_stay_full_precision():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, sliding_window=80, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 256))
    run = pseudo_decode(model, ids, [MethodSpec("kvarn", "k2v2_g64")], progress=False)
    r = run.methods["kvarn:k2v2_g64"]
    assert run.sliding_layers == [0, 2] and r.quantized_layers == [1]
    assert all(x == 0.0 for layer in (0, 2) for x in r.static_mae_layers[layer])
    assert all(x > 0 for x in r.static_mae_layers[1][2:])
    assert all(x > 0 for x in r.accumulated_mae_layers[2][2:])  # error reaches later sliding layers


def test_free_run(tiny_llama, tiny_ids):
    specs = [MethodSpec("fp16", "k2v2_g64"), MethodSpec("rtn", "k2v2_g64")]
    ref, runs = free_run(tiny_llama, tiny_ids[:, :160], specs, n_tokens=40, progress=False)
    assert len(ref) == 40
    fp = runs["fp16:k2v2_g64"]
    assert fp.tokens == ref and fp.first_divergence is None and fp.agreement == 1.0
    assert max(fp.kl) == 0.0
    lossy = runs["rtn:k2v2_g64"]
    assert len(lossy.kl) == 40 and len(lossy.tokens) == 40
    # The prompt's tiles are quantized after prefill, so every generated position sees them.
    assert min(lossy.kl[1:]) > 0


def test_ranges_run_each_method_with_kvarn_autos_or_min_max_ranges(tiny_llama, tiny_ids):
    specs = parse_specs(["kivi", "kvarn-auto"], ["k2v2_g64"], ranges=[None, "auto", "minmax"])
    assert [s.key for s in specs] == ["kivi:k2v2_g64", "kivi+q:k2v2_g64", "kivi+minmax:k2v2_g64",
                                      "kvarn-auto:k2v2_g64", "kvarn-auto+q:k2v2_g64", "kvarn-auto+minmax:k2v2_g64"]
    run = pseudo_decode(tiny_llama, tiny_ids, specs, progress=False)
    q = {k: m.quantiles for k, m in run.methods.items()}
    assert q["kivi:k2v2_g64"] == q["kivi+minmax:k2v2_g64"] == q["kvarn-auto+minmax:k2v2_g64"] == (0.0, 0.0)
    assert q["kivi+q:k2v2_g64"] == q["kvarn-auto:k2v2_g64"] == (0.03, 0.03)
    m = run.methods
    assert m["kivi:k2v2_g64"].kl == m["kivi+minmax:k2v2_g64"].kl != m["kivi+q:k2v2_g64"].kl
    assert m["kvarn-auto:k2v2_g64"].kl == m["kvarn-auto+q:k2v2_g64"].kl != m["kvarn-auto+minmax:k2v2_g64"].kl


def test_bad_inputs(tiny_llama, tiny_ids):
    with pytest.raises(ValueError, match="unknown method"):
        MethodSpec("nope", "k2v2_g64")
    with pytest.raises(ValueError, match="ranges='clip'"):
        MethodSpec("kivi", "k2v2_g64", ranges="clip")
    with pytest.raises(ValueError, match="input_ids"):
        pseudo_decode(tiny_llama, tiny_ids[0], [MethodSpec("kivi", "k2v2_g64")], progress=False)
    with pytest.raises(ValueError, match="layers"):
        pseudo_decode(tiny_llama, tiny_ids, [MethodSpec("kivi", "k2v2_g64")], layers=[7], progress=False)


def test_kvarn_auto_decides_from_the_prefill(tiny_llama, tiny_ids):
    specs = parse_specs(["kvarn", "kvarn-auto"], ["k2v2_g64"], auto_rules=["a2", "a3"])
    # a2 is the default rule: its key has no suffix
    assert [s.key for s in specs] == ["kvarn:k2v2_g64", "kvarn-auto:k2v2_g64", "kvarn-auto-a3:k2v2_g64"]
    run = pseudo_decode(tiny_llama, tiny_ids, specs, prefill=192, progress=False)
    assert run.positions == [192, 256] and run.prefill == 192 and run.chunk_targets == [192, 63]
    diag = run.prompt_diagnostics["k2v2_g64"]
    assert sorted(diag) == [0, 1, 2]
    for d in diag.values():  # per KV head: rotated / unrotated key logit error and the correlation
        assert len(d["key_logit_error_rotated"]) == 2 and len(d["log_key_variance_vs_log_query_energy_corr"]) == 2
        assert all(x > 0 for x in d["key_logit_error_rotated"] + d["key_logit_error_unrotated"])
    for key in ("kvarn-auto:k2v2_g64", "kvarn-auto-a3:k2v2_g64"):
        r = run.methods[key]
        assert sorted(r.decisions) == [0, 1, 2] and all(d["decided"] for d in r.decisions.values())
        assert r.kl[0] == 0.0 and r.kl[1] > 0  # the prefill is exact, the next chunk reads quantized tiles
    # rule a2's key choices are the argmin of its own scores (ties to KVarN), which are taken with
    # kvarn-auto's 2-bit ranges: not the diagnostics' (the spec's min/max ranges)
    a2 = run.methods["kvarn-auto:k2v2_g64"].decisions
    assert all(a2[i]["key_rotate"] == [e[0] <= e[1] for e in a2[i]["key_logit_error"]] for i in diag)
    assert any(a2[i]["key_logit_error_rotated"] != diag[i]["key_logit_error_rotated"] for i in diag)
    assert run.methods["kvarn:k2v2_g64"].decisions is None


def test_rule_r3_runs_the_policy_it_picked(tiny_llama, tiny_ids):
    """The self-test's policy, then the same run as that policy's own rule (KVarN, a2 or a3)."""
    from kvarn.auto import POLICIES

    ids = torch.cat([tiny_ids, tiny_ids[:, :64]], dim=1)  # 320: a 256-token prefill (S + 3G) and a chunk
    specs = [MethodSpec("kvarn", "k2v2_g64")] + [MethodSpec("kvarn-auto", "k2v2_g64", r) for r in ("a2", "a3", "r3")]
    assert specs[1].key == "kvarn-auto:k2v2_g64" and specs[-1].key == "kvarn-auto-r3:k2v2_g64"  # a2: the default
    run = pseudo_decode(tiny_llama, ids, specs, prefill=256, progress=False)
    r3 = run.methods["kvarn-auto-r3:k2v2_g64"]
    policies = {d["policy"] for d in r3.decisions.values()}
    assert len(policies) == 1 and r3.auto_rule == "r3"
    policy = policies.pop()
    kl = r3.decisions[0]["self_test_kl"]
    assert set(kl) == set(POLICIES) and kl[policy] == min(kl.values())
    own_key = {"kvarn": "kvarn:k2v2_g64", "a2": "kvarn-auto:k2v2_g64", "a3": "kvarn-auto-a3:k2v2_g64"}
    same = run.methods[own_key[policy]]
    assert r3.kl == pytest.approx(same.kl, rel=1e-5, abs=1e-8)
    short = pseudo_decode(tiny_llama, tiny_ids, specs[-1:], prefill=192, progress=False)  # < S + 3G
    assert {d["policy"] for d in short.methods["kvarn-auto-r3:k2v2_g64"].decisions.values()} == {"a2"}


def test_kvarn_auto_free_run_uses_the_prompt(tiny_llama, tiny_ids):
    specs = [MethodSpec("kvarn", "k2v2_g64"), MethodSpec("kvarn-auto", "k2v2_g64")]
    _, runs = free_run(tiny_llama, tiny_ids[:, :160], specs, n_tokens=8, progress=False)
    assert min(runs["kvarn-auto:k2v2_g64"].kl[1:]) > 0


def test_rule_needs_kvarn_auto():
    with pytest.raises(ValueError, match="only meaningful for method 'kvarn-auto'"):
        MethodSpec("kvarn", "k2v2_g64", rule="a3")
    with pytest.raises(ValueError, match="rule"):
        MethodSpec("kvarn-auto", "k2v2_g64", rule="a7")


def test_chunks_after_a_short_prefill_end_on_tile_boundaries():
    from kvarn.analysis.drift import chunk_bounds

    assert chunk_bounds(256, 64, 40) == [(0, 40), (40, 64), (64, 128), (128, 192), (192, 256)]
    assert chunk_bounds(256, 64, 192) == [(0, 192), (192, 256)]
    assert chunk_bounds(250, 64) == [(0, 64), (64, 128), (128, 192), (192, 250)]


def test_kvarn_auto_decides_at_the_first_tile_after_a_prefill_shorter_than_the_sink(tiny_llama, tiny_ids):
    """A 40-token first pass (S = G = 64) holds no tile past the sink: kvarn-auto decides when the pass
    that completes tokens 64-127 has run, from those 128 tokens, before the tile is frozen; so from
    there on the run is the one that decided from a 128-token prefill of the same tokens."""
    specs = [MethodSpec("kvarn-auto", "k2v2_g64")]
    late = pseudo_decode(tiny_llama, tiny_ids, specs, prefill=40, progress=False)
    assert late.positions == [40, 64, 128, 192, 256]
    ref = pseudo_decode(tiny_llama, tiny_ids, specs, prefill=128, progress=False)
    got, want = late.methods["kvarn-auto:k2v2_g64"], ref.methods["kvarn-auto:k2v2_g64"]
    assert sorted(got.decisions) == [0, 1, 2]
    for i, d in got.decisions.items():
        assert d["decided"] and d["decided_at"] == "first_tile" and want.decisions[i]["decided_at"] == "prefill"
        assert (d["tokens"], d["queries"], d["prompt_tokens"]) == (128, 64, 40)
        for name in ("key_rotate", "key_normalize", "value_rotate", "value_normalize"):
            assert d[name] == want.decisions[i][name], (i, name)
        # the queries come from three passes here and one there: equal up to float rounding
        assert sum(d["key_logit_error"], []) == pytest.approx(sum(want.decisions[i]["key_logit_error"], []), rel=1e-4)
    assert got.kl[:3] == [0.0, 0.0, 0.0]  # nothing quantized before the first tile is frozen
    assert got.kl[3:] == pytest.approx(want.kl[1:], rel=1e-3) and got.kl[3] > 0
