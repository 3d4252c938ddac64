#!/usr/bin/env bash
# Dual-Align paper, Table 1: label-free post-hoc calibration of a post-trained model (PoLM)
# against its pre-trained sibling (PLM) on MMLU (test split, all subjects), three seeds.
set -euo pipefail

TABLE="Dual-Align paper, Table 1 (post-hoc calibrators vs the PoLM on MMLU, test split, all subjects)"
DESCRIPTION="Per model, into one folder, then one report over it:
  +sweep=posthoc_reference  method in {base, ts, daca, dual_align, ic, cape, elicitation}
                            x seed in {0, 1, 2} (21 jobs; each seed its own 30 % fit /
                            70 % test split; ts is the supervised oracle)
with setting=posthoc_mmlu and reference_model= the PLM whose pairs_with is the model
(conf/reference_model/; pass reference_model=... to choose another). The report averages
the seeds (mean +- std of ECE, MCE, ACE, Brier, accuracy)."
DEFAULT_MODELS=llama31_8b_instruct,qwen25_14b_instruct,gemma3_27b_it
SMOKE_ARGS="model.logit_scale=4 setting=demo_posthoc setting.test.source.limit=40"

# shellcheck source=lib.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
parse_args "$@"

run_posthoc_reference posthoc_mmlu
write_report
