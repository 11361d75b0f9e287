"""Reproduce the committed drift study (docs/results/drift.md) with the library's ``run_drift``.

Same computation as ``kvarn drift`` (which does tokenization and model loading itself); this script
takes pre-tokenized ids and GGUF files so that it can run on a machine without the tokenizers or the
model packages, e.g. a GPU box:

    python docs/results/drift/run_study.py IDS.pt OUT_DIR cuda smollm2-135m=SMOLLM2.gguf gemma3-270m=GEMMA3.gguf

IDS.pt maps "<model>/<text>" to ``[1, 2048]`` token ids, made with ``kvarn.analysis.tokenize`` from
``wikitext2_test.raw`` and record 9 (field ``full_response``) of ``math500_reasoning_traces.jsonl``
(the bundled corpora ``wikitext2`` and ``reasoning`` record 9, see kvarn/data/SOURCES.md)
(Gemma ids start with BOS). Equivalent CPU command per model and text, e.g.:

    kvarn drift --model smollm2-135m --text wikitext2 --tokens 2048 \
        --new-tokens 128 --prompt-tokens 512 --out OUT/smollm2-135m_wikitext2
"""

import logging
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvarn.analysis import parse_specs, run_drift

METHODS = ["fp16", "fp8", "rtn", "quarot", "kivi", "hkivi", "varn", "kvarn"]
PRESETS = ["k2v2_g128", "k4v2_g128"]


def main(ids_path, out, device, *models, new_tokens=128):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ids = torch.load(ids_path)
    specs = parse_specs(METHODS, PRESETS)
    for model_name, gguf in (m.split("=", 1) for m in models):
        t0 = time.time()
        gguf = Path(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model = model.to(device).eval()
        logging.info("loaded %s in %.1f s", model_name, time.time() - t0)
        for key in [k for k in ids if k.startswith(model_name + "/")]:
            text = key.split("/", 1)[1]
            input_ids = ids[key].to(device)
            run_drift(
                model, input_ids, specs, Path(out) / f"{model_name}_{text}", model_name=model_name,
                prompt_tokens=min(512, input_ids.shape[1]), new_tokens=new_tokens, progress=False,
                extra={"text": text, "device": str(device)},
            )
        del model


if __name__ == "__main__":
    main(*sys.argv[1:])
