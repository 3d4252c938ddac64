# Shared by the paper scripts in this folder; sourced, never run. A script sets
#   TABLE           which paper table / figure it reproduces (one line)
#   DESCRIPTION     what it runs (a few lines, shown by --help)
#   DEFAULT_MODELS  the paper's models, comma-separated
#   SMOKE_ARGS      extra arguments for an offline smoke test on the tiny model
# then sources this file, calls `parse_args "$@"`, one `run_grid` per grid and model, and
# `write_report` at the end.
# shellcheck shell=bash

SWEEPS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$SWEEPS_DIR")
SCRIPT_NAME=$(basename "$0" .sh)

usage() {
    cat <<EOF
usage: $SCRIPT_NAME.sh [--model NAME[,NAME...]] [--out DIR] [--python PY] [key=value ...]

$TABLE

$DESCRIPTION

options:
  --model NAMES  model= option(s) to run, comma-separated, one after the other
                 (default: $DEFAULT_MODELS)
  --out DIR      output folder; each grid lands in DIR/<model>/<grid>/, the report in
                 DIR/report/ (default: outputs/paper/$SCRIPT_NAME/<timestamp>)
  --python PY    the Python that has calm_lightning installed (default: python)
  -h, --help     show this help and exit
  key=value ...  Hydra overrides passed to every \`python -m calm_lightning.run\` call after
                 the script's own, so they win: the data (setting=..., local files such as
                 setting.test.sources.mmlu.files=[...]), sizes, trainer or logger options

Hub models and datasets come from the Hub or a pre-filled cache (HF_HOME); with
HF_HUB_OFFLINE=1 nothing is downloaded.

A run command that fails to start (bad option, missing package) stops the script with its
exit status; a job that fails inside a sweep is recorded in its folder (failed.json), the sweep
goes on and the report lists it.

Offline smoke test on the tiny random model and the bundled demo data (no download, seconds
per job):
  bash multirun_sweeps/$SCRIPT_NAME.sh --model tiny --out /tmp/$SCRIPT_NAME \\
    $SMOKE_ARGS
EOF
}

die() {
    echo "$SCRIPT_NAME: $*" >&2
    exit 2
}

# parse_args "$@": sets MODELS (array), OUT, PYTHON and EXTRA (array of key=value overrides).
parse_args() {
    local models=$DEFAULT_MODELS
    OUT=""
    PYTHON=python
    EXTRA=()
    while (($#)); do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --model | --out | --python)
                (($# >= 2)) || die "$1 needs a value (see --help)"
                case $1 in
                    --model) models=$2 ;;
                    --out) OUT=$2 ;;
                    --python) PYTHON=$2 ;;
                esac
                shift 2
                continue
                ;;
            --model=*) models=${1#*=} ;;
            --out=*) OUT=${1#*=} ;;
            --python=*) PYTHON=${1#*=} ;;
            -*) die "unknown option $1 (see --help)" ;;
            model=* | hydra.sweep.dir=*)
                die "$1: use --model / --out; the script sets ${1%%=*} itself"
                ;;
            *=*) EXTRA+=("$1") ;;
            *) die "not an option or a key=value override: $1 (see --help)" ;;
        esac
        shift
    done
    [[ -n $models ]] || die "--model is empty"
    IFS=, read -r -a MODELS <<<"$models"
    OUT=${OUT:-outputs/paper/$SCRIPT_NAME/$(date +%Y-%m-%d_%H-%M-%S)}
    command -v "$PYTHON" >/dev/null || die "no Python at '$PYTHON' (see --python)"
    mkdir -p "$OUT"
    echo "$SCRIPT_NAME: $TABLE" >&2
    echo "$SCRIPT_NAME: models ${MODELS[*]}; output $OUT" >&2
}

# has_extra KEY: true when the user passed KEY=... among the overrides.
has_extra() {
    local arg
    for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do
        [[ $arg == "$1="* ]] && return 0
    done
    return 1
}

# run_grid MODEL GRID [OVERRIDE...]: `python -m calm_lightning.run +sweep=GRID model=MODEL
# OVERRIDE... <user overrides>` into OUT/MODEL/GRID. Exits the script when the command fails.
run_grid() {
    local model=$1 grid=$2
    shift 2
    [[ -f $REPO_DIR/conf/sweep/$grid.yaml ]] || die "no grid conf/sweep/$grid.yaml"
    local cmd=("$PYTHON" -m calm_lightning.run "+sweep=$grid" "model=$model" "$@")
    cmd+=(${EXTRA[@]+"${EXTRA[@]}"} "hydra.sweep.dir=$OUT/$model/$grid")
    echo "$SCRIPT_NAME: running ${cmd[*]}" >&2
    local status=0
    "${cmd[@]}" || status=$?
    if ((status != 0)); then
        echo "$SCRIPT_NAME: +sweep=$grid (model=$model) failed to run (exit $status);" \
            "no report written" >&2
        exit "$status"
    fi
}

# write_report: `python -m calm_lightning.report OUT` over every grid the script ran.
write_report() {
    "$PYTHON" -m calm_lightning.report "$OUT"
    echo "$SCRIPT_NAME: report in $OUT/report/ (report.md, results.csv, selected.csv," \
        "reliability_grid.png)" >&2
}

# calm_ood_lrs MODEL: the CALM learning rates the paper selected on MCQA-OOD for MODEL (its
# Table 6), as overrides; user overrides come later and win. Other models: nothing, and a note
# unless the user chose both.
calm_ood_lrs() {
    case $1 in
        tulu) echo "method.module.lower_lr=1e-2 method.module.upper_lr=1e-4" ;;
        vicuna) echo "method.module.lower_lr=1e-3 method.module.upper_lr=1e-5" ;;
        olmo2) echo "method.module.lower_lr=1e-3 method.module.upper_lr=1e-4" ;;
        mistral) echo "method.module.lower_lr=1e-2 method.module.upper_lr=1e-6" ;;
        *)
            has_extra method.module.lower_lr && has_extra method.module.upper_lr ||
                echo "$SCRIPT_NAME: no paper learning rates for model=$1: using the config's" \
                    "defaults for those not given (pass method.module.lower_lr=..." \
                    "method.module.upper_lr=..., e.g. what table1_mcqa_ood.sh selected)" >&2
            ;;
    esac
}

# reference_for MODEL: the reference_model= option whose `pairs_with` is MODEL.
reference_for() {
    local file
    for file in "$REPO_DIR"/conf/reference_model/*.yaml; do
        if grep -Eq "^pairs_with: *$1( |#|$)" "$file"; then
            basename "$file" .yaml
            return 0
        fi
    done
    return 1
}

# run_posthoc_reference SETTING: the Dual-Align paper's comparison for every model: the
# posthoc_reference grid on SETTING, with the PLM whose `pairs_with` names the model (unless the
# user passes reference_model=...).
run_posthoc_reference() {
    local setting=$1 model reference
    for model in "${MODELS[@]}"; do
        reference=$(reference_for "$model") || has_extra reference_model ||
            die "no conf/reference_model/*.yaml pairs with model=$model: pass reference_model=..."
        run_grid "$model" posthoc_reference "setting=$setting" \
            ${reference:+"reference_model=$reference"}
    done
}
