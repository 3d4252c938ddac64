#!/usr/bin/env bash
# CALM paper, Table 12: CALM's per-vocabulary head (d, l of vocabulary size) against a
# collapsed scalar one (a learned temperature + bias), Mistral-7B on MCQA-OOD.
set -euo pipefail

TABLE="CALM paper, Table 12 (CALM head ablation: vector vs scalar d, l on MCQA-OOD)"
DESCRIPTION="Per model, into one folder, then one report over it:
  +sweep=head_ablation  CALM with method.head.kind in {vector, scalar} (2 jobs) at the
                        model's selected learning rates, as in the paper (its Table 6, OOD:
                        mistral 1e-2 / 1e-6; also tulu, vicuna, olmo2); for any other model
                        pass method.module.lower_lr=... method.module.upper_lr=..., else
                        the config's defaults run
with setting=ood. Both rows are in results.csv (column params); report.md shows the one the
selection rule keeps, since both are method=calm."
DEFAULT_MODELS=mistral
SMOKE_ARGS="setting=demo setting.test.limit=4 trainer.limit_train_batches=1 \\
    method.module.inner_steps=1 peft.r=2"

# shellcheck source=lib.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
parse_args "$@"

for model in "${MODELS[@]}"; do
    read -r -a lrs <<<"$(calm_ood_lrs "$model")"
    run_grid "$model" head_ablation setting=ood ${lrs[@]+"${lrs[@]}"}
done
write_report
