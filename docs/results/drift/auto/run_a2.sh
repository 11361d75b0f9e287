#!/bin/sh
# kvarn-auto with its default rule, a2 (with its 2-bit quantile ranges and 128 sampled queries), the
# default. Same setup as run_study.sh (2048 tokens, 512-token exact prefill,
# 128-token chunks, k2v2 and k4v2); the references (kivi, kvarn) are run_ranges.sh's. Run from the
# repository root:
#   sh docs/results/drift/auto/run_a2.sh [OUT] [MODEL...]
set -e
OUT=${1:-docs/results/drift/auto/a2}
[ $# -gt 0 ] && shift
MODELS=${*:-smollm2-135m gemma3-270m}
COMMON="--tokens 2048 --prefill 512 --methods kvarn-auto --presets k2v2_g128,k4v2_g128 --threads 1 \
 --no-progress --no-plots"
for model in $MODELS; do
  kvarn drift --model $model --text wikitext2 $COMMON --out $OUT/${model}_wikitext2
  kvarn drift --model $model --text reasoning --record 9 $COMMON --out $OUT/${model}_reasoning
  kvarn drift --model $model --text book $COMMON --out $OUT/${model}_book
done
