#!/usr/bin/env bash
# CALM paper, Table 11: CALM on MCQA-OOD with three seeds at each model's selected learning
# rates (mean +- std), next to the base model's conf-ECE.
set -euo pipefail

TABLE="CALM paper, Table 11 (CALM seed robustness on MCQA-OOD, mean +- std over 3 seeds)"
DESCRIPTION="Per model, into one folder, then one report over it:
  +sweep=seeds      CALM with seed in {0, 1, 2} (3 jobs) at the model's selected learning
                    rates: the paper's Table 6 (OOD) for tulu, vicuna, olmo2 and mistral;
                    for any other model pass method.module.lower_lr=... method.module.upper_lr=...
                    (e.g. what table1_mcqa_ood.sh selected), else the config's defaults run
  +sweep=methods    method=base (1 job: the table's baseline conf-ECE)
all with setting=ood. The report averages the seeds into one CALM row (mean +- std)."
DEFAULT_MODELS=tulu,vicuna,olmo2,mistral
SMOKE_ARGS="setting=demo setting.test.limit=4 trainer.limit_train_batches=1 peft.r=2"

# shellcheck source=lib.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
parse_args "$@"

for model in "${MODELS[@]}"; do
    read -r -a lrs <<<"$(calm_ood_lrs "$model")"
    run_grid "$model" seeds setting=ood ${lrs[@]+"${lrs[@]}"}
    run_grid "$model" methods setting=ood method=base
done
write_report
