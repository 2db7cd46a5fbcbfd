#!/usr/bin/env bash
# Pretrain -> SFT -> DPO on the bundled data, after `make demo` (which leaves the pretrained run and the
# tokenizer in demo_out/). Then plots the three runs with utils.resplot. A few minutes on 2 idle CPU cores
# (about 2; longer when other jobs share the cores, see docs/walkthrough.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TOK=demo_out/tokenizer
STEPS=${STEPS:-200}          # SFT steps (DPO runs half as many); STEPS=20 for a short version
DPO_STEPS=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))
test -d demo_out/run/checkpoints || { echo "run 'make demo' first (it leaves demo_out/run)"; exit 2; }

$PY train_my_ddp.py --task_type=sft --init_from=demo_out/run --data_dir=data/sft --tokenizer_dir=$TOK \
    --out_dir=demo_out/sft --max_seq_len=256 --batch_size=8 --learning_rate=1e-3 --min_lr=1e-4 \
    --warmup_iters=$(( STEPS < 10 ? 1 : 10 )) --max_iters=$STEPS --eval_interval=$(( STEPS / 8 > 0 ? STEPS / 8 : 1 )) \
    --eval_iters=10 --log_interval=$(( STEPS / 8 > 0 ? STEPS / 8 : 1 )) --checkpoint_interval=$STEPS --progress=false
$PY train_my_ddp.py --task_type=dpo --init_from=demo_out/sft --data_dir=data/dpo --tokenizer_dir=$TOK \
    --out_dir=demo_out/dpo --max_seq_len=256 --batch_size=8 --learning_rate=2e-4 --min_lr=2e-5 \
    --warmup_iters=$(( DPO_STEPS < 5 ? 1 : 5 )) --max_iters=$DPO_STEPS --eval_interval=$(( DPO_STEPS / 5 > 0 ? DPO_STEPS / 5 : 1 )) \
    --eval_iters=5 --log_interval=$(( DPO_STEPS / 10 > 0 ? DPO_STEPS / 10 : 1 )) --checkpoint_interval=$DPO_STEPS --dpo_beta=0.1 --progress=false
$PY sample.py --ckpt=demo_out/dpo --tokenizer_dir=$TOK --chat --prompt="What is 7 plus 5?" \
    --temperature=0 --max_new_tokens=40
$PY -m utils.resplot demo_out/run demo_out/sft demo_out/dpo -o demo_out/walkthrough.png
