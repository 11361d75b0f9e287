#!/bin/sh
# The kvarn-auto study of docs/results/drift.md: 2 models x 3 texts, 2048 tokens, a 512-token exact
# prefill then 128-token chunks, KIVI / VarN / KVarN / kvarn-auto (rules a2 and a3) at k2v2 and k4v2.
# Run from the repository root: sh docs/results/drift/auto/run_study.sh [OUT]
set -e
OUT=${1:-docs/results/drift/auto}
COMMON="--tokens 2048 --prefill 512 --methods kivi,varn,kvarn,kvarn-auto --auto-rules a2,a3 \
 --presets k2v2_g128,k4v2_g128 --threads 1 --no-progress"
for model in smollm2-135m gemma3-270m; do
  kvarn drift --model $model --text wikitext2 $COMMON --out $OUT/${model}_wikitext2
  kvarn drift --model $model --text reasoning --record 9 \
    $COMMON --out $OUT/${model}_reasoning
  kvarn drift --model $model --text book $COMMON --out $OUT/${model}_book
done
