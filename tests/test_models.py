import pytest
import torch

from kvarn import models

PROMPT = "The capital of France is"


def test_unknown_name_raises_naming_it_and_the_valid_names():
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m.*gemma3-270m"):
        models.load("no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        models.model_folder("no-such-model")


def test_bad_padding_side_raises():
    with pytest.raises(ValueError, match="middle"):
        models.load("smollm2-135m", padding_side="middle")


def test_smollm2_architecture(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert getattr(config, "quantization_config", None) is None
    assert models.sliding_window_layers(model) == []
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert tokenizer.pad_token is not None
    assert tokenizer.chat_template is not None  # the instruct template survives conversion


def test_smollm2_reload_comes_from_the_cache_with_identical_logits(smollm2, monkeypatch):
    model, tokenizer = smollm2
    folder = models.model_folder("smollm2-135m")
    assert (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("a second load must not convert again")

    monkeypatch.setattr(models, "_convert", no_conversion)
    again, again_tokenizer = models.load("smollm2-135m", padding_side="left")
    assert again_tokenizer.padding_side == "left"
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(again_tokenizer(PROMPT, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_capture_kv_shapes(smollm2_kv):
    assert len(smollm2_kv) == 30
    for keys, values in smollm2_kv:
        assert keys.shape == values.shape == (1, 3, 512, 64)
        assert keys.dtype == values.dtype == torch.float32
        assert keys.device.type == "cpu"
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def test_capture_kv_truncates_and_rejects_zero(smollm2):
    model, tokenizer = smollm2
    kv = models.capture_kv(model, tokenizer, PROMPT, max_tokens=3)
    assert kv[0][0].shape == (1, 3, 3, 64)
    short = models.capture_kv(model, tokenizer, PROMPT, max_tokens=1000)
    assert short[0][0].shape[2] == tokenizer(PROMPT, return_tensors="pt").input_ids.shape[1]
    with pytest.raises(ValueError, match="max_tokens"):
        models.capture_kv(model, tokenizer, PROMPT, max_tokens=0)


def test_gemma3_architecture_and_sliding_layers(gemma3):
    model, tokenizer = gemma3
    config = model.config.get_text_config()
    assert config.num_hidden_layers == 18
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 1
    assert config.head_dim == 256
    assert config.sliding_window == 512
    # Gemma3 interleaves five sliding-window layers with one global layer.
    full = [5, 11, 17]
    assert models.sliding_window_layers(model) == [i for i in range(18) if i not in full]
    assert tokenizer.pad_token is not None
    # The GGUF asks for a leading <bos>; without it Gemma3 degenerates.
    assert tokenizer(PROMPT).input_ids[0] == tokenizer.bos_token_id

    kv = models.capture_kv(model, tokenizer, PROMPT, max_tokens=4)
    assert len(kv) == 18
    assert all(k.shape == v.shape == (1, 1, 4, 256) for k, v in kv)
