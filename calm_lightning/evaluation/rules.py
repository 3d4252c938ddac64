"""The rules of the `evaluation` block (conf/run.yaml), gathered from the code that reads each
part: the scorers (scoring, cloze, option letters), open-QA sampling and grading, lm-eval
retention, and the keys the pipeline reads itself."""

from __future__ import annotations

from calm_lightning.config_rules import Flag, Number, Text
from calm_lightning.evaluation.lm_eval_tasks import RetentionSettings
from calm_lightning.evaluation.openqa import OpenQASettings
from calm_lightning.evaluation.scorers import SCORING_RULES, ClozeScorer
from calm_lightning.metrics.bootstrap import BootstrapSettings

EVALUATION_RULES = {
    **SCORING_RULES,  # scoring, option_tokens, probe_size, cloze.* (the scorers' own rules)
    "n_bins": Number(minimum=1, integer=True),
    "compare_with_base": Flag(),
    "base_cache": Flag(),
    "base_cache_dir": Text(optional=True),
    "min_accuracy_ratio": Number(minimum=0, maximum=1),
    "heldout_metrics": Flag(),
    **{f"bootstrap.{key}": rule for key, rule in BootstrapSettings.rules.items()},
    **{f"openqa.{key}": rule for key, rule in OpenQASettings.rules.items()},
    **{f"retention.{key}": rule for key, rule in RetentionSettings.rules.items()},
}

# A model's defaults for the evaluation block (`model.mcqa_scoring`, `model.cloze_prompt`:
# conf/model/smollm2.yaml): checked on the model node, so a wrong one is named where it is set.
MODEL_EVALUATION_RULES = {
    "mcqa_scoring": SCORING_RULES["scoring"],
    "cloze_prompt": ClozeScorer.rules["prompt"],
}
