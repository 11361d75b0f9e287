import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models on a shared 2-core box: thread sync costs more than it saves.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (1, 256), generator=g)
