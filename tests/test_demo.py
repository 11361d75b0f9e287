"""The demo's one-screen summary and side-by-side generation, on synthetic results (no model)."""

from pathlib import Path

from kvarn.cli.demo import DEMO_METHODS, error_rows, side_by_side, summary_markdown


def _doc():
    pos = [128, 256, 384, 512]
    mk = lambda s, a: {"positions": pos, "static_mae": s, "accumulated_mae": a, "kl": [0, 0, 0.1, 0.2],  # noqa: E731
                       "top1_agreement": [1, 1, 0.9, 0.8]}
    return {"methods": {"fp16:k2v2_g128": mk([0] * 4, [0] * 4),
                        "kivi:k2v2_g128": mk([0, 0, 0.04, 0.05], [0, 0, 0.07, 0.10]),
                        "kvarn:k2v2_g128": mk([0, 0, 0.03, 0.035], [0, 0, 0.045, 0.05])}}


def _mem(total, baseline):
    return {"total": {"total_bytes": total, "compression_ratio": baseline / total,
                      "compression_vs_fp16": baseline / 2 / total, "baseline_dtype": "float32"}}


def _generation():
    runs = [
        {"method": "fp16", "text": "Robert Boulter is an English actor.", "first_divergence": None,
         "agreement": 1.0, "prompt_tokens": 400, "memory": _mem(1000, 1000)},
        {"method": "kivi", "text": "Robert Boulter was a film actor in England and Wales.", "first_divergence": 3,
         "agreement": 0.25, "prompt_tokens": 400, "memory": _mem(400, 1000)},
        {"method": "kvarn", "text": "Robert Boulter is an English actor.", "first_divergence": None,
         "agreement": 1.0, "prompt_tokens": 400, "memory": _mem(410, 1000)},
    ]
    return {"reference": "fp16", "max_new_tokens": 8, "runs": runs}


FAKE_METHODS = ["fp16", "kivi", "kvarn"]  # the methods of the fake study document above


def test_method_list_is_one_list():
    assert DEMO_METHODS[0] == "fp16" and {"kivi", "kvarn", "kvarn-auto"} <= set(DEMO_METHODS)


def test_error_rows_use_the_last_chunk():
    rows = {r["method"]: r for r in error_rows(_doc(), FAKE_METHODS, "k2v2_g128")}
    assert rows["kivi"]["accumulated_last"] == 0.10 and rows["kvarn"]["static_last"] == 0.035
    assert rows["kvarn"]["accumulated_mean"] == (0.045 + 0.05) / 2  # chunks that read quantized history


def test_summary_states_memory_error_and_figure():
    md = summary_markdown(model="smollm2-135m", preset="k2v2_g128", dtype="float32", tokens=512, text="wikitext2",
                          errors=error_rows(_doc(), FAKE_METHODS, "k2v2_g128"), generation=_generation(),
                          figure=Path("demo_out/drift/mae_vs_context.png"), seconds=12.0)
    assert "| kivi | 0 KiB | 2.50 | 1.25 | 25% | 3 |" in md
    assert "| kvarn | 0.0350 | 0.0500 | 1.43 |" in md
    assert "2.00x lower than KIVI's" in md
    assert "`demo_out/drift/mae_vs_context.png`" in md
    assert len(md.splitlines()) < 40  # one screen


def test_side_by_side_columns():
    text = side_by_side(_generation(), width=90)
    lines = text.splitlines()
    assert lines[0].startswith("fp16 (same as fp16)") and "kivi (differs from token 3)" in lines[0]
    assert all(len(line) <= 90 for line in lines)
    assert "Robert Boulter was a" in text


def test_projected_bytes_follow_the_memory_report_accounting():
    import torch

    from kvarn import KVarNCache
    from kvarn.cli.demo import projected_bytes

    for method, tokens in (("kvarn", 700), ("kivi", 300), ("fp16", 200)):
        cache = KVarNCache(None, method, "k2v2_g128")
        kv = torch.randn(1, 3, tokens, 64)
        cache.update(kv, kv.clone(), 0)
        cache.freeze()
        measured = cache.memory_report()["total"]["total_bytes"]
        assert projected_bytes(method, "k2v2_g128", layers=1, kv_heads=3, head_dim=64, tokens=tokens,
                               esize=4) == measured


def test_side_by_side_wraps_a_long_header_instead_of_cutting_it():
    gen = _generation()
    gen["runs"][1]["first_divergence"] = 16
    text = side_by_side(gen, width=60)  # columns of 20 characters
    assert "token 16)" in text.replace("\n", " ")  # cut to 20, "...token 16" would read "token 1"
    rule = [i for i, line in enumerate(text.splitlines()) if line.startswith("-" * 20)]
    assert len(rule) == 1  # the rules under the headers stay on one line


def test_summary_states_the_presets_sink_and_chunk():
    from kvarn.cli.demo import projected_bytes

    proj = {m: {n: projected_bytes(m, "k2v2_g64", layers=1, kv_heads=1, head_dim=64, tokens=n, esize=4)
                for n in (512, 8192)} for m in FAKE_METHODS}
    md = summary_markdown(model="smollm2-135m", preset="k2v2_g64", dtype="float32", tokens=512, text="wikitext2",
                          errors=error_rows(_doc(), FAKE_METHODS, "k2v2_g128"), generation=_generation(),
                          figure=Path("f.png"), seconds=1.0, projected=proj)
    assert "The sink (first 64 tokens)" in md and "chunks of 64 tokens" in md
    assert "128" not in md.replace("k2v2_g128", "")
