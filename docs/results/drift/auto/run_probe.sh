#!/bin/sh
# Further kvarn-auto rules on SmolLM2 (n2: only the rotation is chosen; @0.1: a 10% margin before
# leaving KVarN), same setup as run_study.sh. Run from the repository root.
set -e
OUT=${1:-docs/results/drift/auto/probe}
TEXT=${TEXT:-../shared/data/text}
COMMON="--tokens 2048 --prefill 512 --methods kvarn-auto --presets k2v2_g128,k4v2_g128 --threads 1 --no-progress --no-plots"
kvarn drift --model smollm2-135m --text $TEXT/math500_reasoning_traces.jsonl --field full_response --record 9 \
  $COMMON --auto-rules n2,n2@0.1,a2@0.1 --out $OUT/smollm2-135m_reasoning
kvarn drift --model smollm2-135m --text $TEXT/wikitext2_test.raw $COMMON --auto-rules n2@0.1 --out $OUT/smollm2-135m_wikitext2
kvarn drift --model smollm2-135m --text $TEXT/pg1342_pride_and_prejudice.txt $COMMON --auto-rules n2@0.1 \
  --out $OUT/smollm2-135m_book
