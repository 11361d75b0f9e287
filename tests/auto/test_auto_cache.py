"""kvarn-auto inside ``model.generate`` on SmolLM2 (short prompts, small tiles)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvarn.cache import KVarNCache  # noqa: E402
from kvarn.auto import TRIAL_TILES  # noqa: E402
from kvarn.auto.layer import KVarNAutoLayer  # noqa: E402

G = S = 32
SMALL = dict(tile=G, sink_tokens=S)
LONG = ("A farmer has 17 sheep. All but 9 run away, then he buys twice as many as he has left. "
        "How many sheep does he have now? Explain each step of the reasoning carefully, then give the number. ") * 2
SHORT = "The capital of France is"


def _generate(model, tok, texts, cache, n=6):
    inputs = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return inputs, out[:, inputs["input_ids"].shape[1]:]


def test_decides_from_the_prompt_and_reports(smollm2):
    model, tok = smollm2
    before = model.config._attn_implementation
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    inputs, out = _generate(model, tok, [LONG], cache)
    assert out.shape == (1, 6)
    assert model.config._attn_implementation == before  # the capture is undone after the prefill
    flavours = cache.flavours()
    assert len(flavours) == 30 and all(f is not None and f[0]["decided"] for f in flavours.values())
    assert flavours[0][0]["prompt_tokens"] == inputs["input_ids"].shape[1]
    report = cache.memory_report()
    assert report["flavours"] == flavours and report["method"] == "kvarn-auto"
    layer = cache.layers[0]
    assert isinstance(layer, KVarNAutoLayer)
    assert torch.equal(layer.store.flavours.key_rotate.cpu(), layer.decision.flavours.key_rotate)
    # the spec's record size, whatever the flavour
    assert layer.store.bytes_per_tile_head() == cache.config.record_bytes(64)
    view = layer.view()  # what a fused reader gets: the frames of the stored tiles
    assert torch.equal(view.key_rotated, layer.store.flavours.key_rotate)
    assert torch.equal(view.value_rotated, layer.store.flavours.value_rotate)
    names = {n for f in flavours.values() for n in f[0]["heads"]}
    assert len(names) > 1  # SmolLM2's heads do not all choose the same


def test_left_padded_rows_decide_alone_and_short_prompts_wait_for_their_first_tile(smollm2):
    model, tok = smollm2
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    inputs, out = _generate(model, tok, [SHORT, LONG], cache)
    real = inputs["attention_mask"].sum(1).tolist()
    assert real[0] + 6 < S + G <= real[1]
    for f in cache.flavours().values():
        assert [r["decided"] for r in f] == [False, True] and [r["pending"] for r in f] == [True, False]
        assert f[0]["heads"] == ["kvarn"] * 3  # while it waits: the spec's method on every head
        assert f[0]["prompt_tokens"] == real[0] and f[1]["prompt_tokens"] == real[1]
        assert f[1]["decided_at"] == "prefill" and f[1]["queries"] == min(128, real[1] - S)
    # Generating on, the short row decides when its own first tile past the sink is frozen.
    n = S + G + 2 - real[0]
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    _generate(model, tok, [SHORT, LONG], cache, n=n)
    for i, f in cache.flavours().items():
        assert [r["decided_at"] for r in f] == ["first_tile", "prefill"]
        assert (f[0]["tokens"], f[0]["queries"], f[0]["prompt_tokens"]) == (S + G, G, real[0])
        assert cache.layers[i].store.counts[0] == 1


def test_without_the_model_every_layer_is_kvarn(smollm2, caplog):
    model, _ = smollm2
    with caplog.at_level("WARNING"):
        cache = KVarNCache(model.config, "kvarn-auto", "k2v2_g128", **SMALL)
    assert "cannot see the prefill's queries" in caplog.text
    k = torch.randn(1, 3, S + 2 * G + 3, 64)
    cache.update(k, k.clone(), 0)
    cache.freeze()
    assert cache.flavours()[0] == [{"decided": False, "decided_at": None, "prompt_tokens": 0, "tokens": 0,
                                    "queries": 0, "pending": False, "heads": ["kvarn"] * 3}]


def test_bad_construction(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="only meaningful for method 'kvarn-auto'"):
        from kvarn.auto import AutoSettings

        KVarNCache(model, "kvarn", auto=AutoSettings())


def test_decoded_cache_reads_the_same_tiles(smollm2):
    model, tok = smollm2
    _, plain = _generate(model, tok, [LONG], KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL), n=4)
    c = KVarNCache(model, "kvarn-auto", "k2v2_g128", decoded_cache=True, **SMALL)
    _, fast = _generate(model, tok, [LONG], c, n=4)
    assert torch.equal(plain, fast)
    k_stored, _ = c.layers[3].store.decode()
    assert c.layers[3].store.decoded_cache and k_stored.abs().sum() > 0
    c.layers[3].store.decoded_cache = False
    k_redecoded, _ = c.layers[3].store.decode()  # from the packed fields with the layer's flavours
    torch.testing.assert_close(k_stored, k_redecoded)


def test_beam_search_reorders_the_flavours(smollm2):
    model, tok = smollm2
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    inputs = tok([SHORT, LONG], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        model.generate(**inputs, past_key_values=cache, max_new_tokens=3, num_beams=2, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    for i, f in cache.flavours().items():
        assert [r["decided"] for r in f] == [False, False, True, True]  # beams follow their row
        layer = cache.layers[i]
        assert torch.equal(layer.store.flavours.key_rotate.cpu(), layer.decision.flavours.key_rotate)


def test_decode_twin_reads_the_layer_view_like_the_cache(smollm2):
    from kvarn.attention import decode_attention

    model, tok = smollm2
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    _generate(model, tok, [LONG], cache, n=4)
    checked = 0
    for layer in cache.layers[:6]:
        v = layer.view()
        if bool(v.key_rotated.all()) and bool(v.value_rotated.all()):
            continue  # only layers with some heads in the model frame test the flags
        checked += 1
        q = torch.randn(1, 9, 1, 64, generator=torch.Generator().manual_seed(layer.tile))
        out = decode_attention(q, v.sink_k, v.sink_v, v.tiles, v.tail_k, v.tail_v, v.config,
                               sink_lengths=v.sink_lengths, tile_counts=v.tile_counts, tail_lengths=v.tail_lengths,
                               fp_frame="model", key_rotated=v.key_rotated, value_rotated=v.value_rotated)
        k, val = layer._assemble()  # the cache's own read path, model frame
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(3, 1), val.double().repeat_interleave(3, 1))
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    assert checked >= 1


def _r3_prompt(tok, tokens=S + 3 * G + 20):
    """The bundled WikiText excerpt, cut to ``tokens`` tokens (the self-test needs S + 3G)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "kvarn" / "data" / "wikitext_excerpt.txt").read_text()
    return tok.decode(tok(text[:2000])["input_ids"][:tokens])


def test_rule_r3_self_tests_the_prompt_and_keeps_one_policy_per_row(smollm2):
    from kvarn.auto import POLICIES, AutoSettings

    model, tok = smollm2
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", auto=AutoSettings(rule="r3"), **SMALL)
    _generate(model, tok, [_r3_prompt(tok)], cache, n=2)  # generate asks the prefill for 1 logit
    rows = [f[0] for f in cache.flavours().values()]
    policy = rows[0]["policy"]
    assert policy in POLICIES and set(rows[0]["self_test_kl"]) == set(POLICIES)
    assert rows[0]["self_test_kl"][policy] == min(rows[0]["self_test_kl"].values())
    assert all(r["policy"] == policy and r["self_test_kl"] == rows[0]["self_test_kl"] for r in rows)
    for layer in cache.layers:
        wanted = layer.decision.rows[0].candidates[policy]
        assert torch.equal(layer.store.flavours.key_rotate[0].cpu(), wanted[0].cpu())
        assert torch.equal(layer.store.flavours.value_normalize[0].cpu(), wanted[3].cpu())
    # The same prompt through a plain forward with all logits, and with one: same self-test figures,
    # and the caller gets the logits it asked for.
    ids = tok(_r3_prompt(tok), return_tensors="pt")["input_ids"]
    for keep in (0, 1):
        c = KVarNCache(model, "kvarn-auto", "k2v2_g128", auto=AutoSettings(rule="r3"), **SMALL)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=c, use_cache=True, logits_to_keep=keep)
        assert out.logits.shape[1] == (ids.shape[1] if keep == 0 else 1)
        kl = c.flavours()[0][0]["self_test_kl"]
        assert kl == pytest.approx(rows[0]["self_test_kl"], rel=1e-3)


def test_rule_r3_falls_back_per_row_when_the_prompt_is_short(smollm2):
    from kvarn.auto import AutoSettings

    model, tok = smollm2
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", auto=AutoSettings(rule="r3"), **SMALL)
    inputs, _ = _generate(model, tok, [SHORT, LONG, _r3_prompt(tok)], cache, n=2)
    real = inputs["attention_mask"].sum(1).tolist()
    assert real[0] < S + G <= real[1] < S + 3 * G <= real[2]
    for f in cache.flavours().values():
        assert f[0]["decided"] is False and "policy" not in f[0]  # too short to decide: KVarN
        assert f[1]["decided"] and f[1]["policy"] == "a2" and f[1]["self_test_kl"] is None
        assert f[2]["self_test_kl"] is not None
    alone = KVarNCache(model, "kvarn-auto", "k2v2_g128", auto=AutoSettings(rule="r3"), **SMALL)
    _generate(model, tok, [_r3_prompt(tok)], alone, n=1)  # the padded row self-tests on its own tokens
    # Padded batched attention differs from the row alone by fp32 rounding, which can move a code
    # across a rounding boundary: the figures agree to about 1%, not bit for bit.
    padded, single = cache.flavours()[0][2], alone.flavours()[0][0]
    assert padded["self_test_kl"] == pytest.approx(single["self_test_kl"], rel=2e-2)


def test_the_prompts_tiles_from_the_trial_are_the_encoded_tiles(smollm2, monkeypatch):
    """The first freeze stores the decision's trial encodings of the prompt (and encodes the
    tiles past the trial): the same bits as encoding the tiles again, row by row of a left-padded
    batch whose longer row has more tiles than the trial."""
    model, tok = smollm2
    texts = [LONG * 2, LONG]
    known = KVarNAutoLayer._known_encoding
    used = []

    def spy(self, rows, keys, values):
        enc = known(self, rows, keys, values)
        used.append(enc is not None)
        return enc

    def stored(cache):
        _generate(model, tok, texts, cache, n=2)
        assert cache.layers[0].store.counts[0] > TRIAL_TILES  # the long row has tiles past the trial
        return [la.store.fields for la in cache.layers]

    monkeypatch.setattr(KVarNAutoLayer, "_known_encoding", spy)
    reused = stored(KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL))
    assert used[0] and sum(used) == 30  # each layer's prompt freeze, not the later ones
    monkeypatch.setattr(KVarNAutoLayer, "_known_encoding", lambda self, rows, keys, values: None)
    encoded = stored(KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL))
    for a, b in zip(reused, encoded):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_prompt_shorter_than_the_sink_decides_at_the_first_generated_tile(smollm2, monkeypatch):
    """A 6-token prompt (S = G = 32): generated tokens complete the first tile past the sink; the
    decision is made when the freeze stores it, from the queries of those generated tokens, which are
    those an exact prefill of the same 64 tokens computes (so is the decision, up to rounding)."""
    import kvarn.auto.layer as cache_auto

    model, tok = smollm2
    before = model.config._attn_implementation
    seen = {"first_tile": [], "prefill": []}
    observed = []
    for name, key in (("decide_first_tile", "first_tile"), ("decide_row", "prefill")):
        fn = getattr(cache_auto, name)

        def spy(q, k, v, *a, fn=fn, key=key, **kw):
            seen[key].append((q.clone(), k.clone(), v.clone()))
            return fn(q, k, v, *a, **kw)
        monkeypatch.setattr(cache_auto, name, spy)
    observe = KVarNAutoLayer.observe

    def counted(self, q, scaling=None):  # the forwards that ran the capture, seen by layer 0
        if self is cache.layers[0]:
            observed.append(q.shape[2])
        return observe(self, q, scaling)

    monkeypatch.setattr(KVarNAutoLayer, "observe", counted)
    cache = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    ids = tok([SHORT], return_tensors="pt")["input_ids"]
    p = ids.shape[1]
    n = S + G + 8 - p  # the tile is complete at S + G tokens, frozen at the next step
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    assert model.config._attn_implementation == before
    assert len(seen["first_tile"]) == 30 and not seen["prefill"]
    flavours = cache.flavours()
    for i, f in flavours.items():
        assert f[0]["decided"] and f[0]["decided_at"] == "first_tile" and not f[0]["pending"]
        assert (f[0]["tokens"], f[0]["queries"], f[0]["prompt_tokens"]) == (S + G, G, p)
        layer = cache.layers[i]
        assert layer.store.counts == [1] and not layer.wants_queries
        assert torch.equal(layer.store.flavours.key_rotate.cpu(), layer.decision.flavours.key_rotate)
    # The capture ran until the step that froze the tile, not after: decode steps are untouched again.
    assert len(observed) == S + G + 1 - p + 1 < n
    # The same 64 tokens as one prompt: the same queries, keys and values, the same scores.
    exact = KVarNCache(model, "kvarn-auto", "k2v2_g128", **SMALL)
    with torch.no_grad():
        model(input_ids=out[:, :S + G], past_key_values=exact, use_cache=True)
    assert len(seen["prefill"]) == 30
    for (q, k, v), (qe, ke, ve) in zip(seen["first_tile"], seen["prefill"]):
        assert q.shape == qe.shape and k[:, :S + G].shape == ke.shape
        torch.testing.assert_close(q, qe, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(k[:, :S + G], ke, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v[:, :S + G], ve, atol=2e-4, rtol=1e-4)
    # Rounding differences can move a trial code across a boundary: the scores agree to about 1%.
    for i, f in exact.flavours().items():
        got, want = cache.layers[i].decision.rows[0], exact.layers[i].decision.rows[0]
        torch.testing.assert_close(got.key_logit_error, want.key_logit_error, rtol=3e-2, atol=1e-6)
        torch.testing.assert_close(got.value_output_error, want.value_output_error, rtol=3e-2, atol=1e-6)
