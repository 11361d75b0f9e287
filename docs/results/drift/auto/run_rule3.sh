#!/bin/sh
# kvarn-auto rule r3 (the self-test on the prompt, kvarn/auto/self_test_rule.py) on the study's 2 models x 3 texts,
# same setup as run_study.sh (2048 tokens, 512-token exact prefill, 128-token chunks, k2v2 and k4v2).
# Only r3 runs here; the baselines and rules a2/a3 are run_study.sh's. Run from the repository root:
#   sh docs/results/drift/auto/run_rule3.sh [OUT] [MODEL...]
set -e
OUT=${1:-docs/results/drift/auto/rule3}
[ $# -gt 0 ] && shift
MODELS=${*:-smollm2-135m gemma3-270m}
COMMON="--tokens 2048 --prefill 512 --methods kvarn-auto --auto-rules r3 \
 --presets k2v2_g128,k4v2_g128 --threads 1 --no-progress --no-plots"
for model in $MODELS; do
  kvarn drift --model $model --text wikitext2 $COMMON --out $OUT/${model}_wikitext2
  kvarn drift --model $model --text reasoning --record 9 $COMMON --out $OUT/${model}_reasoning
  kvarn drift --model $model --text book $COMMON --out $OUT/${model}_book
done
