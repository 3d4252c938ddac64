#!/usr/bin/env bash
# CALM paper, Table 3: open-ended QA under a question-distribution shift (train PopQA, test
# TriviaQA, Sem-ECE over 300 questions x 20 samples), each method tuned on its grid.
set -euo pipefail

TABLE="CALM paper, Table 3 (generative OOD: train PopQA, test TriviaQA, Sem-ECE)"
DESCRIPTION="Per model, into one folder, then one report over it:
  +sweep=calm_gen_ood  CALM lower x upper LR (12 jobs)
  +sweep=cft           CFT weight w in {0.1, 0.5, 0.9} (3 jobs: the table's best-w row; the
                       fixed w = 0.5 row is the w=0.5 line of results.csv)
  +sweep=reg           Regularization LR x alpha (4 jobs)
  +sweep=gen_methods   method=base,ls untuned (LS is the paper's cautionary row)
all with setting=gen_ood. The report keeps, per method, the lowest Sem-ECE whose accuracy
exceeds 80 % of base."
DEFAULT_MODELS=tulu,vicuna,olmo2,mistral
SMOKE_ARGS="setting=demo_gen_ood setting.test.limit=4 evaluation.openqa.n_samples=2 \\
    trainer.limit_train_batches=1 peft.r=2"

# shellcheck source=lib.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
parse_args "$@"

for model in "${MODELS[@]}"; do
    run_grid "$model" calm_gen_ood setting=gen_ood
    run_grid "$model" cft setting=gen_ood
    run_grid "$model" reg setting=gen_ood
    run_grid "$model" gen_methods setting=gen_ood method=base,ls
done
write_report
