"""Recompute the free run's teacher-forced KL along the fp16 trajectory for a finished drift.json.

The GPU run that produced the committed study reused one tile freezer for a method's greedy run and
its teacher-forced run, so the second saw no tiles left to quantize and reported KL 0 (fixed since in
kvarn.analysis.freerun). Greedy tokens, first divergence and agreement were unaffected. This script
recomputes ``free_run.kl``, ``kl_mean`` and ``top1_agreement`` on CPU from the stored fp16 trajectory:

    python docs/results/drift/patch_free_run_kl.py IDS.pt MODEL_FOLDER_OR_NAME DIR [DIR ...]
"""

import json
import sys
from pathlib import Path

import torch

from kvarn import models
from kvarn.analysis.capture import drift_attention
from kvarn.analysis.errors import kl_and_top1
from kvarn.analysis.freerun import _freezer, teacher_forced_logits
from kvarn.analysis.report import summary_markdown
from kvarn.analysis.specs import MethodSpec, dedup_key, method_config


@torch.inference_mode()
def main(ids_path, model_name, *dirs):
    torch.set_num_threads(1)
    ids = torch.load(ids_path)
    model, _ = models.load(model_name)
    for d in map(Path, dirs):
        doc = json.loads((d / "drift.json").read_text())
        fr = doc["free_run"]
        prompt = ids[f"{doc['model']}/{doc['text']}"][:, : fr["prompt_tokens"]]
        ref_tokens = fr["fp16_tokens"]
        done = {}
        with drift_attention(model):
            ref = teacher_forced_logits(model, prompt, ref_tokens, _freezer(model, MethodSpec("fp16", "k2v2_g128"), None, False))
            for key, m in doc["methods"].items():
                spec = MethodSpec(*key.split(":"))
                dk = dedup_key(spec, method_config(spec))
                if dk not in done:
                    logits = teacher_forced_logits(model, prompt, ref_tokens, _freezer(model, spec, None, False))
                    done[dk] = kl_and_top1(ref, logits)
                kl, top1 = done[dk]
                m["free_run"].update(kl=[float(x) for x in kl], kl_mean=float(kl.mean()), top1_agreement=float(top1.float().mean()))
                print(d.name, key, float(kl.mean()), flush=True)
        fr["kl_recomputed"] = "cpu, patch_free_run_kl.py"
        (d / "drift.json").write_text(json.dumps(doc, indent=1) + "\n")
        (d / "summary.md").write_text(summary_markdown(doc))


if __name__ == "__main__":
    main(*sys.argv[1:])
