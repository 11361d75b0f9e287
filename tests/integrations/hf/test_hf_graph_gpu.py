"""CUDA-graph decoding (GPU only): the same greedy tokens with and without capture.

A random Llama with the 8B model's head layout (D 128, 4 query heads per KV head), G = 128 tiles,
and enough new tokens that the captured loop replays both of its graphs (two tiles freeze during
decoding), for the fused kvarn cache and for transformers' StaticCache. The fused cache is also
held to bits: the captured run's tokens and stored tiles are eager's.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

HAS_CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")]

PROMPT, NEW = 300, 300


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
        eos_token_id=None,  # decode_greedy never stops early; generate must not either
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16).eval()


def decode_with_logits(model, cache, ids, mode, **kw):
    """decode_greedy's tokens and the logits each token was chosen from (``[NEW, B, V]``): a hook
    copies the LM head's output into a fixed buffer (captured with the step, so replays refresh it)
    and ``on_step`` saves it after each token."""
    from kvarn.integrations.transformers import graph as hf_graph

    last = torch.zeros(ids.shape[0], model.config.vocab_size, device="cuda")
    hist = torch.zeros(NEW, *last.shape, device="cuda")
    def keep(module, args, output) -> None:  # returns None: the output itself is left as it is
        last.copy_(output[:, -1])

    hook = model.lm_head.register_forward_hook(keep)
    try:
        tokens = hf_graph.decode_greedy(model, cache, ids, NEW, capture=mode, on_step=lambda i: hist[i].copy_(last),
                                        **kw)
    finally:
        hook.remove()
    return tokens, hist


def assert_same_decoding(tokens, logits, ref_tokens, ref_logits, rel: float = 0.05):
    """Same tokens, or the same up to a step where the reference's top two logits were within the
    logit error so far; before that step the logits agree within ``rel`` of their largest magnitude.

    Why not bit-equal: captured GEMMs need not be eager's (cuBLAS picks per stream and workspace:
    the fp16 StaticCache differs too, measured on the H200), and in a 2-4 bit cache a rounding
    difference in a key can flip a code, which moves the logits by much more than the rounding
    (1.5-1.8% of the largest logit after 300 steps of this random model, measured). A capture bug
    (a stale position, a missing tile) moves them by their own size.
    """
    differ = (tokens != ref_tokens).any(0).nonzero()
    first = int(differ[0]) if len(differ) else tokens.shape[1]
    scale = ref_logits[:first].abs().amax().item()
    err = (logits[:first] - ref_logits[:first]).abs().amax().item() if first else 0.0
    assert err <= rel * scale, f"logits differ by {err} (scale {scale}) before any token does"
    if first < tokens.shape[1]:
        top2 = ref_logits[first].topk(2, dim=-1).values  # [B, 2]
        rows = (tokens[:, first] != ref_tokens[:, first]).nonzero()[:, 0]
        gap = (top2[rows, 0] - top2[rows, 1]).max().item()
        assert gap <= 4 * max(err, 1e-3 * scale), (
            f"token {first} differs with a top-2 logit gap of {gap} (logit error so far {err})")


def assert_same_tokens_and_tiles(tokens, logits, cache, ref_tokens, ref_logits, ref_cache, tie: float = 1e-3,
                                 prompt: int = PROMPT):
    """Captured vs eager (``capture="none"``) on the fused cache, to the bit: the same tokens, unless
    the first one that differs was a near tie in the reference after logits that agreed until then
    (both within ``tie`` of the largest logit magnitude, about one fp16 rounding), and every tile
    of tokens before it byte-identical (all layers and rows, every K/V field; all tiles if no token
    differs).

    Why this strict: both runs are the same kernels on the same buffers (launch plans included),
    and the step's GEMMs come out the same captured or not (on the H200 all tokens, logits and
    tiles are equal). A capture bug that feeds a tile stale tokens moves the logits by 1-2% of
    their size, inside assert_same_decoding's tolerance, and exact top-2 ties are common in fp16
    logits of this random model, so a wrong token alone proves nothing.
    """
    differ = (tokens != ref_tokens).any(0).nonzero()
    first = int(differ[0]) if len(differ) else tokens.shape[1]
    scale = ref_logits[: first + 1].abs().amax().item()
    err = (logits[:first] - ref_logits[:first]).flatten(1).abs().amax(1)  # [first]
    bad = (err > tie * scale).nonzero()
    if len(bad):  # raised, not asserted: pytest would print every offending index after the message
        raise AssertionError(f"captured logits of token {int(bad[0])} differ from eager's by "
                             f"{err[bad[0]].item():.4g} (> {tie * scale:.4g}; up to {err.max().item():.4g} before "
                             f"token {first}, the first that differs of {tokens.shape[1]})")
    if first < tokens.shape[1]:
        top2 = ref_logits[first].topk(2, dim=-1).values  # [B, 2]
        rows = (tokens[:, first] != ref_tokens[:, first]).nonzero()[:, 0]
        gap = (top2[rows, 0] - top2[rows, 1]).max().item()
        assert gap <= tie * scale, (
            f"captured token {first} (rows {rows.tolist()}) differs from eager's, whose top-2 logit gap "
            f"{gap:.4g} is no near tie (<= {tie * scale:.4g})")
    for i, (layer, ref) in enumerate(zip(cache.layers, ref_cache.layers)):
        assert layer.store.counts == ref.store.counts, f"layer {i}: tile counts {layer.store.counts} vs eager's"
        # Tile j holds positions S + j G .. S + (j + 1) G - 1; the token at position prompt + t is
        # generated token t, so the tiles that end before position prompt + first saw the same inputs.
        n = min(ref.store.counts[0], max(0, (prompt + first - ref.sink_tokens) // ref.tile))
        for name, x in ref.store.fields.items() if n else ():
            a, b = (y[:, :, :n].reshape(*y.shape[:2], n, -1).view(torch.uint8) for y in (layer.store.fields[name], x))
            if not torch.equal(a, b):
                bad = (a != b).any(-1).any(1).any(0).nonzero()[:, 0].tolist()  # tiles with a difference
                same = (a == b).float().mean().item()
                raise AssertionError(f"layer {i} {name}: captured tiles {bad} of {n} differ from eager's "
                                     f"({same:.1%} of the bytes equal; tokens first differ at {first})")


@pytest.mark.parametrize("preset", ["k4v2_g128", pytest.param("k2v2_g128", marks=pytest.mark.slow)])
def test_captured_kvarn_decode_matches_eager(model, preset):
    from kvarn.integrations.transformers import attention as hf_attention

    ids = torch.randint(0, 1000, (3, PROMPT), device="cuda")
    hf_attention.use_fused(model)
    try:
        out, caches = {}, {}
        for mode in ("none", "cuda"):
            cache = caches[mode] = hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW)
            out[mode] = decode_with_logits(model, cache, ids, mode)
            assert cache.layers[0].store.counts == [(PROMPT + NEW - 1 - 128) // 128] * 3
        # The same reserved buffers as the loop, so the kernels run the same launch plan (a plan
        # from other buffer shapes sums the splits in another order and can flip a near tie).
        ref = model.generate(ids, past_key_values=hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW),
                             max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")
    ref_logits = torch.stack([x.float() for x in ref.logits])  # [NEW, B, V]
    assert_same_decoding(*out["none"], ref.sequences[:, PROMPT:], ref_logits)
    assert_same_tokens_and_tiles(*out["cuda"], caches["cuda"], *out["none"], caches["none"])
    assert_same_decoding(*out["cuda"], *out["none"])


@pytest.mark.slow  # the kvarn-auto case below runs this path (sink filled while decoding, short captured tail)
def test_captured_decode_after_a_prompt_shorter_than_the_sink(model):
    """A 30-token prompt: the sink fills during decoding (host-plan steps), then the steady steps
    are captured with a tail of a token or two, and a tile freezes in a replay. The tail buffer the
    graphs write into must hold a tile (it once held the prompt's 30 tokens: the captured steps
    wrote past its end)."""
    from kvarn.integrations.transformers import attention as hf_attention

    prompt = 30
    ids = torch.randint(0, 1000, (2, prompt), device="cuda")
    hf_attention.use_fused(model)
    try:
        out, caches = {}, {}
        for mode in ("none", "cuda"):
            cache = caches[mode] = hf_attention.fused_cache(model, "k4v2_g128", max_length=prompt + NEW)
            out[mode] = decode_with_logits(model, cache, ids, mode)
            assert cache.layers[0].store.counts == [(prompt + NEW - 1 - 128) // 128] * 2
    finally:
        model.set_attn_implementation("sdpa")
    assert_same_tokens_and_tiles(*out["cuda"], caches["cuda"], *out["none"], caches["none"], prompt=prompt)


def test_captured_kvarn_auto_decode_after_a_prompt_shorter_than_the_sink(model):
    """kvarn-auto after a 30-token prompt: every row decides when its first tile past the sink is
    frozen, in an eager host-plan step; the steps after it are captured and replayed (two more
    tiles freeze in replays, with the decided flavours): the tokens and tiles of eager decoding."""
    from kvarn.integrations.transformers import attention as hf_attention

    prompt = 30
    ids = torch.randint(0, 1000, (2, prompt), device="cuda")
    hf_attention.use_fused(model)
    try:
        out, caches = {}, {}
        for mode in ("none", "cuda"):
            cache = caches[mode] = hf_attention.fused_cache(model, "k2v2_g128", method="kvarn-auto",
                                                            max_length=prompt + NEW)
            out[mode] = decode_with_logits(model, cache, ids, mode)
            assert cache.layers[0].store.counts == [(prompt + NEW - 1 - 128) // 128] * 2
            for rows in cache.flavours().values():
                assert all(r["decided_at"] == "first_tile" and r["queries"] == 128 for r in rows)
    finally:
        model.set_attn_implementation("sdpa")
    for a, b in zip(caches["cuda"].layers, caches["none"].layers):
        assert torch.equal(a.store.flavours.key_rotate, b.store.flavours.key_rotate)
        assert torch.equal(a.store.flavours.value_normalize, b.store.flavours.value_normalize)
    assert_same_tokens_and_tiles(*out["cuda"], caches["cuda"], *out["none"], caches["none"], prompt=prompt)


@pytest.mark.slow  # transformers' own StaticCache: no kvarn kernel
def test_captured_static_cache_decode_matches_eager(model):
    ids = torch.randint(0, 1000, (2, PROMPT), device="cuda")
    model.set_attn_implementation("sdpa")
    out = {}
    for mode in ("none", "cuda"):
        cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
        out[mode] = decode_with_logits(model, cache, ids, mode)
    assert_same_decoding(*out["cuda"], *out["none"])


@pytest.mark.parametrize("mode", [pytest.param("none", marks=pytest.mark.slow), "cuda"])
def test_flush_ahead_waits_on_both_streams(model, mode, monkeypatch):
    """A tile's encode runs on a side stream, started after the attention read of the step that
    completes it (read_done). Both waits are stressed with GPU spins: on the step's stream before
    the encode starts (if the side stream did not wait for it, it would encode the tile before its last
    token is written) and on the side stream before each encode (if the step did not join the
    side stream at its end, the next step's token would overwrite the tail while it is encoded).
    Either race changes the stored tiles. The later layers start their encodes in the flush step,
    at earlier layers' reads, so each of their updates must wait for its own as well."""
    from kvarn.integrations.transformers import freeze_schedule, fused_layer, attention as hf_attention

    spin = 20_000_000  # GPU cycles, about 10 ms
    encode_due, start = fused_layer.FusedKVarNLayer.encode_due, freeze_schedule.start_encodes

    def slow_encode(self, n, programs=None):
        torch.cuda._sleep(spin)  # on the stream the encode runs on
        encode_due(self, n, programs)

    def late_start(layers, stream):
        if any(x.due_ahead() for x in layers):
            torch.cuda._sleep(spin)  # the step's stream lags behind the host
        start(layers, stream)

    monkeypatch.setattr(fused_layer.FusedKVarNLayer, "encode_due", slow_encode)
    monkeypatch.setattr(freeze_schedule, "start_encodes", late_start)
    ids = torch.randint(0, 1000, (2, PROMPT), device="cuda")
    hf_attention.use_fused(model)
    try:
        runs = {}
        for flag in (False, True):
            cache = hf_attention.fused_cache(model, "k4v2_g128", max_length=PROMPT + NEW)
            tokens, logits = decode_with_logits(model, cache, ids, mode, flush_ahead=flag)
            runs[flag] = tokens, logits, [dict(layer.store.fields) for layer in cache.layers]
    finally:
        model.set_attn_implementation("sdpa")
    if mode == "none":  # the same kernels on the same inputs: bit for bit
        assert torch.equal(runs[True][0], runs[False][0])
        for a, b in zip(runs[True][2], runs[False][2]):
            for name in a:
                assert torch.equal(a[name], b[name]), name
    else:  # two captures: the logit bound of the capture tests above
        assert_same_decoding(*runs[True][:2], *runs[False][:2])


def test_side_stream_encodes_start_after_an_empty_launch(model, monkeypatch):
    """Each fork of the side stream launches freeze_schedule.lead_in's empty program before its
    encodes, on the same side stream (the step's next kernel then places its blocks first:
    BENCHMARKS.md, the freeze step). Recorded eagerly: every lead-in, then each encode, with the
    stream it was queued on."""
    from kvarn.integrations.transformers import freeze_schedule, fused_layer, attention as hf_attention

    order = []
    lead_in, encode_due = freeze_schedule.lead_in, fused_layer.FusedKVarNLayer.encode_due

    def spy_lead(device):
        order.append(("lead", torch.cuda.current_stream(device)))
        lead_in(device)

    def spy_encode(self, n, programs=None):
        order.append(("encode", torch.cuda.current_stream(self.device)))
        encode_due(self, n, programs)

    monkeypatch.setattr(freeze_schedule, "lead_in", spy_lead)
    monkeypatch.setattr(fused_layer.FusedKVarNLayer, "encode_due", spy_encode)
    ids = torch.randint(0, 1000, (2, PROMPT), device="cuda")
    hf_attention.use_fused(model)
    try:
        cache = hf_attention.fused_cache(model, "k4v2_g128", max_length=PROMPT + NEW)
        decode_with_logits(model, cache, ids, "none")
    finally:
        model.set_attn_implementation("sdpa")
    step_stream = torch.cuda.current_stream()
    side = [(kind, s) for kind, s in order if s != step_stream]
    # Two tiles freeze while decoding, each layer's encode started by its own fork.
    assert [kind for kind, _ in side] == ["lead", "encode"] * (2 * len(cache.layers))
    assert all(s == side[0][1] for _, s in side)  # one side stream, the encodes' own
