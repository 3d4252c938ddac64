#!/usr/bin/env bash
# GPU checks that CPU CI cannot run: bf16-mixed, 4-bit QLoRA (nf4), and Lightning's DDP / FSDP
# on CUDA, for the tiny model and the embedded SmolLM2. Prints one PASS / FAIL line per check
# and exits non-zero if any failed; each check's log goes to <out>/<check>.log.
#
#   bash scripts/gpu_check.sh                  # every check (a few minutes per SmolLM2 check)
#   bash scripts/gpu_check.sh --quick          # the tiny-model checks only
#   bash scripts/gpu_check.sh --dry-run        # print the commands, run nothing
#   bash scripts/gpu_check.sh --out DIR --python PATH
#
# Needs a CUDA GPU and `pip install -e '.[dev,quant]'` with a CUDA build of torch
# (README, "GPU install"). Checks needing 2 GPUs are skipped on one.
set -u

OUT=outputs/gpu_check
PY=${PYTHON:-.venv/bin/python}
QUICK=0
DRY=0
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$PY" ] || PY=python

export HF_HUB_OFFLINE=1
FAILED=0
GPUS=0
if [ $DRY -eq 0 ]; then
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$GPUS" -lt 1 ]; then
    echo "FAIL no CUDA GPU visible to $PY (torch.cuda.device_count() = $GPUS)"
    exit 1
  fi
fi
mkdir -p "$OUT"

# check NAME MIN_GPUS EXPECT CMD...: run one pipeline job; EXPECT is a string that must be in
# its metrics.json (e.g. a precision) or "-" for none.
check() {
  local name=$1 need=$2 expect=$3; shift 3
  local dir="$OUT/$name"
  if [ $DRY -eq 1 ]; then echo "$name: $PY -m calm_lightning.run $* hydra.run.dir=$dir"; return; fi
  if [ "$GPUS" -lt "$need" ]; then echo "SKIP $name (needs $need GPUs, $GPUS visible)"; return; fi
  rm -rf "$dir"
  local start=$SECONDS
  if "$PY" -m calm_lightning.run "$@" hydra.run.dir="$dir" > "$OUT/$name.log" 2>&1 \
    && [ -f "$dir/metrics.json" ] \
    && { [ "$expect" = "-" ] || grep -q -- "$expect" "$dir/config_resolved.yaml"; }; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s): see $OUT/$name.log"
    FAILED=1
  fi
}

TINY="model=tiny peft.r=4 setting.test.limit=16 trainer.max_steps=4 logger=csv"
SMOL="model=smollm2 setting.test.limit=32 trainer.max_steps=4 logger=csv"
# shellcheck disable=SC2086  # the option strings are meant to split into words
{
check tiny_calm_bf16 1 "precision: bf16-mixed" $TINY method=calm trainer.precision=bf16-mixed
check tiny_reg_bf16 1 "precision: bf16-mixed" $TINY method=reg trainer.precision=bf16-mixed
check tiny_calm_ddp_1gpu 1 "DDPStrategy" $TINY method=calm trainer=ddp trainer.devices=1
check tiny_reg_fsdp_1gpu 1 "fsdp_strategy" $TINY method=reg trainer=fsdp trainer.devices=1
check tiny_calm_ddp_2gpu 2 "DDPStrategy" $TINY method=calm trainer=ddp trainer.devices=2
# The single-level methods' collectives (the non-finite check, the global means) run only on
# >= 2 processes: the 1-GPU checks above never reach NCCL with them (skipped on one GPU).
check tiny_reg_ddp_2gpu 2 "DDPStrategy" $TINY method=reg trainer=ddp trainer.devices=2
check tiny_reg_fsdp_2gpu 2 "fsdp_strategy" $TINY method=reg trainer=fsdp trainer.devices=2
if [ $QUICK -eq 0 ]; then
  check smollm2_calm_bf16 1 "precision: bf16-mixed" $SMOL method=calm model.quantization=none \
    trainer.precision=bf16-mixed
  check smollm2_calm_nf4 1 "quantization: nf4" $SMOL method=calm model.quantization=nf4
  check smollm2_reg_nf4 1 "quantization: nf4" $SMOL method=reg model.quantization=nf4
  check smollm2_calm_ddp_1gpu 1 "DDPStrategy" $SMOL method=calm trainer=ddp trainer.devices=1
  check smollm2_calm_ddp_2gpu 2 "DDPStrategy" $SMOL method=calm trainer=ddp trainer.devices=2
fi
}
[ $DRY -eq 1 ] && exit 0
if [ $FAILED -eq 0 ]; then echo "all GPU checks passed (logs in $OUT)"; else echo "some GPU checks failed (logs in $OUT)"; fi
exit $FAILED
