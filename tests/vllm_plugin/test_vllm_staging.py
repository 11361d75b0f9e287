"""The vLLM adapter's host-side logic without vLLM: flag parsing and block-keyed fp staging."""

import pytest
import torch

from kvarn.config import PRESETS
from kvarn.integrations.vllm.settings import is_requested, kv_cache_dtype_names, settings_from_vllm_config
from kvarn.codec import rotate_kv
from kvarn.integrations.vllm.plan import build_plan, commit_chunks, decode_groups, prefill_groups
from kvarn.integrations.vllm.staging import StagingIndex, encode_records, staging_bytes, staging_slots
from kvarn.methods import TileCodec
from kvarn.record import FIELD_ORDER, fields_to_records, record_field_views

CFG = PRESETS["k4v2_g128"]
HK, D, G = 3, 64, CFG.tile


class _Cache:
    def __init__(self, cache_dtype="auto"):
        self.cache_dtype = cache_dtype


class _VllmConfig:
    def __init__(self, additional_config=None, cache_dtype="auto"):
        self.additional_config = additional_config or {}
        self.cache_config = _Cache(cache_dtype)


def test_flag_selects_preset_and_options():
    cfg = _VllmConfig({"kvarn": {"preset": "k2v2_g64", "sinkhorn_iters": 16, "kernels": "torch"}})
    assert is_requested(cfg)
    s = settings_from_vllm_config(cfg)
    assert (s.config.name, s.config.sinkhorn_iters, s.config.sink_tokens, s.kernels) == ("k2v2_g64", 16, 64, "torch")
    assert settings_from_vllm_config(_VllmConfig(cache_dtype="kvarn_k4v4_g128")).config.name == "k4v4_g128"
    assert settings_from_vllm_config(_VllmConfig({"kvarn": "k4v2_g64"})).config.name == "k4v2_g64"
    assert not is_requested(_VllmConfig())
    assert is_requested(_VllmConfig(), custom_backend_selected=True)
    assert settings_from_vllm_config(_VllmConfig()).config.name == "k4v2_g128"
    assert "kvarn_k4v2_g128" in kv_cache_dtype_names()


def test_kvarn_auto_is_refused_naming_the_supported_methods():
    cfg = _VllmConfig({"kvarn": {"preset": "k2v2_g128", "method": "kvarn-auto"}})
    with pytest.raises(ValueError, match=r"method='kvarn-auto' is not supported.*\['kvarn'\]"):
        settings_from_vllm_config(cfg)
    ok = _VllmConfig({"kvarn": {"preset": "k2v2_g128", "method": "kvarn"}})
    assert settings_from_vllm_config(ok).config.name == "k2v2_g128"


@pytest.mark.parametrize("bad", [{"kvarn": {"preset": "k3v3"}}, {"kvarn": {"tile": 64}}, {"kvarn": {"kernels": "cuda"}},
                                 {"kvarn": {"staging_slots": 0}}, {"kvarn": {"stale_steps": 64}}])
def test_flag_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        settings_from_vllm_config(_VllmConfig(bad))


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g)


def test_records_match_the_transformers_codec():
    """A committed page holds exactly what kvarn's own cache would freeze for the same tile."""
    k, v = _kv(G)
    staged_k, staged_v = rotate_kv(k, CFG)[None], rotate_kv(v, CFG)[None]  # staging layout [1, G, Hk, D]
    rec = encode_records(staged_k, staged_v, CFG, "torch")  # [1, Hk, R]
    enc = TileCodec("kvarn", CFG).encode(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    pages = record_field_views(rec[:, :, None], CFG, D)  # how the backend reads a page
    for name in FIELD_ORDER:
        assert torch.equal(getattr(pages, name), getattr(enc.tiles, name)), name
    # the same bytes as the spec's record, up to the documented transposition of the code matrices
    assert torch.equal(fields_to_records(pages, CFG, D), fields_to_records(enc.tiles, CFG, D))


def test_slot_pool_size_and_bytes():
    # 4 sequences x (1 sink + 1 tail) + 2048/128 prompt tiles per step + one chunked prompt of 1024
    assert staging_slots(CFG, 4, 2048, 1024) == 8 + 16 + 8
    assert staging_bytes(10, CFG, HK, D, torch.bfloat16) == 2 * 11 * G * HK * D * 2


def _step(index, reqs, num_layers=1):
    """reqs: (ctx, n, prefilling, blocks) per request -> the plan of one step."""
    qsl, lens, rows, pre, slots = [0], [], [], [], []
    width = max(len(b) for *_, b in reqs)
    for ctx, n, prefilling, blocks in reqs:
        qsl.append(qsl[-1] + n)
        lens.append(ctx + n)
        rows.append(blocks + [0] * (width - len(blocks)))
        pre.append(prefilling)
        slots += [blocks[p // G] * G + p % G for p in range(ctx, ctx + n)]
    return build_plan(index, G, CFG.sink_tokens, torch.tensor(qsl), torch.tensor(lens), torch.tensor(rows),
                      torch.tensor(pre), torch.tensor(slots), len(slots), num_layers)


def test_plan_batches_prefill_decode_and_commits():
    index = StagingIndex(slots=8)
    a, b = [5, 2, 9, 4], [7]
    # step 1: a's 300-token prompt and b's 40-token prompt, both prefilled in one step
    p = _step(index, [(0, 300, True, a[:3]), (0, 40, True, b)])
    assert p.commit_blocks.numel() == 0 and p.dec_tok.numel() == 0
    assert p.pre_tok.shape == (2, 300) and p.pre_valid.sum() == 340
    # rows sorted by length (b first); one call each: padding b to 3 blocks would cost more
    assert p.pre_tok[0, 0] == 300 and p.pre_tok[1, 0] == 0
    assert p.pre_groups == [(0, 1, 40, 1, True), (1, 2, 300, 3, True)]
    assert index.used == 4  # a: 3 blocks in fp (the prompt stays exact), b: 1
    assert torch.equal(p.write_idx[:3], index.block_to_slot[5] * G + torch.arange(3))
    # step 2: both decode; a's full tile after the sink (block 2) is committed before attention
    p = _step(index, [(300, 1, False, a[:3]), (40, 1, False, b)], num_layers=2)
    # decode rows are sorted by tile count: b (no tile yet) first
    assert p.commit_blocks.tolist() == [2] and p.dec_tok.tolist() == [1, 0]
    assert p.dec_tile_counts.tolist() == [0, 1] and p.dec_tile_blocks[1].tolist() == [2]
    assert p.dec_tail_len.tolist() == [0, 301 - 256] and p.dec_sink_len.tolist() == [41, 128]
    assert p.dec_tail_slot[0] == index.zero_slot and p.dec_tail_slot[1] == index.block_to_slot[9]
    # the folded decode reads the ragged tile list and [sink | tail] staging of each row
    assert p.dec_tile_list.tolist() == [2] and p.dec_tile_row.tolist() == [1]
    assert p.dec_fp_slots[1].tolist() == [int(index.block_to_slot[5]), int(index.block_to_slot[9])]
    assert p.dec_fp_slots[0].tolist() == [int(index.block_to_slot[7]), index.zero_slot]
    assert p.dec_fp_valid[0].nonzero().flatten().tolist() == list(range(41))
    assert p.dec_fp_valid[1].nonzero().flatten().tolist() == list(range(128 + 45))  # [sink | tail]
    used = index.used
    assert p.commit_pending and p.num_layers == 2
    p.committed()  # the step's first layer encoded block 2 for both layers
    assert index.used == used - 1 and bool(index.committed[2]) and not p.commit_pending
    # a finishes: vLLM reports it, its slots return to the pool and its blocks are no longer committed
    index.release(torch.tensor(a[:3]))
    assert index.used == 1 and not bool(index.committed[2])


def test_decode_groups_cut_padding():
    tiles = [0] * 10 + [3] * 10 + [6] * 12
    groups = decode_groups(tiles, sink_blocks=1)
    assert groups == [(0, 10, 0), (10, 20, 3), (20, 32, 6)]  # three calls, no padded tile
    assert decode_groups([2] * 32, sink_blocks=1) == [(0, 32, 2)]  # one call when counts agree
    assert decode_groups([0, 1], sink_blocks=1) == [(0, 2, 1)]  # a call costs more than one tile of padding
    assert decode_groups([], sink_blocks=1) == []


def test_prefill_groups_cut_quadratic_padding():
    blocks = [1] * 4 + [4] * 4 + [8] * 2
    assert prefill_groups(blocks) == [(0, 4, 1), (4, 8, 4), (8, 10, 8)]
    assert prefill_groups([3, 3]) == [(0, 2, 3)]
    assert prefill_groups([1, 2]) == [(0, 2, 2)]  # padding 1 -> 2 blocks costs 3, a call 4
    assert prefill_groups([2, 3]) == [(0, 1, 2), (1, 2, 3)]  # padding 2 -> 3 blocks costs 5
    assert prefill_groups([1, 7]) == [(0, 1, 1), (1, 2, 7)]
    assert prefill_groups([]) == []


def test_pool_exhaustion_is_an_error_not_an_overwrite():
    index = StagingIndex(slots=2)
    with pytest.raises(RuntimeError, match="staging_slots"):
        _step(index, [(0, 300, True, [1, 2, 3])])


@pytest.mark.parametrize("layers, blocks, per_call", [(30, 1, 21), (30, 5, 21), (30, 74, 21), (4, 21, 21), (3, 0, 8)])
def test_commit_chunks_cover_every_tile_once_in_bounded_calls(layers, blocks, per_call):
    calls = commit_chunks(layers, blocks, per_call)
    seen = [(i, b) for pieces in calls for i, b0, b1 in pieces for b in range(b0, b1)]
    assert sorted(seen) == [(i, b) for i in range(layers) for b in range(blocks)]
    assert all(sum(b1 - b0 for _, b0, b1 in pieces) <= per_call for pieces in calls)
    # as few calls as whole layers (or pieces of one) allow
    per_layer = -(-blocks // per_call)
    expected = layers * per_layer if blocks > per_call else (-(-layers // (per_call // blocks)) if blocks else 0)
    assert len(calls) == expected


def test_continuing_chunks_get_their_own_prefill_call():
    """A chunk that continues a prompt needs an explicit mask: it never shares a call with prompts
    that start in this step, which keep the kernel's own causal mask."""
    index = StagingIndex(slots=16)
    a, b, c = [1, 2], [4, 5], [6]
    _step(index, [(0, 128, True, a[:1])])  # a: first chunk of its prompt
    # a continues (1 block cached, 20 new tokens: 2 key blocks, as many as b's fresh prompt)
    p = _step(index, [(128, 20, True, a), (0, 200, True, b), (0, 100, True, c)])
    assert p.pre_tok[:, 0].tolist() == [220, 20, 0]  # fresh prompts first (c, b by length), then a
    assert [grp[4] for grp in p.pre_groups] == [True, False]
    assert p.pre_groups[-1][:2] == (2, 3) and p.pre_qpos[2, 0] == 128
    # a continuing chunk alone is not flagged fresh, a fresh prompt alone is
    assert not _step(index, [(148, 30, True, a)]).pre_groups[0][4]
    assert _step(StagingIndex(slots=16), [(0, 256, True, a)]).pre_groups[0][4]
