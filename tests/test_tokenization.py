"""What the model is fed, with real tokenizers: the Mistral-7B v0.1 SentencePiece tokenizer
(the one Zephyr-7B-beta uses, shipped in the `mistral-common` wheel) under Zephyr's chat
template, and SmolLM2's byte-level BPE. Prompts get BOS as the tokenizer adds it by default;
option letters and training targets are the ids of the joint encoding of prompt + letter,
checked against the tokenizer's own encoding of the whole text."""

from __future__ import annotations

import json

import pytest
import torch

from calm_lightning.data.cloze_batches import encode_question
from calm_lightning.data.collate import (
    IGNORE_INDEX,
    InstructionCollator,
    MCQACollator,
    OpenQACollator,
)
from calm_lightning.data.datamodule import as_training_example
from calm_lightning.data.prompts import mcqa_user_text, render_prompt
from calm_lightning.data.records import MCQARecord, OpenQARecord
from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.data.tokens import encode_prompt
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.mcqa import (
    answer_slot_rows,
    option_token_candidates,
    training_letter_ids,
)
from calm_lightning.evaluation.scorers import LetterScorer

BOS = 1  # `<s>` in the Mistral v1 vocabulary
# The numbers: "A" alone is `▁A`; after the prompt's final newline it is `A`.
A_ALONE, A_AFTER_NEWLINE = 330, 28741
RECORDS = [
    MCQARecord("q1", "What is 2 + 2?", ("4", "3", "5", "22"), 0),
    MCQARecord("q2", "Which planet is red?", ("Venus", "Mars", "Jupiter", "Saturn"), 1),
    MCQARecord("q3", "Symbol of iron?", ("Ir", "In", "Fe", "I"), 2),
    MCQARecord("q4", "Capital of Peru?", ("Quito", "La Paz", "Bogota", "Lima"), 3),
]


def _joint_suffix(tokenizer, prompt: str, text: str) -> list[int]:
    """Independently: the ids the tokenizer adds for `text` after `prompt`, asserting the
    prompt's own encoding is kept."""
    head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt + text, add_special_tokens=False)["input_ids"]
    assert whole[: len(head)] == head
    return whole[len(head) :]


def _rows(batch: dict) -> list[list[int]]:
    """A batch's token ids row by row, padding left out."""
    pairs = zip(batch["input_ids"], batch["attention_mask"], strict=True)
    return [ids[mask.bool()].tolist() for ids, mask in pairs]


def test_every_zephyr_prompt_starts_with_one_bos(zephyr):
    prompt = render_prompt(zephyr, mcqa_user_text(RECORDS[0]))
    assert not prompt.startswith(zephyr.bos_token)  # the template writes none
    # What the tokenizer itself makes of the text by default: `<s>` once, first.
    expected = zephyr(prompt)["input_ids"]
    assert expected[0] == BOS and expected.count(BOS) == 1
    assert encode_prompt(zephyr, prompt) == expected
    assert _rows(MCQACollator(zephyr)(RECORDS)) == [
        zephyr(render_prompt(zephyr, mcqa_user_text(r)))["input_ids"] for r in RECORDS
    ]
    context, _, _ = encode_question(zephyr, "What is 2 + 2?", ["4", "five"], "chat")
    assert context[0] == BOS and context.count(BOS) == 1
    plain, _, _ = encode_question(zephyr, "What is 2 + 2?", ["4", "five"], "plain")
    assert plain == zephyr("Question: What is 2 + 2?\nAnswer:")["input_ids"]  # lm-eval's way
    question = OpenQARecord("o1", "Who wrote Hamlet?", ("Shakespeare",))
    ids, _ = OpenQACollator(zephyr).prompt_ids(question)
    assert ids[0] == BOS and ids.count(BOS) == 1


def test_a_template_that_writes_bos_gets_it_once(zephyr):
    import copy

    tokenizer = copy.deepcopy(zephyr)
    tokenizer.chat_template = "{{ bos_token }}" + zephyr.chat_template
    prompt = render_prompt(tokenizer, mcqa_user_text(RECORDS[0]))
    assert prompt.startswith("<s>")
    ids = encode_prompt(tokenizer, prompt)
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"] and ids.count(BOS) == 1


def test_a_prompt_cut_from_the_left_keeps_its_bos(zephyr):
    record = MCQARecord("long", "Why? " * 200, ("a", "b", "c", "d"), 0)
    collator = MCQACollator(zephyr, max_length=64)
    full = zephyr(render_prompt(zephyr, mcqa_user_text(record)))["input_ids"]
    (row,) = _rows(collator([record]))
    assert len(row) == 64 and row == [BOS] + full[-63:]
    assert collator.truncated == 1


def test_the_scored_letters_are_the_joint_encodings_ids(zephyr):
    prompt = render_prompt(zephyr, mcqa_user_text(RECORDS[0]))
    assert prompt.endswith("<|assistant|>\n")
    bare = [_joint_suffix(zephyr, prompt, letter) for letter in "ABCD"]
    space = [_joint_suffix(zephyr, prompt, " " + letter) for letter in "ABCD"]
    assert all(len(ids) == 1 for ids in bare + space)
    assert bare[0] == [A_AFTER_NEWLINE] and zephyr.convert_ids_to_tokens(bare[0]) == ["A"]
    assert zephyr("A", add_special_tokens=False)["input_ids"] == [A_ALONE]  # what it was
    candidates = option_token_candidates(zephyr)
    assert candidates["bare"].ids == tuple(ids[0] for ids in bare)
    assert candidates["space"].ids == tuple(ids[0] for ids in space)
    assert LetterScorer("bare").select_option_tokens(None, zephyr, None) == candidates["bare"]


def test_training_targets_are_the_letters_the_scorer_reads(zephyr):
    examples = [as_training_example(r) for r in RECORDS]
    batch = InstructionCollator(zephyr, 256)(examples)
    ids = LetterScorer().training_option_ids(zephyr)
    for row, labels, record in zip(_rows(batch), batch["labels"], RECORDS, strict=True):
        # The whole conversation as the tokenizer encodes it by default: BOS, then one joint
        # encoding (the answer letter where it follows the prompt, not `▁A`).
        text = zephyr.apply_chat_template(
            [
                {"role": "user", "content": mcqa_user_text(record)},
                {"role": "assistant", "content": "ABCD"[record.answer]},
            ],
            tokenize=False,
        )
        assert row == zephyr(text)["input_ids"]
        first = labels[labels != IGNORE_INDEX][0].item()
        assert first == ids[record.answer].item()
    assert ids.tolist() == list(option_token_candidates(zephyr)["bare"].ids)
    assert ids[0].item() == A_AFTER_NEWLINE
    logits = torch.zeros(*batch["input_ids"].shape, 1)  # only the labels are read here
    _, targets = answer_slot_rows(logits, batch["labels"], ids)
    assert targets.tolist() == [r.answer for r in RECORDS]


def test_a_letter_that_merges_with_the_prompt_is_refused(zephyr):
    import copy

    tokenizer = copy.deepcopy(zephyr)
    # An assistant turn opening with a space: SentencePiece joins it to the letter (`▁A`), so
    # no letter is a token of its own after the prompt.
    tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ 'Question: ' + message['content'] + '\n' }}"
        "{% else %}{{ 'Answer: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Answer: ' }}{% endif %}"
    )
    prompt = render_prompt(tokenizer, mcqa_user_text(RECORDS[0]))
    assert prompt.endswith("Answer: ")
    head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt + "A", add_special_tokens=False)["input_ids"]
    assert whole[: len(head)] != head  # the prompt's last token does not survive
    with pytest.raises(ConfigError, match="not one token each after the MCQA prompt"):
        option_token_candidates(tokenizer)
    with pytest.raises(ConfigError, match="does not start with the letter as one token"):
        training_letter_ids(tokenizer)


def test_sampling_and_retention_feed_bos(zephyr, tiny_mistral, monkeypatch):
    from calm_lightning.evaluation import sampling
    from calm_lightning.evaluation.lm_eval_model import CalibratedHFLM
    from calm_lightning.models.calibrated_lm import CalibratedLM

    model = CalibratedLM(tiny_mistral(len(zephyr))).eval()
    fed = []

    class Prefilled(Exception):
        pass

    def capture(lm, ids, mask, n):  # stop at the prefill: only the prompt ids matter here
        fed.extend(_rows({"input_ids": ids, "attention_mask": mask}))
        raise Prefilled

    monkeypatch.setattr(sampling, "prefill_repeated", capture)
    prompts = [render_prompt(zephyr, "Who wrote Hamlet?"), render_prompt(zephyr, "2 + 2?")]
    with pytest.raises(Prefilled):
        sampling.sample_answers(model, zephyr, prompts, n=2)
    assert fed == [zephyr(p)["input_ids"] for p in prompts]
    # lm-eval encodes with the tokenizer's defaults: its contexts start with `<s>` already.
    harness = CalibratedHFLM(model, zephyr, batch_size=1, device="cpu")
    context, continuation = harness._encode_pair("Question: Who wrote Hamlet?\nAnswer:", " X")
    assert context[0] == BOS and context.count(BOS) == 1 and BOS not in continuation


def test_smollm2_gets_no_bos_and_reads_its_letters_in_context(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    probe = tokenizer("probe")["input_ids"]
    assert probe == tokenizer("probe", add_special_tokens=False)["input_ids"]  # adds nothing
    prompt = render_prompt(tokenizer, mcqa_user_text(RECORDS[0]))
    ids, _ = MCQACollator(tokenizer).prompt_ids(RECORDS[0])
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Its `bos_token` is ChatML's turn marker: as many as the template wrote, none added.
    assert ids.count(tokenizer.bos_token_id) == prompt.count(tokenizer.bos_token)
    candidates = option_token_candidates(tokenizer)
    for style, prefix in (("bare", ""), ("space", " ")):
        expected = [_joint_suffix(tokenizer, prompt, prefix + letter) for letter in "ABCD"]
        assert [[i] for i in candidates[style].ids] == expected
    batch = InstructionCollator(tokenizer, 256)([as_training_example(r) for r in RECORDS])
    firsts = [labels[labels != IGNORE_INDEX][0].item() for labels in batch["labels"]]
    ids = LetterScorer().training_option_ids(tokenizer).tolist()
    assert firsts == [ids[r.answer] for r in RECORDS] and ids == list(candidates["bare"].ids)


@pytest.mark.integration
def test_a_tiny_mistral_run_feeds_bos_and_records_the_joint_letter_ids(
    tiny_mistral_folder, zephyr, tmp_path, compose, monkeypatch
):
    """`model=mistral` from a local folder, CALM for two steps on demo MCQA: every test prompt
    fed starts with `<s>`, the lower level's targets and the scored letters are the joint
    encoding's ids, and data_summary.json says so."""
    from calm_lightning.pipeline import run_experiment

    fed = {"test": [], "train": []}
    score, train = MCQACollator.__call__, InstructionCollator.__call__

    def scored(self, records):
        batch = score(self, records)
        fed["test"] += _rows(batch)
        return batch

    def trained(self, records):
        batch = train(self, records)
        fed["train"] += [lab[lab != IGNORE_INDEX][0].item() for lab in batch["labels"]]
        return batch

    monkeypatch.setattr(MCQACollator, "__call__", scored)
    monkeypatch.setattr(InstructionCollator, "__call__", trained)
    overrides = [
        "model=mistral",
        f"model.local_path={tiny_mistral_folder}",
        "method=calm",
        "setting=demo_id",
        "setting.train.limit=8",
        "setting.heldout.limit=8",
        "setting.test.limit=8",
        "setting.batch_size=4",
        "setting.eval_batch_size=8",
        "evaluation.option_tokens=bare",
        "evaluation.compare_with_base=false",
        "peft.r=4",
        "trainer.limit_train_batches=2",
        "method.module.inner_steps=1",
        "trainer.enable_progress_bar=false",
        "logger=none",
    ]
    run_experiment(compose(overrides, tmp_path))
    test = EmbeddedDemoSource("mcqa", "test", limit=8).load()
    prompts = [render_prompt(zephyr, mcqa_user_text(r)) for r in test]
    assert fed["test"] and all(ids[0] == BOS and ids.count(BOS) == 1 for ids in fed["test"])
    assert fed["test"][: len(test)] == [zephyr(p)["input_ids"] for p in prompts]
    letters = {L: _joint_suffix(zephyr, prompts[0], L)[0] for L in "ABCD"}
    assert letters["A"] == A_AFTER_NEWLINE
    assert fed["train"] and set(fed["train"]) <= set(letters.values())
    summary = json.loads((tmp_path / "data_summary.json").read_text())["tokenization"]
    assert summary == {
        "bos_token_id": BOS,
        "test_prompts_starting_with_bos": 1.0,
        "option_token_ids": letters,
    }
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["option_tokens"]["ids"] == list(letters.values())
