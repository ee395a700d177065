#!/usr/bin/env bash
# GRPO in veRL (0.9.x) with samrollout servers as the rollout backend.
#
# Before: start the servers on their own machines (any backend: cpu, cuda, ascend), e.g.
#   samrollout serve --model Qwen/Qwen3-8B --served-model-name policy --api-key-file /etc/samrollout/api-key --port 8000
# and in the trainer's environment: pip install "samrollout-client[verl]".
# The servers' addresses go in SAMROLLOUT_URLS (comma-separated); veRL replica r uses URL r mod N.
# Weights reach the servers over HTTP after every step (no shared disk).
set -euo pipefail

: "${SAMROLLOUT_URLS:?set SAMROLLOUT_URLS, e.g. http://rollout-0:8000,http://rollout-1:8000}"
: "${SAMROLLOUT_API_KEY:=}"
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-$HOME/data/gsm8k}
HERE=$(cd "$(dirname "$0")" && pwd)
URL_LIST="['${SAMROLLOUT_URLS//,/\',\'}']"

SAMROLLOUT_OVERRIDES=(
  actor_rollout_ref.rollout.name=samrollout
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.calculate_log_probs=True
  "++actor_rollout_ref.rollout.custom={samrollout: {urls: ${URL_LIST}, api_key: '${SAMROLLOUT_API_KEY}', in_flight: abort}}"
  actor_rollout_ref.rollout.router_config_path="${HERE}/verl_router.yaml"
)

python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="${DATA}/train.parquet" \
  data.val_files="${DATA}/test.parquet" \
  data.train_batch_size=96 \
  data.max_prompt_length=1024 \
  data.max_response_length=8192 \
  actor_rollout_ref.model.path="${MODEL}" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.rollout.n=8 \
  "${SAMROLLOUT_OVERRIDES[@]}" \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.total_epochs=1 \
  "$@"
