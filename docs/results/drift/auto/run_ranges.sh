#!/bin/sh
# kvarn-auto with its 2-bit quantile ranges (kvarn.auto.auto_ranges), the default, and
# the ranges ablation: kivi and kvarn with the spec's min/max ranges and with kvarn-auto's (key
# suffix +q). Same setup as run_study.sh (2048 tokens, 512-token exact prefill, 128-token chunks,
# k2v2 and k4v2). Run from the repository root:
#   sh docs/results/drift/auto/run_ranges.sh [OUT] [MODEL...]
set -e
OUT=${1:-docs/results/drift/auto/ranges}
[ $# -gt 0 ] && shift
MODELS=${*:-smollm2-135m gemma3-270m}
COMMON="--tokens 2048 --prefill 512 --methods kivi,kvarn,kvarn-auto --ranges method,auto \
 --presets k2v2_g128,k4v2_g128 --threads 1 --no-progress --no-plots"
for model in $MODELS; do
  kvarn drift --model $model --text wikitext2 $COMMON --out $OUT/${model}_wikitext2
  kvarn drift --model $model --text reasoning --record 9 $COMMON --out $OUT/${model}_reasoning
  kvarn drift --model $model --text book $COMMON --out $OUT/${model}_book
done
