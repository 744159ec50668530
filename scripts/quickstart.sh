#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded defaults: no download, no GPU.
#   1. plan  - memory per GPU of Llama-3.1-8B on 8 x H100 under every strategy
#   2. fit   - the fastest DeepSpeed configuration for Llama-3.1-70B on 2 nodes x 8 H100
#   3. emit  - that configuration as a DeepSpeed config
#   4. train - a real 2-rank training run of the tiny preset on this CPU (FSDP2, shipped corpus)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(.venv/bin/python -c "from shardfit.runtime_env import extensions_dir; print(extensions_dir())")}
sf=.venv/bin/shardfit
out=${SHARDFIT_OUT:-runs/quickstart}
mkdir -p "$out"
set -x
$sf plan llama-3.1-8b --gpu H100-80GB --gpus 8 --seq 4096 --micro-batch 1
$sf fit llama-3.1-70b --gpu H100-80GB --gpus 16 --nodes 2 --seq 4096 --global-batch 512 --engine deepspeed -o "$out/plan.yaml"
$sf emit "$out/plan.yaml" --format deepspeed -o "$out/ds_config.json"
rm -rf "$out/train"  # the quickstart's own previous run: train refuses to write over a run
$sf train --out "$out/train"
