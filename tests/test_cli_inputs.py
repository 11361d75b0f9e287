"""Bad command-line values are refused by name, with the valid set, before any model loads."""

import pytest

from kvarn.cli import build_parser, main


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a subcommand gets as far as loading a model."""
    from kvarn import models

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad argument was refused")

    monkeypatch.setattr(models, "load", load)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["generate", "--max-new-tokens", "0", "hi"], "0 must be a positive integer"),
        (["generate", "--max-new-tokens", "-5", "hi"], "-5 must be a positive integer"),
        (["generate", "--preset", "k3v2_g128", "hi"], "unknown preset 'k3v2_g128'; valid presets: ['k2v2_g128'"),
        (["eval", "gsm8k", "--limit", "0", "--out", "x"], "0 must be a positive integer"),
        (["eval", "gsm8k", "--limit", "-1", "--out", "x"], "-1 must be a positive integer"),
        (["eval", "gsm8k", "--method", "kvarn,int3", "--out", "x"], "unknown method 'int3'; valid methods: ['fp16'"),
        (["eval", "gsm8k", "--preset", "k4v2_g128,k3", "--out", "x"], "unknown preset 'k3'"),
        (["eval", "gsm8k", "--method", "hf-quanto", "--out", "x"], "unknown method 'hf-quanto'"),
        (["drift", "--tokens", "-1"], "-1 must be a positive integer"),
        (["drift", "--chunk", "0"], "0 must be a positive integer"),
        (["drift", "--prefill", "0"], "0 must be a positive integer"),
        (["eval", "gsm8k", "--samples", "0", "--out", "x"], "0 must be a positive integer"),
        (["eval", "gsm8k", "--batch-size", "-2", "--out", "x"], "-2 must be a positive integer"),
        (["eval", "gsm8k", "--max-new-tokens", "0", "--out", "x"], "0 must be a positive integer"),
        (["demo", "--prompt-chars", "-5"], "-5 must be a positive integer"),
        (["demo", "--tokens", "ten"], "'ten' is not an integer"),
        (["demo", "--preset", "k2v2"], "unknown preset 'k2v2'"),
    ],
)
def test_parser_refuses_bad_values(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_eval_bad_method_writes_nothing(tmp_path, no_model):
    with pytest.raises(SystemExit):
        main(["eval", "gsm8k", "--method", "bogus", "--out", str(tmp_path), "--no-progress"])
    assert not list(tmp_path.iterdir())  # no empty JSONL of a run that cannot start


@pytest.mark.parametrize("flags, says", [(["--tile", "100"], "tile=100"), (["--sink-tokens", "-1"], "sink_tokens=-1")])
def test_generate_checks_overrides_before_loading(flags, says, no_model):
    with pytest.raises(SystemExit, match=says):
        main(["generate", *flags, "hi"])


def test_demo_checks_methods_before_loading(tmp_path, no_model):
    # The library's ValueError, as one line naming the command; -v keeps the traceback.
    with pytest.raises(SystemExit, match="^kvarn demo: unknown method 'bogus'"):
        main(["demo", "--methods", "fp16", "bogus", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        main(["-v", "demo", "--methods", "fp16", "bogus", "--out", str(tmp_path), "--no-progress"])


def test_demo_refuses_a_text_no_longer_than_its_exact_prefill(tmp_path, no_model):
    # Every measured chunk would lie inside the exact prefill: all errors 0, silently.
    with pytest.raises(SystemExit, match="--tokens 300 leaves nothing to measure"):
        main(["demo", "--tokens", "300", "--out", str(tmp_path), "--no-progress"])
