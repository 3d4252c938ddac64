"""Training in cloze mode: MCQA training batches carry the answer text and all K option rows;
the lower level is the answer text's cross-entropy and option-level objectives read the cloze
option distribution, checked against the scoring path evaluation uses and against direct
per-option forwards; every training method runs through the pipeline in cloze mode, and the
methods that cannot are refused with a reason."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from calm_lightning.data.cloze_batches import ClozeTrainingCollator, encode_question
from calm_lightning.data.datamodule import CalibrationDataModule
from calm_lightning.data.records import MCQARecord
from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.cloze import cloze_predictions, score_cloze, score_cloze_separate
from calm_lightning.evaluation.scorers import ClozeScorer
from calm_lightning.methods.calm import CALM
from calm_lightning.methods.objectives import mean_entropy
from calm_lightning.methods.single_level import Regularization
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora

RECORDS = [
    MCQARecord("q0", "What is 2 + 2?", ("4", "five hundred and six", "x", "twenty two"), 0),
    MCQARecord(
        "q1",
        "Which planet of the solar system is known as the red planet?",
        ("Mars", "Jupiter, the giant", "Venus", "no"),
        0,
    ),
    MCQARecord("q2", "Name a primary colour.", ("green", "a colour", "blue", "yellowish"), 2),
]
TINY = ["model=tiny", "peft.r=4", "trainer.enable_progress_bar=false"]

# CALM's schedule and inner optimizer have no class default (conf/method/calm.yaml has it).
PER_STEP = {"inner_optimizer": "adam", "surrogate": {"schedule": "per_step"}}


def _headed(tiny_loaded, seed=0):
    """The tiny LM with LoRA adapters and a non-identity vector head."""
    torch.manual_seed(seed)
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0], kind="vector")
    with torch.no_grad():
        head.scale.uniform_(0.5, 1.5)
        head.bias.normal_(0, 0.5)
    return CalibratedLM(lm, head)


def _direct_token_logps(model, tokenizer, record, prompt):
    """Per option, the adjusted log-probs of its continuation tokens: one unpadded forward of
    prompt + option each, through the head by hand."""
    ctx, conts, _ = encode_question(tokenizer, record.question, record.choices, prompt)
    out = []
    for cont in conts:
        ids = torch.tensor([ctx + cont])
        logits = model.lm(input_ids=ids).logits[0]
        adjusted = model.head.scale * logits + model.head.bias
        logp = torch.log_softmax(adjusted.float(), -1)[len(ctx) - 1 : -1]
        out.append(logp.gather(1, torch.tensor(cont)[:, None]).squeeze(1))
    return out


@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_collated_gold_rows_hold_exactly_the_answer_text(tokenizer, prompt):
    batch = ClozeTrainingCollator(tokenizer, prompt, max_length=512)(RECORDS)
    for i, record in enumerate(RECORDS):
        labels = batch["labels"][i]
        answer = tokenizer.decode(labels[labels != -100])
        expected = record.choices[record.answer]
        assert answer == (f" {expected}" if prompt == "plain" else expected)
        ctx, conts, _ = encode_question(tokenizer, record.question, record.choices, prompt)
        n = batch["attention_mask"][i].sum()
        assert batch["input_ids"][i, :n].tolist() == ctx + conts[record.answer]
    assert batch["answers"].tolist() == [0, 0, 2]
    assert batch["cloze"]["input_ids"].shape[0] == 3 * 4


def test_collator_cuts_long_prompts_from_the_left_and_counts_them(tokenizer):
    collate = ClozeTrainingCollator(tokenizer, "plain", max_length=12)
    batch = collate(RECORDS)
    assert collate.stats["prompt_truncated"] >= 1
    assert int(batch["cloze"]["attention_mask"].sum(1).max()) <= 12


@pytest.mark.parametrize("normalize", ["none", "chars"])
def test_cloze_option_logits_equal_the_evaluation_scores(tiny_loaded, tokenizer, normalize):
    model = _headed(tiny_loaded)
    batch = ClozeTrainingCollator(tokenizer, "plain", max_length=512)(RECORDS)
    scored = cloze_predictions(model, batch, normalize)
    questions = [r.question for r in RECORDS]
    choices = [list(r.choices) for r in RECORDS]
    shared = score_cloze(model, tokenizer, questions, choices, "plain")
    separate = score_cloze_separate(model, tokenizer, questions, choices, "plain")
    logits = scored.logits.double()
    torch.testing.assert_close(logits, shared.logits(normalize), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, separate.logits(normalize), atol=1e-5, rtol=0)
    assert scored.targets.tolist() == [0, 0, 2]


def test_answer_cross_entropy_is_the_gold_text_token_mean(tiny_loaded, tokenizer):
    model = _headed(tiny_loaded)
    batch = ClozeTrainingCollator(tokenizer, "chat", max_length=512)(RECORDS)
    scored = cloze_predictions(model, batch)
    with torch.no_grad():
        gold = [_direct_token_logps(model, tokenizer, r, "chat")[r.answer] for r in RECORDS]
    expected = -torch.cat(gold).mean()
    assert scored.answer_ce.item() == pytest.approx(expected.item(), abs=1e-5)
    # The gradient reaches the adapters (B-matrices start at 0, so check the A side's
    # partner: any adapter tensor) and both head blocks.
    scored.answer_ce.backward()
    assert model.head.scale.grad.abs().sum() > 0 and model.head.bias.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.lm.parameters())


def _cloze_datamodule(tokenizer, prompt="plain"):
    return CalibrationDataModule(
        tokenizer,
        train=EmbeddedDemoSource("mcqa", "train", limit=4),
        heldout=EmbeddedDemoSource("mcqa", "heldout", limit=4),
        test=EmbeddedDemoSource("mcqa", "test", limit=4),
        batch_size=2,
        max_length=128,
        **ClozeScorer(prompt=prompt).data_options(),
    )


def test_calm_upper_level_is_the_entropy_of_the_cloze_option_distribution(tiny_loaded, tokenizer):
    model = _headed(tiny_loaded)
    calm = CALM(
        model, tokenizer, inner_steps=1, scoring="cloze", cloze={"prompt": "plain"}, **PER_STEP
    )
    calm.upper_objective = "options"  # under cloze scoring: the cloze option distribution
    datamodule = _cloze_datamodule(tokenizer)
    batch = next(iter(datamodule.heldout_dataloader()))
    records = [r for r in datamodule._load("heldout") if r.id in batch["ids"]]
    records.sort(key=lambda r: batch["ids"].index(r.id))
    upper = calm.upper_loss_fn(batch)()
    scores = score_cloze_separate(
        model, tokenizer, [r.question for r in records], [list(r.choices) for r in records], "plain"
    )
    p = torch.softmax(scores.loglik, -1)
    entropy = -(p * p.log()).sum(-1).mean()
    assert -upper.item() == pytest.approx(entropy.item(), abs=1e-5)
    assert -upper.item() == pytest.approx(mean_entropy(scores.loglik.float()).item(), abs=1e-5)


def test_regularization_in_cloze_mode_is_answer_ce_minus_option_entropy(tiny_loaded, tokenizer):
    model = _headed(tiny_loaded)
    reg = Regularization(model, tokenizer, alpha_reg=0.3, scoring="cloze")
    reg.mode = "options"
    batch = _cloze_datamodule(tokenizer).mcqa_train_collator(RECORDS)
    loss, logs = reg.loss(batch)
    scored = cloze_predictions(model, batch)
    expected = scored.answer_ce - 0.3 * mean_entropy(scored.logits)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert logs["ce"] == pytest.approx(scored.answer_ce.item(), abs=1e-6)


@pytest.mark.parametrize(
    ("mode", "scoring", "kind", "expected", "lower"),
    [
        ("auto", "cloze", "mcqa", "options", "vocab"),
        ("options", "cloze", "mcqa", "options", "vocab"),
        ("auto", "letter", "mcqa", "options", "options"),
        ("auto", "cloze", "instruction", "vocab", "vocab"),
    ],
)
def test_auto_modes_follow_the_data(tiny_loaded, tokenizer, mode, scoring, kind, expected, lower):
    calm = CALM(_headed(tiny_loaded), tokenizer, scoring=scoring, **PER_STEP)
    calm.data_kind = lambda split: kind
    assert calm.resolve_mode(mode, "train") == expected
    # The lower level trains the answer: the letter (an option) under letter scoring, the
    # answer text under cloze scoring.
    assert calm.answer_text_mode(calm.resolve_mode(mode, "train")) == lower


@pytest.mark.parametrize("method", ["ic", "cape", "elicitation", "dual_align", "daca"])
def test_methods_that_cannot_score_by_option_likelihood_say_why(method, compose, tmp_path):
    from calm_lightning.pipeline import method_class

    cfg = compose([f"method={method}", "evaluation.scoring=cloze"], tmp_path)
    reasons = {
        "ic": "logit lens",
        "cape": "option orders",
        "elicitation": "the number the model writes",
        "dual_align": "logit lens",
        "daca": "logit lens",
    }
    with pytest.raises(ConfigError, match=f"method={method} does not support") as error:
        method_class(cfg).check_requirements(cfg, {})
    assert reasons[method] in str(error.value)
    assert "use evaluation.scoring=letter" in str(error.value)


@pytest.mark.integration
@pytest.mark.parametrize("method", ["calm", "reg", "ls", "cft", "iterate"])
def test_training_methods_train_and_evaluate_in_cloze_mode(method, compose, tmp_path, id_overrides):
    from calm_lightning.pipeline import run_experiment

    extra = ["method.module.lower_steps=1"] if method == "iterate" else []
    cfg = compose(
        [
            *TINY,
            f"method={method}",
            *id_overrides,
            "evaluation.scoring=cloze",
            "evaluation.cloze.prompt=plain",
            "trainer.limit_train_batches=2",
            *extra,
        ],
        tmp_path,
    )
    result = run_experiment(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["metrics"]["acc_norm"] == pytest.approx(result.metrics["acc_norm"])
    # Training moved the cloze option distribution away from the base model's.
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    assert all(abs(sum(r["probs"]) - 1) < 1e-5 for r in rows)
    assert result.comparison["base"]["nll"] != pytest.approx(result.metrics["nll"], abs=1e-7)


def test_the_embedded_model_defaults_to_cloze_and_hub_models_to_letters(compose, tmp_path):
    default = compose([], tmp_path)
    assert (default.evaluation.scoring, default.evaluation.cloze.prompt) == ("cloze", "plain")
    assert default.setting.name == "demo_id" and default.method.name == "calm"
    for model in ("olmo2", "tiny"):
        cfg = compose([f"model={model}"], tmp_path)
        assert (cfg.evaluation.scoring, cfg.evaluation.cloze.prompt) == ("letter", "chat")
    # The command line still decides.
    assert compose(["evaluation.scoring=letter"], tmp_path).evaluation.scoring == "letter"
