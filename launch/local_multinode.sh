#!/usr/bin/env bash
# Simulate a multi-node job on this machine: one real `deepspeed --hostfile --no_ssh --node_rank i`
# launcher per node, all on loopback. Exits non-zero (and stops the other nodes) if any node fails.
#   launch/local_multinode.sh NODES RANKS_PER_NODE -- launch/pretrain.py --deepspeed_config ds_configs/bert.json
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m ds_bertopt.testing.multinode "$@"
