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
usage: $SCRIPT_NAME.sh [--model NAME[,NAME...]] [--out DIR] [--python PY] [--device GPU]
       [key=value ...]

$TABLE

$DESCRIPTION

options:
  --model NAMES  model= option(s) to run, comma-separated, one after the other
                 (default: $DEFAULT_MODELS)
  --out DIR      output folder; each grid lands in DIR/<model>/<grid>/, the report in
                 DIR/report/ (default: outputs/paper/$SCRIPT_NAME/<timestamp>)
  --python PY    the Python that has calm_lightning installed (default: python)
  --device GPU   with hydra/launcher=slurm: the GPU each grid's time limit and requeues are
                 planned for (calm_lightning plan --device: a100_40g, a100_80g, h100, h200;
                 default: the local GPU, else a100_40g)
  -h, --help     show this help and exit
  key=value ...  Hydra overrides passed to every \`python -m calm_lightning.run\` call after
                 the script's own, so they win: the data (setting=..., local files such as
                 setting.test.sources.mmlu.files=[...]), sizes, trainer or logger options

Hub models and datasets come from the Hub or a pre-filled cache (HF_HOME); with
HF_HUB_OFFLINE=1 nothing is downloaded. A model's Hub commit is pinned in one place, the
revision: key of its conf/model/<name>.yaml (and conf/reference_model/<name>.yaml); an
unpinned one is read from main, with a warning.

With hydra/launcher=slurm every grid is planned first (calm_lightning plan
--launcher-overrides): its jobs get the time limit and requeues the longest of them needs
(hydra.launcher.timeout_min and max_num_timeout; a value you pass wins).

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

# parse_args "$@": sets MODELS (array), OUT, PYTHON, DEVICE and EXTRA (array of key=value
# overrides).
parse_args() {
    local models=$DEFAULT_MODELS
    OUT=""
    PYTHON=python
    DEVICE=""
    EXTRA=()
    while (($#)); do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --model | --out | --python | --device)
                (($# >= 2)) || die "$1 needs a value (see --help)"
                case $1 in
                    --model) models=$2 ;;
                    --out) OUT=$2 ;;
                    --python) PYTHON=$2 ;;
                    --device) DEVICE=$2 ;;
                esac
                shift 2
                continue
                ;;
            --model=*) models=${1#*=} ;;
            --out=*) OUT=${1#*=} ;;
            --python=*) PYTHON=${1#*=} ;;
            --device=*) DEVICE=${1#*=} ;;
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
    if ((${#MODELS[@]} > 1)) && has_extra model.revision; then
        die "model.revision=... would pin every model of --model $models to one commit of" \
            "one repository: pin each in its conf/model/<name>.yaml (revision:)"
    fi
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

# yaml_value FILE KEY: a top-level scalar of a config file ("" when absent; null as written).
yaml_value() {
    sed -n "s/^$2: *\([^ #]*\).*/\1/p" "$1"
}

# check_revision GROUP NAME: warn (once) when conf/GROUP/NAME.yaml reads a Hub model whose
# revision is not a commit (the one place revisions are pinned; `revision_pinned` in
# calm_lightning/models/model_node.py says the same for plan and preflight).
WARNED=" "
check_revision() {
    local file=$REPO_DIR/conf/$1/$2.yaml revision
    [[ -f $file && $(yaml_value "$file" source) == hub && $WARNED != *" $1=$2 "* ]] || return 0
    WARNED+="$1=$2 "
    if has_extra "$1.revision" || has_extra "$1.local_path"; then
        return 0 # the user's pin, or a saved copy
    fi
    revision=$(yaml_value "$file" revision)
    [[ $revision =~ ^[0-9a-f]{40}$ ]] && return 0
    echo "$SCRIPT_NAME: WARN $1=$2 has no pinned revision (conf/$1/$2.yaml revision:" \
        "${revision:-null}): the Hub's current files are read (multirun_sweeps/README.md)" >&2
}

# uses_slurm: true when the user chose hydra/launcher=slurm (one SLURM job per sweep job).
uses_slurm() {
    local arg
    for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do
        [[ $arg == hydra/launcher=slurm ]] && return 0
    done
    return 1
}

# planned_limits MODEL GRID [OVERRIDE...]: under hydra/launcher=slurm, the time limit and
# requeues the grid's own jobs need (`calm_lightning plan --launcher-overrides`: the longest
# job's estimate with its margin, at most the launcher's limit, and ceil(that / limit)
# requeues), as overrides on one line, less those the user passed. Nothing otherwise, and a
# warning (the launcher's own values then apply) when the plan gives no such line.
planned_limits() {
    uses_slurm || return 0
    local model=$1 grid=$2 line override
    shift 2
    local plan=("$PYTHON" -m calm_lightning plan "+sweep=$grid" "model=$model" "$@")
    plan+=(${EXTRA[@]+"${EXTRA[@]}"} "hydra.sweep.dir=$OUT/$model/$grid" --launcher-overrides)
    [[ -z $DEVICE ]] || plan+=(--device "$DEVICE")
    line=$("${plan[@]}") || line=""
    local pattern='^hydra\.launcher\.timeout_min=[0-9]+ hydra\.launcher\.max_num_timeout=[0-9]+$'
    if [[ ! $line =~ $pattern ]]; then
        echo "$SCRIPT_NAME: WARN no planned SLURM limits for +sweep=$grid (model=$model):" \
            "conf/hydra/launcher/slurm.yaml's timeout_min and max_num_timeout apply" >&2
        return 0
    fi
    for override in $line; do
        has_extra "${override%%=*}" || printf '%s ' "$override"
    done
}

# extra_value KEY: the value of the user's KEY=... override (false when none was passed).
extra_value() {
    local arg
    for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do
        if [[ $arg == "$1="* ]]; then
            echo "${arg#*=}"
            return 0
        fi
    done
    return 1
}

# run_grid MODEL GRID [OVERRIDE...]: `python -m calm_lightning.run +sweep=GRID model=MODEL
# OVERRIDE... <planned SLURM limits> <user overrides>` into OUT/MODEL/GRID. Exits the script
# when the command fails.
run_grid() {
    local model=$1 grid=$2 limits
    shift 2
    [[ -f $REPO_DIR/conf/sweep/$grid.yaml ]] || die "no grid conf/sweep/$grid.yaml"
    check_revision model "$model"
    read -r -a limits <<<"$(planned_limits "$model" "$grid" "$@")"
    local cmd=("$PYTHON" -m calm_lightning.run "+sweep=$grid" "model=$model" "$@")
    cmd+=(${limits[@]+"${limits[@]}"})
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
        check_revision reference_model "$(extra_value reference_model || echo "$reference")"
        run_grid "$model" posthoc_reference "setting=$setting" \
            ${reference:+"reference_model=$reference"}
    done
}
