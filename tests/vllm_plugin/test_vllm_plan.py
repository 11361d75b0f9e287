"""The vLLM adapter's host-side logic without vLLM: flag parsing, the staging pool and the step plan."""

import numpy as np
import pytest
import torch

from kvarn.config import PRESETS
from kvarn.integrations.vllm.hooks import records_budget
from kvarn.integrations.vllm.plan import build_plan, padding_plan
from kvarn.integrations.vllm.settings import is_requested, kv_cache_dtype_names, settings_from_vllm_config
from kvarn.integrations.vllm.staging import StagingPool, slot_tokens, staging_bytes

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



S = CFG.sink_tokens


class _Step:
    """Drives build_plan like the builder: rows of (request id, tokens before, new tokens)."""

    def __init__(self, slots=4, spec=0, width=64):
        self.pool = StagingPool(slots, CFG)
        self.spec = spec
        self.length = slot_tokens(CFG, spec)
        # request i's block j is page 100 * (i + 1) + j
        self.bt = np.array([[100 * (i + 1) + j for j in range(width)] for i in range(slots)], dtype=np.int32)

    def __call__(self, rows, pad_rows=0, pad_tokens=0):
        qsl = np.cumsum([0] + [n for _, _, n in rows])
        lens = np.array([c + n for _, c, n in rows])
        bt = self.bt[[int(r[1:]) for r, _, _ in rows]] if rows else self.bt[:0]
        return build_plan(self.pool, [r for r, _, _ in rows], qsl, lens, bt, G, self.spec,
                          int(qsl[-1]) + pad_tokens, len(rows) + pad_rows)

    def base(self, req):
        return self.pool.slot_of[req] * self.length


def test_prompt_then_decode_commits_each_tile_once_from_accepted_tokens():
    step = _Step()
    plan = step([("r0", 0, 300)])  # a 300-token prompt in one chunk
    b = step.base("r0")
    assert not plan.uniform and len(plan.prefill) == 1 and plan.prefill[0].ctx == 0
    assert plan.write_rows.tolist() == list(range(b, b + 256))  # sink, then tile 1 in the tail rows
    assert plan.write_tok.tolist() == list(range(256))  # the rest is staged after the commit
    assert plan.post_src.tolist() == [b + S] and plan.post_dst.tolist() == [101]  # tile 1 from the tail rows
    assert plan.post_step_src.size == 0  # no other tile completed
    assert plan.late_tok.tolist() == list(range(256, 300)) and plan.late_rows.tolist() == list(range(b + S, b + S + 44))
    slot = step.pool.slot_of["r0"]
    assert (step.pool.committed[slot], step.pool.tail_base[slot]) == (2, 256)
    plan = step([("r0", 300, 1)])  # decode: sink + 1 record + 45 tail tokens
    assert plan.uniform and plan.commit_dst.tolist() == [-1]
    assert (plan.dec_sink[0], plan.dec_tiles[0], plan.dec_tail[0]) == (S, 1, 45)
    assert plan.write_rows.tolist() == [b + S + 44]
    for ctx in range(301, 384):
        plan = step([("r0", ctx, 1)])
        assert plan.commit_dst.tolist() == [-1]
    plan = step([("r0", 384, 1)])  # tile 2 ended at the last step: committed now, from the tail rows
    assert plan.commit_src.tolist() == [b + S] and plan.commit_dst.tolist() == [102]
    assert plan.write_rows.tolist() == [b + S] and (plan.dec_tiles[0], plan.dec_tail[0]) == (2, 1)


def test_long_prompt_commits_middle_tiles_from_the_step_rows():
    step = _Step()
    plan = step([("r0", 0, 700)])
    assert plan.post_src.tolist() == [step.base("r0") + S]
    assert plan.post_step_src.tolist() == [256, 384, 512] and plan.post_step_dst.tolist() == [102, 103, 104]
    assert plan.late_tok.tolist() == list(range(640, 700))
    slot = step.pool.slot_of["r0"]
    assert (step.pool.committed[slot], step.pool.tail_base[slot]) == (5, 640)


def test_continuing_chunk_reads_its_history_and_commits_what_it_completes():
    step = _Step()
    step([("r0", 0, 200)])  # first chunk: sink + 72 tokens of tile 1, nothing committed
    assert step.pool.committed[step.pool.slot_of["r0"]] == 1
    plan = step([("r0", 200, 200)])
    row = plan.prefill[0]
    assert (row.ctx, row.tail_base, row.tiles.tolist()) == (200, 128, [])
    b = step.base("r0")
    assert plan.write_rows.tolist() == list(range(b + S + 72, b + S + 128))  # the rest of tile 1
    assert plan.write_tok.tolist() == list(range(56))
    assert plan.post_src.tolist() == [b + S] and plan.post_dst.tolist() == [101]
    assert plan.post_step_src.tolist() == [56] and plan.post_step_dst.tolist() == [102]  # tile 2 from the step
    assert plan.late_tok.tolist() == list(range(184, 200))  # positions 384..399
    plan = step([("r0", 400, 300)])
    assert plan.prefill[0].tiles.tolist() == [101, 102]


def test_continuing_chunks_are_gathered_history_then_chunk_row_after_row():
    step = _Step()
    step([("r0", 0, 400)])  # records for tiles 1, 2; positions 384..399 in the tail rows
    step([("r1", 0, 100)])  # inside the sink
    plan = step([("r0", 400, 50), ("r1", 100, 60), ("r2", 0, 30)])
    assert plan.fresh.tok.tolist() == list(range(110, 140)) and plan.fresh.contiguous
    co = plan.continued
    b0, b1 = step.base("r0"), step.base("r1")
    assert co.cu_q.tolist() == [0, 50, 110] and co.cu_k.tolist() == [0, 450, 610] and (co.max_q, co.max_k) == (60, 450)
    assert co.q_tok.tolist() == list(range(110))
    # r0: sink rows -> 0..127, records -> 128..383, tail rows -> 384..399, chunk -> 400..449
    # r1: 100 sink rows -> 450..549, chunk -> 550..609
    assert co.stage_src.tolist() == [*range(b0, b0 + S), *range(b0 + S, b0 + S + 16), *range(b1, b1 + 100)]
    assert co.stage_dst.tolist() == [*range(128), *range(384, 400), *range(450, 550)]
    assert co.rec_pages.tolist() == [101, 102] and co.rec_dst.tolist() == list(range(128, 384))
    assert co.chunk_dst.tolist() == [*range(400, 450), *range(550, 610)]
    # every buffer position is written once
    written = np.concatenate([co.stage_dst, co.rec_dst, co.chunk_dst])
    assert sorted(written.tolist()) == list(range(610))


def test_draft_tokens_are_committed_only_once_accepted_and_moved():
    step = _Step(spec=4)
    step([("r0", 0, 250)])
    plan = step([("r0", 250, 1)])  # with drafts possible a one-token step is planned as the others
    assert not plan.uniform and plan.dec_tail.tolist() == [123]
    plan = step([("r0", 250, 5)])  # decode + 4 drafts: positions 250..254 in the tail rows
    b = step.base("r0")
    assert plan.dec_tok.tolist() == [0, 1, 2, 3, 4] and plan.dec_tail.tolist() == [123, 124, 125, 126, 127]
    plan = step([("r0", 253, 5)])  # 2 drafts rejected: positions 253..257, crossing into the draft rows
    assert plan.commit_dst.tolist() == []  # tile 1 is not accepted yet (ctx 253)
    assert plan.write_rows.tolist() == list(range(b + S + 125, b + S + 130))
    plan = step([("r0", 258, 5)])  # all accepted: tile 1 committed, tokens 256, 257 move to the front
    assert plan.commit_src.tolist() == [b + S] and plan.commit_dst.tolist() == [101]
    assert plan.move_src.tolist() == [b + S + 128, b + S + 129] and plan.move_dst.tolist() == [b + S, b + S + 1]
    assert plan.write_rows.tolist() == list(range(b + S + 2, b + S + 7))
    assert plan.dec_tiles.tolist() == [1] * 5 and plan.dec_tail.tolist() == [3, 4, 5, 6, 7]


def test_short_prompt_stays_in_the_sink_and_padding_rows_see_nothing():
    step = _Step()
    plan = step([("r0", 0, 1), ("r1", 10, 1)], pad_rows=2, pad_tokens=2)
    assert plan.uniform and plan.commit_dst.tolist() == [-1] * 4
    assert plan.dec_slot[2:].tolist() == [step.pool.trash] * 2
    assert plan.dec_sink.tolist() == [1, 11, 0, 0] and plan.dec_tail.tolist() == [0, 0, 0, 0]
    pad = padding_plan(step.pool, G, 0, 8, 8)
    assert pad.uniform and (pad.commit_dst == -1).all() and (pad.dec_sink == 0).all()
    assert set(pad.write_rows.tolist()) == {step.pool.trash * step.length}


def test_eager_launches_take_the_graph_sizes_then_powers_of_two():
    from kvarn.integrations.vllm.commit import launch_size

    sizes = (1, 2, 4, 8, 16, 24, 32)
    assert [launch_size(n, sizes) for n in (1, 3, 9, 17, 24, 25, 32, 33, 100)] == [1, 4, 16, 24, 24, 32, 32, 64, 128]
    assert [launch_size(n, ()) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_an_eager_steps_index_arrays_each_start_16_byte_aligned(dtype):
    # Triton specializes pointers on 16-byte alignment: an unaligned view compiles a new variant mid-step.
    from kvarn.integrations.vllm.commit import pack_aligned

    rng = np.random.default_rng(0)
    arrays = {f"a{i}": rng.integers(-5, 1000, size=n) for i, n in enumerate([1, 3, 2, 5, 8, 7, 1])}
    packed, where = pack_aligned(arrays, dtype)
    assert packed.dtype == dtype and list(where) == list(arrays)
    for k, a in arrays.items():
        assert where[k].start * packed.itemsize % 16 == 0
        assert np.array_equal(packed[where[k]], a)
    ends = sorted((w.start, w.stop) for w in where.values())
    assert all(stop <= nxt for (_, stop), (nxt, _) in zip(ends, ends[1:]))  # no overlap


def test_pool_gives_every_running_request_a_slot_and_reuses_freed_ones():
    pool = StagingPool(2, CFG)
    a, b = pool.slots_for(["a", "b"]).tolist()
    assert {a, b} == {0, 1} and pool.used == 2
    pool.committed[a] = 5
    with pytest.raises(RuntimeError, match="sized from max_num_seqs"):
        pool.slots_for(["c"])  # a third running request: vLLM never schedules more than max_num_seqs
    pool.release(["a", "unknown"])
    assert pool.slots_for(["c"]).tolist() == [a] and pool.used == 2
    assert pool.committed[a] == pool.sink_tiles  # a new request starts with its sink only


def test_staging_bytes_counts_sink_tail_and_draft_rows():
    assert slot_tokens(CFG, 0) == S + G and slot_tokens(CFG, 4) == S + G + 4
    assert staging_bytes(3, CFG, 0, HK, D, torch.bfloat16) == 4 * (S + G) * 2 * HK * D * 2


def test_the_budget_leaves_the_records_what_the_staging_does_not_take(caplog):
    mib = 2**20
    with caplog.at_level("WARNING", logger="kvarn.integrations.vllm.hooks"):
        assert records_budget(10 * mib, 100 * mib, 64) == 90 * mib
        assert not caplog.records  # a tenth of the budget: nothing to say
        assert records_budget(60 * mib, 100 * mib, 1024) == 40 * mib
    assert "max_num_seqs=1024" in caplog.text and "60%" in caplog.text
    with pytest.raises(ValueError, match=r"100 MiB for max_num_seqs=1024\) does not fit .* \(100 MiB\)"):
        records_budget(100 * mib, 100 * mib, 1024)


class _Spec:
    def __init__(self, n):
        self.num_speculative_tokens = n


class _Sched:
    def __init__(self, seqs=8, async_scheduling=False):
        self.max_num_seqs, self.async_scheduling = seqs, async_scheduling


def test_settings_size_the_pool_and_the_draft_rows():
    cfg = _VllmConfig({"kvarn": {"preset": "k4v2_g128", "staging_slots": 5}})
    cfg.scheduler_config, cfg.speculative_config = _Sched(), _Spec(4)
    s = settings_from_vllm_config(cfg)
    assert s.slots(cfg) == 5 and s.spec_tokens(cfg) == 4
    cfg.speculative_config = _Spec(G)
    with pytest.raises(ValueError, match="below the tile"):
        s.spec_tokens(cfg)
    cfg.speculative_config, cfg.scheduler_config = _Spec(2), _Sched(async_scheduling=True)
    with pytest.raises(ValueError, match="no-async-scheduling"):
        s.spec_tokens(cfg)


def test_continuing_chunks_attend_over_sink_records_tail_and_themselves():
    """exact.continued (CPU, float32) against attention over each row's history built by hand."""
    from kvarn.codec import decode_tiles
    from kvarn.codec.hadamard import rotate
    from kvarn.codec.record import record_field_views
    from kvarn.integrations.vllm import exact
    from kvarn.integrations.vllm.plan import PrefillRow, continued_batch
    from kvarn.paged import encode_into_pages

    hq, length = 2 * HK, slot_tokens(CFG, 0)
    gen = torch.Generator().manual_seed(0)
    flat_k, flat_v = torch.randn(3 * length, HK, D, generator=gen), torch.randn(3 * length, HK, D, generator=gen)
    pages = torch.zeros(8, HK, CFG.record_bytes(D), dtype=torch.uint8)
    encode_into_pages(torch.randn(2 * G, HK, D, generator=gen), torch.randn(2 * G, HK, D, generator=gen),
                      torch.tensor([0, G], dtype=torch.int32), pages, torch.tensor([3, 5], dtype=torch.int32), CFG)
    rows = [PrefillRow(0, 0, 50, 400, 1, 384, np.array([5, 3], dtype=np.int32)),
            PrefillRow(1, 50, 60, 100, 0, 128, np.zeros(0, dtype=np.int32))]
    b = continued_batch(rows, length, S, G)
    t = torch.from_numpy
    co = exact.ContinuedRows(t(b.q_tok), t(b.cu_q), t(b.cu_k), b.max_q, b.max_k, t(b.stage_src), t(b.stage_dst),
                             t(b.rec_pages), t(b.rec_dst), t(b.chunk_dst), b.cu_q.tolist(), b.cu_k.tolist())
    q, k, v = (torch.randn(110, h, D, generator=gen) for h in (hq, HK, HK))
    out = torch.zeros(110, hq, D)
    exact.continued(q, k, v, co, flat_k, flat_v, pages, CFG, out, D ** -0.5)

    def record(page):  # [G, Hk, D] keys and values of one record
        kt, vt = decode_tiles(record_field_views(pages[page], CFG, D), CFG)  # [Hk, D, G], [Hk, G, D]
        return kt.permute(2, 0, 1), vt.transpose(0, 1)

    for r in rows:
        base, hist = r.slot * length, []
        for kv, flat in ((0, flat_k), (1, flat_v)):
            parts = [flat[base:base + min(r.ctx, S)]] + [record(p)[kv] for p in r.tiles.tolist()]
            parts.append(flat[base + S:base + S + max(r.ctx - r.tail_base, 0)])
            x = rotate(k if kv == 0 else v)[r.t0:r.t0 + r.n]
            hist.append(torch.cat(parts + [x]).transpose(0, 1).repeat_interleave(hq // HK, 0))  # [Hq, L, D]
        qr = rotate(q[r.t0:r.t0 + r.n]).transpose(0, 1)
        mask = torch.arange(r.ctx + r.n)[None, :] <= torch.arange(r.ctx, r.ctx + r.n)[:, None]
        scores = (qr @ hist[0].transpose(1, 2)) * D ** -0.5
        want = rotate((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ hist[1]).transpose(0, 1))
        torch.testing.assert_close(out[r.t0:r.t0 + r.n], want, atol=1e-4, rtol=1e-4)


def test_an_eager_commit_padded_to_a_graph_size_writes_only_its_tiles():
    """pad_commits pads an eager commit list to the next graph size with entries of no tile: the
    Triton launch writes the unpadded launch's records, and no other page."""
    pytest.importorskip("triton")
    from kvarn.integrations.vllm.commit import commit_tiles, pad_commits

    cfg, hk, d = PRESETS["k4v2_g64"], 2, 64
    g = torch.Generator().manual_seed(0)
    rows_k, rows_v = torch.randn(3 * cfg.tile, hk, d, generator=g), torch.randn(3 * cfg.tile, hk, d, generator=g)
    src = torch.tensor([0, 2 * cfg.tile, cfg.tile], dtype=torch.int32)
    dst = torch.tensor([4, -1, 1], dtype=torch.int32)
    want = torch.full((6, hk, cfg.record_bytes(d)), 7, dtype=torch.uint8)
    got = want.clone()
    commit_tiles(rows_k, rows_v, src, want, dst, cfg, "triton", True)  # as given: 3 entries
    psrc, pdst = pad_commits(src.numpy(), dst.numpy(), (2, 8))
    assert psrc.tolist() == [0, 2 * cfg.tile, cfg.tile, 0, 0, 0, 0, 0] and pdst.tolist() == [4, -1, 1] + [-1] * 5
    commit_tiles(rows_k, rows_v, torch.from_numpy(psrc), got, torch.from_numpy(pdst), cfg, "triton", False)
    assert torch.equal(got, want) and (got[[0, 2, 3, 5]] == 7).all()
    empty = np.zeros(0, dtype=np.int32)
    assert [x.size for x in pad_commits(empty, empty, (2, 8))] == [0, 0] and pad_commits(None, None, ()) == (None, None)
