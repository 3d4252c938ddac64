"""`model.logit_distortion`: a known per-token miscalibration (models/logit_distortion.py).
The hook against a forward without it, S+ against the option texts tokenized here, the base
cache's key, the refusals before any weights load and at export."""

from __future__ import annotations

import pytest
import torch

from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.errors import ConfigError, ExportError
from calm_lightning.evaluation.base_cache import base_fingerprint
from calm_lightning.methods.base import method_class
from calm_lightning.models.loading import load_language_model
from calm_lightning.models.logit_distortion import LogitDistortion, resolve_distortion
from calm_lightning.pipeline import run_experiment

TINY = {"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 1.0}}
RUN = [
    "model=tiny",
    "setting=demo_id",
    "setting.test.limit=8",
    "setting.eval_batch_size=8",
    "evaluation.scoring=cloze",
    "trainer.enable_progress_bar=false",
    "logger=none",
]


def _records(limit=8):
    return EmbeddedDemoSource("mcqa", "test", limit=limit).load()


def _plain_option_ids(tokenizer, records) -> set[int]:
    """The option texts' ids as the plain cloze prompt encodes them, computed here: what
    `Question: q\\nAnswer: option` adds after `Question: q\\nAnswer:`."""
    ids: set[int] = set()
    for r in records:
        context = tokenizer(f"Question: {r.question}\nAnswer:", add_special_tokens=False)
        for option in r.choices:
            whole = tokenizer(f"Question: {r.question}\nAnswer: {option}", add_special_tokens=False)
            assert whole["input_ids"][: len(context["input_ids"])] == context["input_ids"]
            ids.update(whole["input_ids"][len(context["input_ids"]) :])
    return ids - set(tokenizer.all_special_ids)


@pytest.fixture(scope="module")
def clean():
    return load_language_model(TINY)


def test_the_hook_adds_b_to_exactly_the_chosen_logits_on_top_of_the_scale(clean):
    chosen = (5, 17, 301, 4000)
    distorted = load_language_model(
        {**TINY, "logit_scale": 4.0, "logit_distortion": {"bias": 3.0}},
        LogitDistortion(chosen, 3.0, 4.0),
    )
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = clean.model(input_ids=ids).logits
        tilde = distorted.model(input_ids=ids).logits
    shift = tilde - 4.0 * z  # k z + b 1[S+], the scale exact (a power of two)
    inside = torch.zeros(z.shape[-1], dtype=torch.bool)
    inside[list(chosen)] = True
    torch.testing.assert_close(shift[..., inside], torch.full_like(shift[..., inside], 3.0))
    assert shift[..., ~inside].abs().max().item() < 1e-5
    # sampling and the cloze fast path call the LM directly: generate sees it too
    assert torch.equal(
        distorted.model.generate(ids[:1], max_new_tokens=1, do_sample=False)[0, -1],
        (4.0 * z[0, -1] + 3.0 * inside).argmax(),
    )


def test_s_plus_is_a_seeded_half_of_the_option_text_tokens(clean):
    tokenizer, records = clean.tokenizer, _records()
    candidates = _plain_option_ids(tokenizer, records)
    node = {**TINY, "logit_distortion": {"bias": 2.0, "seed": 3}}
    first = resolve_distortion(node, tokenizer, records, prompt="plain")
    assert first.candidates == len(candidates)
    assert len(first.token_ids) == round(0.5 * len(candidates))
    assert set(first.token_ids) <= candidates
    assert resolve_distortion(node, tokenizer, records, prompt="plain") == first
    other = {**TINY, "logit_distortion": {"bias": 2.0, "seed": 4}}
    assert resolve_distortion(other, tokenizer, records, prompt="plain").token_ids != (
        first.token_ids
    )
    listed = {**TINY, "logit_distortion": {"tokens": [7, 9, 11, 13], "fraction": 1.0}}
    assert resolve_distortion(listed, tokenizer, records).token_ids == (7, 9, 11, 13)
    d, l_ = first.inverse(len(tokenizer))
    assert torch.all(d == 1.0) and l_[list(first.token_ids)].eq(-2.0).all()
    assert l_.abs().sum().item() == pytest.approx(2.0 * len(first.token_ids))


def test_the_distortion_enters_the_base_cache_key(compose):
    cpu = type("T", (), {})()
    cpu.strategy = type("S", (), {"root_device": torch.device("cpu")})()
    cpu.precision, cpu.world_size = "32-true", 1

    def digest(*overrides):
        cfg = compose([*RUN, "method=ts", *overrides], "/tmp/unused")
        return base_fingerprint(cfg, method_class(cfg), _records(), cpu).digest

    clean_key = digest()
    keys = {
        digest("model.logit_distortion={bias: 2.0}"),
        digest("model.logit_distortion={bias: 3.0}"),
        digest("model.logit_distortion={bias: 2.0, seed: 1}"),
        digest("model.logit_distortion={bias: 2.0, fraction: 0.25}"),
    }
    assert clean_key not in keys and len(keys) == 4


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{tokens: [5, 999999]}", r"model\.logit_distortion\.tokens holds ids \[999999\]"),
        ("{bias: inf}", r"model\.logit_distortion\.bias=inf must be a finite number"),
        ("{bias: nan}", r"model\.logit_distortion\.bias=nan must be a finite number"),
        ("{tokens: [5], fraction: 0.4}", r"model\.logit_distortion\.fraction=0\.4 of 1"),
        ("{tokens: []}", r"model\.logit_distortion\.tokens=\[\] must be"),
        ("{scale: 2}", r"model\.logit_distortion=.* has unknown keys \['scale'\]"),
    ],
)
def test_bad_distortions_are_refused_before_the_model_loads(
    tmp_path, monkeypatch, compose, value, message
):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose([*RUN, "method=base", f"model.logit_distortion={value}"], tmp_path)
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg)


def test_an_open_qa_test_split_has_no_option_tokens(clean):
    with pytest.raises(ConfigError, match=r"model\.logit_distortion\.tokens=options: the test"):
        resolve_distortion({**TINY, "logit_distortion": {"bias": 1.0}}, clean.tokenizer, [])


def test_a_model_loaded_alone_refuses_an_unresolved_distortion():
    with pytest.raises(ConfigError, match=r"model\.logit_distortion=.*only a run"):
        load_language_model({**TINY, "logit_distortion": {"bias": 1.0}})


def test_export_refuses_a_distorted_run(tmp_path, compose):
    from calm_lightning.exported.saved_run import inspect_run

    cfg = compose([*RUN, "method=base", "model.logit_distortion={bias: 2.0}"], tmp_path)
    result = run_experiment(cfg)
    saved = result.extra["logit_distortion"]
    assert saved["bias"] == 2.0 and saved["n_tokens"] == len(saved["token_ids"]) > 0
    for exporting in (True, False):
        with pytest.raises(ExportError, match=r"model\.logit_distortion=.*hook"):
            inspect_run(tmp_path, exporting=exporting)
