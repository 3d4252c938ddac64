#!/usr/bin/env bash
# GPU acceptance checks, runnable on an offline node: no download, no model cache and no
# embedded-model wheel (the tiny model and random-weight shapes, the byte-level tokenizer, the
# bundled demo data). Each invocation writes into a fresh folder <out>/<date>-<time> (printed
# first; <out> is outputs/gpu_check unless --out says otherwise), so a rerun checks afresh. Prints
# one PASS / FAIL / SKIP line per check, writes <folder>/gpu_check.json and exits non-zero if any
# check failed; logs go to <folder>/<check>/.
#
#   bash scripts/gpu_check.sh                  # on a GPU node (a few minutes on one GPU)
#   bash scripts/gpu_check.sh --cpu            # the same checks on the CPU (about a minute)
#   bash scripts/gpu_check.sh --only ddp_reg scoring_letter   # some checks only
#   bash scripts/gpu_check.sh --out DIR --python PATH
#
# Needs torch (CUDA build), lightning, transformers, peft, safetensors, pandas, tokenizers and
# this project's pure-Python dependencies (docs/hardware.md, "Offline GPU node"); bitsandbytes
# for the 4-bit check (skipped without it). On one GPU: the DDP and FSDP checks are skipped,
# `collectives` runs every collective on a one-GPU NCCL group. Run once on one H200: its
# output is in results/gpu_check/ (commit a new run's there, with the date and the GPU).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=outputs/gpu_check
PY=${PYTHON:-$ROOT/.venv/bin/python}
ARGS=()
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --cpu) ARGS+=(--cpu); shift ;;
    --only)
      ARGS+=(--only); shift
      while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do ARGS+=("$1"); shift; done ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$PY" ] || PY=python

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# This checkout's package, whether or not it is installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m calm_lightning.acceptance --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
