#!/bin/sh
# kvarn-auto deciding at the first tile past the sink: KIVI, KVarN and kvarn-auto (rule a2) at
# k2v2_g128 after an exact prefill of 64 tokens (shorter than the 128-token sink: kvarn-auto decides
# when the tile of tokens 128-255 is complete) and of 512 (it decides from the prompt), 2048 tokens,
# 128-token chunks ending on tile boundaries. Run from the repository root:
#   sh docs/results/drift/auto/run_first_tile.sh [OUT] [PREFILLS] [MODEL...]
# then python docs/results/drift/auto/first_tile_table.py OUT
set -e
OUT=${1:-docs/results/drift/auto/first_tile}
PREFILLS=${2:-64 512}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
MODELS=${*:-smollm2-135m gemma3-270m}
COMMON="--tokens 2048 --methods kivi,kvarn,kvarn-auto --presets k2v2_g128 --threads 1 --no-progress --no-plots"
for p in $PREFILLS; do
  for model in $MODELS; do
    kvarn drift --model $model --text wikitext2 --prefill $p $COMMON --out $OUT/${model}_wikitext2_p$p
    kvarn drift --model $model --text reasoning --record 9 --prefill $p $COMMON --out $OUT/${model}_reasoning_p$p
    kvarn drift --model $model --text book --prefill $p $COMMON --out $OUT/${model}_book_p$p
  done
done
