"""The ``kvarn`` model type of lm-evaluation-harness, on local task files (no hub access)."""

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional extra: pip install -e .[lmeval]")

from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvarn.integrations.lm_eval import KVarNLM  # noqa: E402

QUESTIONS = [("What is Robert Boulter's profession?", [" actor", " carpenter"], 0)]

TASKS = """
task: {name}_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """
task: {name}_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, wikitext_excerpt):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    context = wikitext_excerpt[:1500]  # ~350 tokens: the sink, one quantized tile and a tail
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": context, "question": q, "choices": c, "label": y}) + "\n"
                            for q, c, y in QUESTIONS))
    (d / "mc.yaml").write_text(TASKS.format(name="kvarn_local", data=data))
    (d / "gen.yaml").write_text(GEN_TASK.format(name="kvarn_local", data=data))
    return d


def _evaluate(lm, task_dir, task):
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(task_dir)),
                                  log_samples=True, verbosity="WARNING")
    return out["samples"][task]


def test_registered_under_kvarn():
    assert get_model("kvarn") is KVarNLM


def test_unknown_method_is_refused(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        KVarNLM(pretrained=model, tokenizer=tok, method="int3")


def _logliks(samples):
    return [float(r[0][0]) for s in samples for r in s["resps"]]


def test_loglikelihood_reads_the_quantized_history(smollm2, task_dir):
    model, tok = smollm2
    runs = {m: _logliks(_evaluate(KVarNLM(pretrained=model, tokenizer=tok, method=m, preset="k2v2_g128",
                                          batch_size=2), task_dir, "kvarn_local_mc"))
            for m in ("fp16", "kvarn")}
    hf = _logliks(_evaluate(get_model("hf")(pretrained=model, tokenizer=tok, batch_size=2), task_dir,
                            "kvarn_local_mc"))
    assert len(hf) == 2
    # fp16 through the cache, chunk by chunk, is the plain model up to float rounding...
    assert runs["fp16"] == pytest.approx(hf, abs=2e-3)
    # ...and the 2-bit cache changes every score a little: the continuation reads a quantized tile.
    diffs = [abs(a - b) for a, b in zip(runs["kvarn"], hf)]
    assert min(diffs) > 1e-4 and max(diffs) < 3.0, diffs


def test_generate_until_uses_the_cache(smollm2, task_dir):
    model, tok = smollm2
    fp = _evaluate(KVarNLM(pretrained=model, tokenizer=tok, method="fp16"), task_dir, "kvarn_local_gen")
    hf = _evaluate(get_model("hf")(pretrained=model, tokenizer=tok), task_dir, "kvarn_local_gen")
    assert [s["resps"] for s in fp] == [s["resps"] for s in hf]
    kv = _evaluate(KVarNLM(pretrained=model, tokenizer=tok, method="kvarn"), task_dir, "kvarn_local_gen")
    assert all(isinstance(s["resps"][0][0], str) for s in kv) and len(kv) == len(QUESTIONS)
