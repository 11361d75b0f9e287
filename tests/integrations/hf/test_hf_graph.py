"""Host-free decode steps of the fused path and the CUDA-graph decode loop (kvarn.integrations.transformers.graph).

On CPU the kernels run under triton's interpreter and CUDA graphs do not exist: the loop's
"simulate" mode replays each step with the host lengths of capture time, which gives wrong tokens if
the step takes any position from the host. The real capture runs in test_hf_graph_gpu.py.
"""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
pytest.importorskip("kvarn.kernels", reason="triton is not importable")

from kvarn import KVarNCache  # noqa: E402
from kvarn.integrations.transformers import freeze_schedule, fused_layer, attention as hf_attention, graph as hf_graph  # noqa: E402
HAS_CUDA = torch.cuda.is_available()

PRESET = dict(preset="k4v2_g64", sinkhorn_iters=2)  # S = G = 64
PROMPT, NEW = 124, 7  # first decode step: sink 64, tail 61; the 5th step freezes a tile


def _tiny_llama(device, dtype, layers=2):
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        eos_token_id=None,  # decode_greedy never stops early; generate must not either
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


@pytest.fixture
def fused_model(kdevice):
    model = _tiny_llama(kdevice, torch.float16 if HAS_CUDA else torch.float32)
    hf_attention.use_fused(model)
    yield model
    model.set_attn_implementation("sdpa")


def _fused(model, **kw):
    return hf_attention.fused_cache(model, PRESET["preset"], sinkhorn_iters=PRESET["sinkhorn_iters"], **kw)


def test_decode_loop_matches_generate_and_reference(fused_model, kdevice):
    model = fused_model
    ids = torch.randint(0, 97, (2, PROMPT), device=kdevice)
    kw = dict(max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=KVarNCache(model, "kvarn", **PRESET), **kw)
    hf_attention.use_fused(model)
    # Over the loop's reserved buffers: the same shapes give the same launch plan (other shapes sum
    # the splits in another order, which can flip a near tie in fp16 on a GPU).
    gen_cache = _fused(model, max_length=PROMPT + NEW)
    fused = model.generate(ids, past_key_values=gen_cache, **kw)
    runs = {}
    for mode in ("none", "simulate"):
        cache = _fused(model, max_length=PROMPT + NEW)
        runs[mode] = hf_graph.decode_greedy(model, cache, ids, NEW, capture=mode)
        layer = cache.layers[0]
        assert layer.store.counts == [1, 1]  # frozen during decoding, by the captured flush step
        assert layer.tail_len == [PROMPT + NEW - 1 - 2 * 64] * 2
        assert layer._dev_len.tolist() == [[64, 64], [1, 1], layer.tail_len]
        # The loop's flush started ahead of the forward (on a side stream on a GPU): the same bits
        # in the same slots as generate's flush inside the update.
        for a, b in zip(cache.layers, gen_cache.layers):
            for name, x in a.store.fields.items():
                assert torch.equal(x, b.store.fields[name]), name
    # The loop runs the same kernels as generate over the same state: identical tokens.
    assert torch.equal(runs["none"], fused.sequences[:, PROMPT:])
    assert torch.equal(runs["simulate"], fused.sequences[:, PROMPT:])
    # Against the cache's read path: the same tokens (fp16 on a GPU may split a near tie late, so
    # at least the first three) and close logits up to any divergence.
    same = (fused.sequences[:, PROMPT:] == ref.sequences[:, PROMPT:]).all(0).long().cumprod(0).sum()
    assert same >= (NEW if not HAS_CUDA else 3)
    for a, b in list(zip(fused.logits, ref.logits))[: int(same)]:
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fills", [False, True])
def test_decode_loop_encodes_in_the_step_that_completes_the_tile(kdevice, monkeypatch, fills):
    """decode_greedy spreads a freeze over two steps: of 6 layers, the first e start their encodes
    in the step that writes the tile's last token (right after a layer's attention read), while
    the tile is still unfrozen, and the others in the next step, before their own updates;
    generate encodes in the next update. e = 4 (5/8), or 3 (half) where one layer's encode fills
    the GPU (``fills``): an early layer at its own read, a later one at the read of the layer e before
    it. The stored tiles are generate's."""
    model = _tiny_llama(kdevice, torch.float16 if HAS_CUDA else torch.float32, layers=6)
    hf_attention.use_fused(model)
    monkeypatch.setattr(freeze_schedule, "encodes_fill_the_gpu", lambda layers: fills)
    ids = torch.randint(0, 97, (1, PROMPT), device=kdevice)
    calls, step = [], [0]
    encode_due = fused_layer.FusedKVarNLayer.encode_due

    def spy(self, n, programs=None):
        import inspect
        stack = inspect.stack()
        layers = {id(x): i for i, x in enumerate(cache.layers)}  # decode_greedy's cache (generate's: None)
        reader = layers.get(id(stack[2].frame.f_locals.get("self")))  # the layer whose read started it
        calls.append((stack[1].function, stack[2].function, step[0], reader, layers.get(id(self)),
                      self.tail_len[0], self.store.counts[0]))
        return encode_due(self, n, programs)

    monkeypatch.setattr(fused_layer.FusedKVarNLayer, "encode_due", spy)
    cache = _fused(model, max_length=PROMPT + NEW)
    hf_graph.decode_greedy(model, cache, ids, NEW, capture="none", on_step=lambda i: step.__setitem__(0, i))
    g = cache.layers[0].tile
    # One tile completed during decoding: the early layers began their encodes right after a read
    # in the step after token s (tail exactly one tile, not yet counted as stored); the others one
    # step later, at the read of a layer e before (still before the tile is counted as stored, so
    # before the layer's own update).
    n, e = len(cache.layers), (3 if fills else 4)
    s = calls[0][2]
    assert n == 6 and freeze_schedule.early_layers(cache.layers) == e
    # (step, the layer whose read started the encode, the encoded layer)
    expect = [(s, i, i) for i in range(e)] + [(s + 1, i - e, i) for i in range(e, n)]  # its own read, or i - e's
    assert calls == [("start_encodes", "read_done", *x, g, 0) for x in expect]
    assert cache.layers[0].store.counts == [1] and cache.layers[0]._ahead is None
    calls.clear()
    gen = _fused(model, max_length=PROMPT + NEW)
    model.generate(ids, past_key_values=gen, max_new_tokens=NEW,
                   do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert [c[0] for c in calls] == ["_flush_device"] * len(cache.layers)  # generate: in the freezing update
    for a, b in zip(cache.layers, gen.layers):
        for name, x in a.store.fields.items():
            assert torch.equal(x, b.store.fields[name]), name


@given(n=st.integers(1, 64), data=st.data())
@settings(max_examples=200, deadline=None)
def test_every_layer_starts_once_before_its_update(n, data):
    """freeze_schedule.starts: every layer's encode is started exactly once; an early layer's by its
    own read (the fill step), a later layer's by the read ``early`` layers before it, which comes
    before the layer's own update (the flush step)."""
    early = data.draw(st.integers(1, n))
    plan = freeze_schedule.starts(n, early)
    assert sorted(j for _, j in plan) == list(range(n))
    for starter, j in plan:
        assert starter == (j if j < early else j - early)
    with pytest.raises(ValueError, match="early=0"):  # no read would start the later layers in time
        freeze_schedule.starts(n, 0)
    with pytest.raises(ValueError, match=f"early={n + 1}"):
        freeze_schedule.starts(n, n + 1)


def test_steady_steps_keep_the_tail_buffers(fused_model, kdevice):
    """Every captured step must use the buffers the others use. After the prompt's freeze the tail
    holds one tile; the step that freezes it appends into the room its flush leaves, so no steady
    step (plain, fill or flush) reallocates the tail."""
    model = fused_model
    ids = torch.randint(0, 97, (1, PROMPT), device=kdevice)
    cache = _fused(model, max_length=PROMPT + NEW)
    seen = []  # per step, the tail buffers of every layer (step 1 freezes the prompt, then steady)

    def tails(i):
        seen.append([(x.tail_k.data_ptr(), x.tail_v.data_ptr(), x.tail_k.shape[2]) for x in cache.layers])

    hf_graph.decode_greedy(model, cache, ids, NEW, capture="none", on_step=tails)
    layer = cache.layers[0]
    assert seen[1][0][2] == layer.tile and layer.store.counts == [1]  # a full tail was frozen
    assert all(s == seen[1] for s in seen[2:])


def test_a_prompt_shorter_than_the_sink_leaves_the_tail_room_for_a_tile(fused_model, kdevice):
    """A 30-token prompt (S = G = 64): the sink then fills a decode token at a time (the host plan)
    and the first steady step is captured with a tail of a token or two. The tail buffer a captured
    step writes into must take a whole tile all the same: grown to the prompt's length alone, the
    captured steps wrote past its end (an index error under "simulate", about 65 steps on). The captured
    loop over such a prompt runs in test_hf_graph_gpu.py (on CPU it takes 100 steps, minutes)."""
    model = fused_model
    cache = _fused(model, max_length=200)
    ids = torch.randint(0, 97, (2, 31), device=kdevice)
    model(input_ids=ids[:, :30], past_key_values=cache, use_cache=True)  # the prompt
    model(input_ids=ids[:, 30:], past_key_values=cache, use_cache=True)  # a step: the sink takes the prompt
    for layer in cache.layers:
        assert layer.sink_len == [30, 30] and layer.tail_len == [1, 1]
        assert layer.tail_k.shape[2] >= layer.tile and layer.tail_v.shape[2] >= layer.tile


def test_kvarn_auto_decides_at_the_first_tile_outside_the_graphs_then_replays(fused_model, kdevice, monkeypatch):
    """kvarn-auto after a 90-token prompt (S = G = 64: no tile past the sink yet): no step is
    captured while the row waits for its decision; the step that freezes the first tile past the
    sink decides on the host plan, and the steps after it are captured and replayed. The same
    tokens, flavours and tiles as generate on the same fused cache. (A prompt shorter than the sink
    and the flush of a later tile in a replay: test_hf_graph_gpu.py; on CPU they take minutes.)"""
    from kvarn.auto.layer import KVarNAutoLayer

    model = fused_model
    prompt, new = 90, 50  # the first tile past the sink is complete at 128 tokens
    ids = torch.randint(0, 97, (1, prompt), device=kdevice)

    def auto_cache():
        return _fused(model, method="kvarn-auto", max_length=prompt + new)

    captured = []
    capture = hf_graph._Graphs._capture

    def spy(self, kind):
        captured.append((kind, self.fused[0].length, any(any(la.pending) for la in self.fused)))
        return capture(self, kind)

    monkeypatch.setattr(hf_graph._Graphs, "_capture", spy)
    cache = auto_cache()
    tokens = hf_graph.decode_greedy(model, cache, ids, new, capture="simulate")
    assert [kind for kind, _, _ in captured] == ["plain"]
    assert not captured[0][2] and captured[0][1] > 128  # captured after the decision, not before
    for layer in cache.layers:
        assert isinstance(layer, KVarNAutoLayer) and layer.store.counts == [1] and not layer.wants_queries
    for rows in cache.flavours().values():
        assert rows[0]["decided_at"] == "first_tile" and (rows[0]["tokens"], rows[0]["queries"]) == (128, 64)
    gen = auto_cache()
    ref = model.generate(ids, past_key_values=gen, max_new_tokens=new, do_sample=False,
                         attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(tokens, ref[:, prompt:])
    for a, b in zip(cache.layers, gen.layers):
        assert torch.equal(a.store.flavours.key_rotate, b.store.flavours.key_rotate)
        assert torch.equal(a.store.flavours.value_normalize, b.store.flavours.value_normalize)
        for name, x in a.store.fields.items():
            assert torch.equal(x, b.store.fields[name]), name


def test_a_crop_discards_a_tile_encoded_ahead(fused_model, kdevice):
    """decode_greedy can stop right after the step that completes a tile (its encode already
    written, not yet counted). A crop that removes that tile's last token must not let a later
    update at the same length reuse it: the tile is encoded again from the new token."""
    model = fused_model
    ids = torch.randint(0, 97, (1, PROMPT), device=kdevice)
    cache = _fused(model, max_length=PROMPT + NEW)
    tokens = hf_graph.decode_greedy(model, cache, ids, 5, capture="none")[:, :4]  # the 4th fed token completes a tile
    layer = cache.layers[0]
    assert layer.tail_len == [layer.tile] and layer.store.counts == [0] and layer._ahead is not None
    cache.crop(-1)  # drop the tile's last token
    other = (tokens[:, 3:] + 1) % 97  # a different token at the same position
    for _ in range(2):  # completes the tile again, then freezes it
        model(input_ids=other, past_key_values=cache, use_cache=True)
    seq = torch.cat([ids, tokens[:, :3], other, other], 1)
    ref = _fused(model, max_length=PROMPT + NEW)  # the same sequence, token by token, no decode_greedy
    model(input_ids=seq[:, :PROMPT], past_key_values=ref, use_cache=True)
    for i in range(PROMPT, seq.shape[1]):
        model(input_ids=seq[:, i:i + 1], past_key_values=ref, use_cache=True)
    assert layer.store.counts == [1] and ref.layers[0].store.counts == [1]
    for a, b in zip(cache.layers, ref.layers):
        for name, x in a.store.fields.items():
            assert torch.equal(x[:, :, :1], b.store.fields[name][:, :, :1]), name


def test_simulated_replay_catches_a_host_position(fused_model, kdevice, monkeypatch):
    """The check has teeth: a tail write at the host's position goes wrong under simulated replay."""
    model = fused_model
    ids = torch.randint(0, 97, (1, PROMPT), device=kdevice)
    good_cache = _fused(model, max_length=PROMPT + NEW)
    good = hf_graph.decode_greedy(model, good_cache, ids, NEW, capture="simulate")

    def host_append(self, k, v, frozen):
        t, q = self.tail_len[0] - frozen * self.tile, k.shape[-2]
        self.tail_k[:, :, t:t + q] = k
        self.tail_v[:, :, t:t + q] = v
        self._dev_len[1].add_(frozen)
        self._dev_len[2].add_(q - frozen * self.tile)

    monkeypatch.setattr(fused_layer.FusedKVarNLayer, "_append_device", host_append)
    eager = hf_graph.decode_greedy(model, _fused(model, max_length=PROMPT + NEW), ids, NEW, capture="none")
    bad_cache = _fused(model, max_length=PROMPT + NEW)
    hf_graph.decode_greedy(model, bad_cache, ids, NEW, capture="simulate")
    assert torch.equal(eager, good)  # eagerly the host position is right
    # Replayed, the write lands at the position the host had at capture time: the tail differs.
    # (The tokens of this tiny random model need not change: on the GPU they did not.)
    assert not torch.equal(bad_cache.layers[0].tail_k, good_cache.layers[0].tail_k)


_SYNCING = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                                              "nonzero", "cpu", "numpy")] + [(torch, "tensor"), (torch, "nonzero")]


@contextlib.contextmanager
def _count_host_reads(monkeypatch):
    """Counts calls that read a device value on the host or copy host values to the device."""
    calls = []
    with monkeypatch.context() as m:
        for owner, name in _SYNCING:
            orig = getattr(owner, name)

            def wrapper(*a, _orig=orig, _name=name, **kw):
                calls.append(_name)
                return _orig(*a, **kw)

            m.setattr(owner, name, wrapper)
        yield calls


def test_steady_steps_read_nothing_back(fused_model, kdevice, monkeypatch):
    """Plain and flush steps of a steady cache: no .item()/.tolist()/bool()/torch.tensor(...)."""
    from kvarn import attention, codec, kernels

    # The interpreter itself moves tensors to numpy: count the step around the kernels, which are
    # replaced by their torch twins (same signatures; they are checked against the kernels elsewhere).
    monkeypatch.setattr(kernels, "decode_attention",
                        lambda q, *a, **kw: attention.decode_attention(q.float(), *a, **kw).to(q.dtype))
    recording = []  # the calls list of the step being counted

    def encode_stand_in(k, v, c, out=None, **kw):
        # The torch codec guards its scales on the host; the Triton flush it stands in for has no
        # guard (TritonTileCodec checks on the device in this step), so its reads are not the step's.
        n = len(recording[-1]) if recording else 0
        tiles = codec.encode_tiles(k, v, c)
        if recording:
            del recording[-1][n:]
        return tiles

    monkeypatch.setattr(kernels, "encode_tiles", encode_stand_in)
    model = fused_model
    ids = torch.randint(0, 97, (2, PROMPT), device=kdevice)
    cache = _fused(model, max_length=PROMPT + 16)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = ids[:, -1:]
        pos = torch.full((1, 1), PROMPT, dtype=torch.long, device=kdevice)
        model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)  # freezes the prompt
        layer = cache.layers[0]
        assert layer.steady
        kinds = []
        while len(kinds) < 6:
            pos += 1
            kinds.append("flush" if layer.tiles_due() else "plain")
            with _count_host_reads(monkeypatch) as calls:
                recording.append(calls)
                model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            recording.clear()
            assert calls == [], f"{kinds[-1]} step {len(kinds)} read the device from the host: {calls}"
    assert "flush" in kinds and layer.store.counts == [1, 1]
    with _count_host_reads(monkeypatch) as calls:
        torch.zeros(1).item()
    assert calls == ["item"]  # the counter sees what it should


def test_left_padded_rows_take_the_host_plan(fused_model, kdevice):
    """Rows at different lengths: no lockstep, every step plans on the host; same tokens as the read path."""
    model = fused_model
    ids = torch.randint(1, 97, (2, PROMPT), device=kdevice)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=KVarNCache(model, "kvarn", **PRESET), **kw)
    hf_attention.use_fused(model)
    cache = _fused(model)
    out = model.generate(ids, past_key_values=cache, **kw)
    layer = cache.layers[0]
    assert not layer.steady and layer.tail_len == [PROMPT - 64 + 3, PROMPT - 5 - 64 + 3]
    assert layer._dev_len.tolist() == [layer.sink_len, layer.store.counts, layer.tail_len]
    assert torch.equal(out, ref)


def test_decode_greedy_refuses_what_it_cannot_capture(fused_model, kdevice):
    ids = torch.randint(0, 97, (1, 8), device=kdevice)
    with pytest.raises(ValueError, match="max_length"):
        hf_graph.decode_greedy(fused_model, _fused(fused_model), ids, 2, capture="none")
    with pytest.raises(ValueError, match="capture"):
        hf_graph.decode_greedy(fused_model, _fused(fused_model, max_length=16), ids, 2, capture="graph")
    with pytest.raises(ValueError, match="StaticLayer"):
        hf_graph.decode_greedy(fused_model, KVarNCache(fused_model, "fp16"), ids, 2, capture="none")
    cache = _fused(fused_model, max_length=9)
    with pytest.raises(ValueError, match="max_length=9"):
        hf_graph.decode_greedy(fused_model, cache, ids, 4, capture="none")



def test_host_free_flush_defers_the_scale_check(kdevice):
    """A non-finite scale frozen in a host-free step is not read back then, but raised later."""
    from kvarn.config import KVarNConfig

    codec = hf_attention.TritonTileCodec("kvarn", KVarNConfig(tile=64, sinkhorn_iters=2))
    keys = torch.randn(1, 2, 64, 64, device=kdevice)
    values = torch.randn(1, 2, 64, 64, device=kdevice) * 1e12  # past the clipped scales (e^10 each): fp16 overflow
    with pytest.raises(ValueError, match="overflow their fp16 scales"):
        codec.encode(keys, values)  # eager: checked at once
    with codec.deferred():
        codec.encode(keys, values / 1e12)
    codec.raise_deferred()  # nothing recorded
    with codec.deferred():
        codec.encode(keys, values)  # host-free: recorded on the device only
    with pytest.raises(ValueError, match="non-finite fp16 scales"):
        codec.raise_deferred()
    codec.raise_deferred()  # reported once
