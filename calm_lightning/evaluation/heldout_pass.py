"""The calibrated model scored on the run's held-out split, after the test split: metrics.json's
`heldout`, what `report --select-on heldout` selects on, so a setting can be chosen without
reading the test split (docs/metrics.md, "Held-out metrics").

* MCQA held-out data (ID: the calibration split): every question through the method's own test
  path (`option_probabilities`, the evaluator), as the test split is scored; keys as there.
* Instruction or open-QA held-out data (OOD: the split CALM's upper level reads): the next-token
  distribution over the vocabulary (head applied) at every response position, as top-label
  (confidence, correct) pairs: conf-ECE, accuracy (the argmax is the target token), AUROC and
  the number of positions. A method whose confidence is computed at evaluation time (ic, cape,
  elicitation, cc, bc, hb, isotonic) is scored here without that step.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from calm_lightning.data.collate import select_response_logits
from calm_lightning.metrics.calibration import reliability_bins
from calm_lightning.metrics.ranking import auroc
from calm_lightning.runtime.distributed import ShardedBatchSampler

HELDOUT_KEYS = ("accuracy", "conf_ece", "nll", "brier", "auroc", "n")
SPLIT = "heldout"  # what the evaluator logs the held-out pass's numbers under


def heldout_metrics(trainer, module, datamodule, n_bins: int) -> dict | None:
    """metrics.json's `heldout` for this run (None: the setting has no held-out split)."""
    source = datamodule.sources.get("heldout")
    if source is None:
        return None
    records = datamodule._load("heldout")
    if not records:
        return None
    if source.kind == "mcqa":
        metrics = _mcqa(trainer, module, datamodule, records, n_bins)
        scored = "options"
    else:
        metrics = _tokens(module, datamodule, n_bins)
        scored = "response_tokens"
    return {"split": SPLIT, "scored": scored, "metrics": metrics}


def _mcqa(trainer, module, datamodule, records: list, n_bins: int) -> dict:
    """The held-out questions through the test path; the test predictions are kept aside."""
    sampler = ShardedBatchSampler(
        len(records), datamodule.eval_batch_size, shuffle=False, shard="round_robin"
    )
    loader = DataLoader(records, batch_sampler=sampler, collate_fn=datamodule.test_collator)
    evaluator, kept = module.evaluator, module.evaluator.predictions
    evaluator.split = SPLIT
    try:
        trainer.test(module, dataloaders=loader, verbose=False)
        report = evaluator.predictions.report(n_bins)
    finally:
        evaluator.split, evaluator.predictions = "test", kept
    return {k: report[k] for k in HELDOUT_KEYS if k in report}


@torch.no_grad()
def _tokens(module, datamodule, n_bins: int) -> dict:
    """Top-label pairs of the next-token distribution at every held-out response position."""
    model = module.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    confidences, correct = [], []
    try:
        for batch in datamodule.ordered_heldout_dataloader():
            raw = model.raw_logits(
                batch["input_ids"].to(device), batch["attention_mask"].to(device)
            )
            logits, target = select_response_logits(raw, batch["labels"].to(device))
            logits = model.adjust(logits)  # the head, on the selected positions only
            top, answer = logits.max(dim=-1)
            confidences.append(torch.exp(top - torch.logsumexp(logits, dim=-1)).double().cpu())
            correct.append((answer == target).cpu())
    finally:
        model.train(was_training)
    conf = torch.cat(confidences).numpy()
    hit = torch.cat(correct).numpy()
    return {
        "accuracy": float(hit.mean()),
        "conf_ece": reliability_bins(conf, hit, n_bins).expected_gap(),
        "auroc": auroc(conf, hit),
        "n": int(conf.size),
    }
