"""Shared setup of the vLLM tests: the model folder, prompts, and engine arguments."""

import json
import os
from pathlib import Path

import pytest

PRESET = "k4v2_g128"
KVARN_FLAG = {"kvarn": {"preset": PRESET}}
KV_SPACE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: the same budget for the kvarn and the 16-bit engines
MAX_MODEL_LEN = 1024


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_SPACE_GIB)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def model_dir() -> str:
    """The bundled SmolLM2 as a local safetensors folder (converted once by kvarn.models)."""
    try:
        from kvarn.models import model_folder

        return str(model_folder("smollm2-135m"))
    except (ImportError, ValueError, FileNotFoundError) as exc:
        pytest.skip(f"the bundled SmolLM2 is not available: {exc}")


def prompts(tokenizer) -> list[list[int]]:
    """Two chat prompts. The first (359 tokens) leaves a sink, one tile committed after the prefill
    and a tail that fills during decoding (a tile is committed at token 384); the second (37 tokens)
    decodes while its sink is still filling."""
    data = Path(__file__).resolve().parents[2] / "kvarn" / "data" / "gsm8k_test.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()[:5]]
    shots = "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows[:2])
    long = f"{shots}\n\nQuestion: {rows[4]['question']}\nAnswer:"
    short = "Write one sentence about the sea."
    out = []
    for text in (long, short):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out
