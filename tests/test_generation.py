"""kvarn.generation (run, agreement, compare, render_table) and the ``kvarn generate`` CLI."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvarn import generation  # noqa: E402


def test_agreement():
    assert generation.agreement([1, 2, 3], [1, 2, 3]) == {"agreement": 1.0, "first_divergence": None, "compared": 3}
    assert generation.agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"agreement": 0.75, "first_divergence": 1, "compared": 4}
    assert generation.agreement([1, 2, 3], [1, 2]) == {"agreement": 2 / 3, "first_divergence": 2, "compared": 3}
    assert generation.agreement([], [])["agreement"] == 1.0


def test_compare_and_table(smollm2):
    model, tok = smollm2
    result = generation.compare(model, tok, "Name three colors.", methods=["fp16", "kvarn"], preset="k2v2_g128",
                                max_new_tokens=6, overrides={"tile": 32, "sink_tokens": 0})
    fp16, kvarn = result["runs"]
    assert fp16["method"] == "fp16" and fp16["agreement"] == 1.0 and fp16["first_divergence"] is None
    assert kvarn["new_tokens"] == len(kvarn["token_ids"]) <= 6 and kvarn["tokens_per_second"] > 0
    assert kvarn["memory"]["total"]["quantized_bytes"] > 0
    assert kvarn["memory_vs_reference"] < 1.0
    table = generation.render_table(result)
    assert table.count("\n") == 3 and "| kvarn |" in table


def test_cli_generate_json(smollm2, capsys):
    from kvarn.cli import main

    code = main(["generate", "--method", "kivi", "--preset", "k4v2_g64", "--max-new-tokens", "4", "--tile", "32",
                 "--sink-tokens", "0", "--compare", "fp16", "--json", "Say hello."])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["method"] == "kivi" and out["reference"] == "fp16"
    assert {"agreement", "first_divergence", "tokens_per_second", "memory", "text"} <= set(run)
    assert set(run["memory"]["total"]) >= {"quantized_bytes", "full_precision_bytes", "total_bytes",
                                           "fp16_equivalent_bytes", "compression_ratio"}


def test_cli_rejects_unknown_method():
    from kvarn.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--method", "int3", "hi"])


def test_cli_generate_refuses_a_missing_device_before_loading():
    import torch

    from kvarn.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present, so --device cuda is valid here")
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["generate", "--device", "cuda", "hi"])
    with pytest.raises(SystemExit, match="not a torch device"):
        main(["generate", "--device", "gpu0", "hi"])
