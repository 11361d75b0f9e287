#!/bin/sh
# Further kvarn-auto rules on SmolLM2 (n2: only the rotation is chosen; @0.1: a 10% margin before
# leaving KVarN), same setup as run_study.sh. Run from the repository root.
set -e
OUT=${1:-docs/results/drift/auto/probe}
COMMON="--tokens 2048 --prefill 512 --methods kvarn-auto --presets k2v2_g128,k4v2_g128 --threads 1 --no-progress --no-plots"
kvarn drift --model smollm2-135m --text reasoning --record 9 \
  $COMMON --auto-rules n2,n2@0.1,a2@0.1 --out $OUT/smollm2-135m_reasoning
kvarn drift --model smollm2-135m --text wikitext2 $COMMON --auto-rules n2@0.1 --out $OUT/smollm2-135m_wikitext2
kvarn drift --model smollm2-135m --text book $COMMON --auto-rules n2@0.1 \
  --out $OUT/smollm2-135m_book
