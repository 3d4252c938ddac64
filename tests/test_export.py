"""Exporting a run's calibrated model (`python -m calm_lightning.export`) and using it: a short
CALM run of the tiny model is exported merged and unmerged, then scored in a fresh process with
plain transformers + the logits processor, and compared with the run's own predictions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.errors import ExportError
from calm_lightning.export import main, parse_arguments
from calm_lightning.exported.writer import export_run
from calm_lightning.pipeline import run_experiment

ROOT = Path(__file__).resolve().parents[1]
N_TEST = 8
TINY_CALM = [
    "model=tiny",
    "method=calm",
    "setting=demo",
    f"setting.test.limit={N_TEST}",
    "peft.r=4",
    "trainer.limit_train_batches=2",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "method.module.inner_steps=1",
    "method.module.lower_lr=0.01",  # adapters that move the option scores measurably
    "method.module.upper_lr=0.5",  # and a head that does too
]
# Plain prompts: the random tiny model tends to repeat a prompt's last token, which after a
# chat template's final newline would end the answer at once.
GENERATION_PROMPTS = ["Question: what is two plus two? Answer:", "The primary colours are"]

# Runs in a fresh interpreter with the repository on PYTHONPATH: plain transformers (and peft
# for the merge=false folder) plus the logits processor, the prompt built from calibration.json.
PLAIN_SCORING = r"""
import json, sys
import calm_lightning
cheap = "torch" not in sys.modules  # `import calm_lightning` imports nothing heavy
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from calm_lightning import CalibrationLogitsProcessor

questions = json.load(open(sys.argv[1]))
result = {"cheap_import": cheap}
for folder in sys.argv[2:]:
    info = json.load(open(f"{folder}/calibration.json"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if info["weights"]["adapter"] == "adapter":
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, f"{folder}/adapter").eval()
    processor = CalibrationLogitsProcessor.from_pretrained(folder)
    prompt, tokens = info["prompt"], info["option_tokens"]
    letters = tokens["letters"]
    rows = []
    for q in questions:
        options = "\n".join(f"{a}. {text}" for a, text in zip(letters, q["choices"]))
        listed = ", ".join(letters[:-1]) + " or " + letters[-1]
        user = prompt["user_text"].format(question=q["question"], options=options, letters=listed)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=prompt["add_special_tokens"], return_tensors="pt")
        with torch.no_grad():
            scores = model(**ids).logits[:, -1]
        calibrated = processor(ids["input_ids"], scores)[0, tokens["ids"]]
        rows.append(calibrated.double().softmax(-1).tolist())
    result[folder] = rows
result["lightning_or_hydra"] = sorted(m for m in ("lightning", "hydra") if m in sys.modules)
print(json.dumps(result))
"""


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _predictions(run_dir: Path) -> np.ndarray:
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    return np.array([json.loads(line)["probs"] for line in lines])


@pytest.fixture(scope="module")
def calm_run(tiny_calm_run) -> Path:
    """The session's tiny CALM run (conftest.py, TINY_CALM: 8 test questions)."""
    return tiny_calm_run


@pytest.fixture(scope="module")
def exported(calm_run, tmp_path_factory) -> dict[str, Path]:
    """The CALM run exported merged (the default) and with merge=false."""
    root = tmp_path_factory.mktemp("exports")
    return {
        "merged": export_run(calm_run, root / "merged"),
        "unmerged": export_run(calm_run, root / "unmerged", merge=False),
    }


@pytest.mark.integration
def test_exported_folder_scores_like_the_run_with_plain_transformers(calm_run, exported, tmp_path):
    records = EmbeddedDemoSource("mcqa", "test", limit=N_TEST).load()
    questions = tmp_path / "questions.json"
    questions.write_text(
        json.dumps([{"question": r.question, "choices": list(r.choices)} for r in records])
    )
    folders = [str(exported["merged"]), str(exported["unmerged"])]
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_SCORING, str(questions), *folders],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cheap_import"] and result["lightning_or_hydra"] == []
    expected = _predictions(calm_run)
    for folder in folders:
        np.testing.assert_allclose(np.array(result[folder]), expected, atol=1e-5)
    # The comparison has teeth: calibration moved these numbers well beyond the tolerance.
    assert np.abs(_predictions(calm_run / "base") - expected).max() > 1e-3


def test_the_folder_layout_and_calibration_json(calm_run, exported):
    merged, unmerged = exported["merged"], exported["unmerged"]
    names = {p.name for p in merged.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "calibration.json",
        "logit_adjustment.safetensors",
        "README.md",
        "reliability.png",
        "reliability_base.png",
    } <= names
    assert "adapter" not in names and not (merged / "adapter_config.json").exists()
    assert not [p for p in merged.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    info = json.loads((merged / "calibration.json").read_text())
    run_metrics = json.loads((calm_run / "metrics.json").read_text())
    assert info["formula"] == "z' = d * (z - c) + l"
    assert info["head"]["kind"] == "vector" and info["terms"]["c"] == "c = 0"
    assert info["option_tokens"] == run_metrics["option_tokens"]
    assert info["method"]["name"] == "calm" and info["weights"]["adapter"] == "merged"
    assert info["weights"]["dtype"] == "float32" and not info["weights"]["trained_on_4bit_base"]
    # The run recorded the base precision the export follows.
    record = json.loads((calm_run / "calibration" / "calibrated_lm.json").read_text())
    assert record["base_dtype"] == "float32" and record["base_4bit"] is False
    # merge=false: the untouched base at the root, the run's adapter beside it.
    assert json.loads((unmerged / "calibration.json").read_text())["weights"]["adapter"] == (
        "adapter"
    )
    from safetensors.torch import load_file

    merged_weights, base_weights = (load_file(f / "model.safetensors") for f in (merged, unmerged))
    assert merged_weights.keys() == base_weights.keys()
    name = next(k for k in merged_weights if k.endswith("q_proj.weight"))
    assert not torch.allclose(merged_weights[name], base_weights[name], atol=1e-4)
    adapter = unmerged / "adapter"
    assert (adapter / "adapter_model.safetensors").read_bytes() == (
        calm_run / "calibration" / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] is (
        None  # the tiny model has no Hub id
    )


def test_the_model_card(calm_run, exported):
    text = (exported["merged"] / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers" and "calm" in meta["tags"]
    assert "base_model" not in meta  # the tiny model has none on the Hub
    comparison = json.loads((calm_run / "metrics.json").read_text())["comparison"]
    for name in ("base", "calm"):
        row = next(line for line in body.splitlines() if line.startswith(f"| {name} |"))
        assert f"{comparison[name]['conf_ece']:.4f}" in row
        assert f"{comparison[name]['nll']:.4f}" in row
    assert "](reliability.png)" in body and "](reliability_base.png)" in body
    assert "demo_mcqa_test" in body and f"| {N_TEST} |" in body  # data_summary.json
    assert "upper_lr: 0.5" in body and "r: 4" in body  # the method and peft blocks
    unmerged = (exported["unmerged"] / "README.md").read_text()
    assert 'PeftModel.from_pretrained(model, f"{folder}/adapter")' in unmerged


def test_load_calibrated_scores_like_the_run(calm_run, exported):
    from calm_lightning import load_calibrated

    records = EmbeddedDemoSource("mcqa", "test", limit=N_TEST).load()
    expected = _predictions(calm_run)
    for folder in exported.values():
        calibrated = load_calibrated(folder, device="cpu")
        probs = [calibrated.option_probabilities(r.question, list(r.choices)) for r in records]
        np.testing.assert_allclose(np.array(probs), expected, atol=1e-5)


def test_greedy_generation_with_the_processor_equals_the_project_sampler(calm_run, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, pipeline

    from calm_lightning import CalibrationLogitsProcessor, load_calibrated
    from calm_lightning.evaluation.sampling import sample_answers
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model

    cfg = OmegaConf.load(calm_run / "config_resolved.yaml")
    fresh = load_language_model(cfg.model)
    project = CalibratedLM.load(fresh.model, calm_run / "calibration").eval()
    options = {"n": 1, "max_new_tokens": 8, "temperature": 0, "stop_on_newline": False}
    expected = sample_answers(project, fresh.tokenizer, GENERATION_PROMPTS, **options)

    folder = exported["merged"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processors = LogitsProcessorList([CalibrationLogitsProcessor.from_pretrained(folder)])
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    calibrated = load_calibrated(folder, device="cpu")
    changed = []
    for prompt, answers in zip(GENERATION_PROMPTS, expected, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **ids, do_sample=False, max_new_tokens=8, logits_processor=processors
            )
            uncalibrated = model.generate(**ids, do_sample=False, max_new_tokens=8)
        changed.append(not torch.equal(out, uncalibrated))
        new = out[0, ids["input_ids"].shape[1] :].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(new, skip_special_tokens=True)
        assert answers == [text.strip()] and text.strip()
        # The text-generation pipeline and load_calibrated's generate pass it on the same way.
        piped = generator(
            prompt,
            logits_processor=processors,
            do_sample=False,
            max_new_tokens=8,
            return_full_text=False,
        )
        assert piped[0]["generated_text"].strip() == text.strip()
        answer = calibrated.generate(prompt, chat=False, do_sample=False, max_new_tokens=8)
        assert answer.strip() == text.strip()
    assert any(changed)  # the head changes what greedy decoding picks


@pytest.fixture(scope="module")
def ts_run(tmp_path_factory, compose):
    """A post-hoc temperature-scaling run of an over-confident tiny model: (run dir, config)."""
    run_dir = tmp_path_factory.mktemp("ts_run")
    overrides = [
        "model=tiny",
        "model.logit_scale=3.0",  # an overconfident model: T clearly away from 1
        "method=ts",
        "setting=demo_posthoc",
        "setting.test.source.limit=40",
        "trainer.enable_progress_bar=false",
        "logger=none",
    ]
    cfg = compose(overrides, run_dir)
    run_experiment(cfg)
    return run_dir, cfg


def test_temperature_only_export_divides_the_base_logits_by_t(ts_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from calm_lightning import CalibrationLogitsProcessor, load_calibrated
    from calm_lightning.models.loading import load_language_model

    run_dir, cfg = ts_run
    folder = export_run(run_dir, tmp_path / "ts_export", fold="false")  # the head kept apart
    temperature = json.loads((run_dir / "metrics.json").read_text())["posthoc"]["temperature"]
    info = json.loads((folder / "calibration.json").read_text())
    assert info["head"]["kind"] == "scalar" and info["weights"]["adapter"] is None
    assert info["serving"]["calibration"] == "custom_code"
    assert info["head"]["temperature"] == pytest.approx(temperature, rel=1e-6)
    assert info["method"]["fitted"]["temperature"] == temperature
    assert abs(temperature - 1.0) > 0.1
    processor = CalibrationLogitsProcessor.from_pretrained(folder)
    assert processor.temperature == pytest.approx(temperature, rel=1e-6)
    # The exported weights are the base model's: same logits; the processor divides by T.
    base = load_language_model(cfg.model).model
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 17, 300, 41, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1]
        torch.testing.assert_close(logits, base(input_ids=ids).logits[:, -1])
    torch.testing.assert_close(processor(ids, logits), logits / temperature, rtol=1e-6, atol=1e-5)
    # And the run's predictions come back through load_calibrated.
    records_ids = [json.loads(line)["id"] for line in (run_dir / "predictions.jsonl").open()]
    from hydra.utils import instantiate

    by_id = {r.id: r for r in instantiate(cfg.setting.test).load()}
    calibrated = load_calibrated(folder, device="cpu")
    probs = [
        calibrated.option_probabilities(by_id[i].question, list(by_id[i].choices))
        for i in records_ids[:6]
    ]
    np.testing.assert_allclose(np.array(probs), _predictions(run_dir)[:6], atol=1e-5)


@pytest.mark.integration
def test_adapter_only_method_exports_without_head_and_in_another_dtype(calm_run, tmp_path, compose):
    """reg / ls / cft train adapters only: no head file, an identity processor. Built from
    the CALM run's files (its adapter, no head) under a reg config, without training again."""
    from safetensors.torch import load_file

    from calm_lightning import CalibrationLogitsProcessor

    run_dir = _saved_config(compose, tmp_path, ["method=reg"])
    shutil.copytree(
        calm_run / "calibration",
        run_dir / "calibration",
        ignore=shutil.ignore_patterns("logit_adjustment.safetensors"),
    )
    shutil.copyfile(calm_run / "metrics.json", run_dir / "metrics.json")
    folder = export_run(run_dir, tmp_path / "out", dtype="bfloat16")
    info = json.loads((folder / "calibration.json").read_text())
    assert info["head"] is None and info["formula"].startswith("z' = z")
    assert info["weights"] == {
        "adapter": "merged",
        "dtype": "bfloat16",
        "trained_on_4bit_base": False,
        "logit_scale": 1.0,
    }
    assert not (folder / "logit_adjustment.safetensors").exists()
    processor = CalibrationLogitsProcessor.from_pretrained(folder)
    scores = torch.randn(2, 7)
    assert processor(None, scores) is scores and processor.temperature is None
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(folder / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_processor_keeps_masked_tokens_masked():
    from calm_lightning import CalibrationLogitsProcessor
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    head = LogitAdjustment(6, kind="vector", center="mean")
    with torch.no_grad():
        head.scale.copy_(torch.linspace(0.5, 1.5, 6))
        head.bias.copy_(torch.linspace(-1, 1, 6))
    processor = CalibrationLogitsProcessor(head)
    scores = torch.tensor([[1.0, 2.0, -float("inf"), 0.5, 3.0, -1.0]])
    out = processor(torch.zeros(1, 1, dtype=torch.long), scores)
    allowed = torch.tensor([0, 1, 3, 4, 5])
    z = scores[0, allowed]
    expected = head.scale[allowed] * (z - z.mean()) + head.bias[allowed]
    torch.testing.assert_close(out[0, allowed], expected.detach())
    assert out[0, 2] == -float("inf")
    # Nothing masked: exactly the head.
    full = torch.randn(2, 6)
    torch.testing.assert_close(processor(None, full), head(full).detach())


# ----- errors -----


def _saved_config(compose, tmp_path: Path, overrides: list[str]) -> Path:
    """A run folder holding only its config, resolved as a run writes it."""
    from calm_lightning.runtime.run_record import write_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, compose(["model=tiny", *overrides], run_dir))
    return run_dir


def test_missing_run_dir_and_non_run_dir(tmp_path):
    with pytest.raises(ExportError, match="no such run directory"):
        export_run(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ExportError, match="is not a run directory .no config_resolved.yaml"):
        export_run(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(
    ("method", "reason"),
    [
        ("base", "evaluates the model as it is"),
        ("ic", "computed at evaluation time"),
        ("cape", "computed at evaluation time"),
        ("elicitation", "computed at evaluation time"),
    ],
)
def test_methods_that_change_nothing_are_refused(method, reason, tmp_path, compose):
    run_dir = _saved_config(compose, tmp_path, [f"method={method}"])
    with pytest.raises(ExportError, match=f"method={method} has nothing to export") as err:
        export_run(run_dir, tmp_path / "out")
    assert reason in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unknown_method_is_refused(tmp_path, compose):
    run_dir = _saved_config(compose, tmp_path, ["method=calm"])
    cfg = OmegaConf.load(run_dir / "config_resolved.yaml")
    cfg.method.name = "magic"
    cfg.method.module._target_ = "calm_lightning.methods.magic.Magic"
    OmegaConf.save(cfg, run_dir / "config_resolved.yaml")
    with pytest.raises(ExportError, match="unknown method 'magic'"):
        export_run(run_dir, tmp_path / "out")


def test_run_without_calibration_is_refused(calm_run, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config_resolved.yaml", "metrics.json"):
        shutil.copyfile(calm_run / name, partial / name)
    with pytest.raises(ExportError, match="has no calibration/ folder") as err:
        export_run(partial, tmp_path / "out")
    assert "ckpt_path=" in str(err.value)


def test_existing_output_needs_overwrite_and_failures_leave_nothing(
    calm_run, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "calibration.json").write_text("{}")  # an earlier export (what overwrite replaces)
    (out / "old.txt").write_text("previous export")
    with pytest.raises(ExportError, match="out=.* exists; pass overwrite=true"):
        export_run(calm_run, out)
    # A failure half-way (here: writing the model card) leaves the old folder as it was and
    # no partial folder beside it.
    import calm_lightning.exported.model_card

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(calm_lightning.exported.model_card, "write_model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_run(calm_run, out, overwrite=True)
    with pytest.raises(RuntimeError, match="disk full"):
        export_run(calm_run, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json", "old.txt"]
    monkeypatch.undo()
    export_run(calm_run, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_arguments(tmp_path, capsys):
    options = parse_arguments([f"run_dir={tmp_path}", "out=x", "merge=false", "overwrite=true"])
    assert options.run_dir == tmp_path and options.out == Path("x")
    assert options.merge is False and options.overwrite is True and options.dtype == "auto"
    assert main(["run_dir=a", "colour=red"]) == 1
    assert "unknown argument 'colour=red'" in capsys.readouterr().err
    assert main(["out=x"]) == 1
    assert "missing run_dir=" in capsys.readouterr().err
    assert main([f"run_dir={tmp_path}", "out=x", "merge=perhaps"]) == 1
    assert "merge='perhaps' is not true or false" in capsys.readouterr().err


@pytest.mark.integration
def test_command_line_prints_the_error_without_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "calm_lightning.export",
            f"run_dir={tmp_path / 'nowhere'}",
            f"out={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 1
    assert "error: run_dir=" in done.stderr and "no such run directory" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_a_cloze_run_exports_its_scoring_and_load_calibrated_reproduces_it(tmp_path, compose):
    """A cloze-scored CALM run: calibration.json says how options were scored, and
    load_calibrated's option probabilities equal the run's predictions (cloze path)."""
    from calm_lightning import load_calibrated

    run_dir = tmp_path / "cloze_run"
    overrides = [*TINY_CALM, "evaluation.scoring=cloze", "evaluation.cloze.prompt=plain"]
    overrides = [o for o in overrides if not o.startswith("setting.test.limit")]
    run_experiment(compose([*overrides, "setting.test.limit=4"], run_dir))
    folder = export_run(run_dir, tmp_path / "cloze_export")
    prompt = json.loads((folder / "calibration.json").read_text())["prompt"]
    assert prompt["scoring"] == "cloze" and prompt["template"] == "plain"
    assert prompt["continuation"] == "' {option}'" and prompt["normalize"] == "none"
    records = EmbeddedDemoSource("mcqa", "test", limit=4).load()
    calibrated = load_calibrated(folder, device="cpu")
    probs = [calibrated.option_probabilities(r.question, list(r.choices)) for r in records]
    np.testing.assert_allclose(np.array(probs), _predictions(run_dir), atol=1e-5)
    card = (folder / "README.md").read_text()
    assert "scored by **cloze**" in card and "normalisation `none`" in card
    assert "option letters" not in card and "token ids []" not in card


# ----- serving: the calibration travels with the weights -----

# Runs where `import calm_lightning` fails: plain transformers only, with or without the
# folder's custom code. Prints next-token probabilities, a greedy and a beam-search decoding.
NO_PROJECT = r"""
import json, sys
sys.modules["calm_lightning"] = None  # `import calm_lightning` raises ImportError from here on
try:
    import calm_lightning
    blocked = False
except ImportError:
    blocked = True
import torch
from transformers import AutoModelForCausalLM

args = json.loads(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(
    args["folder"], trust_remote_code=args["remote"], dtype=torch.float32
).eval()
if args.get("adapter"):  # a merge=false folder, as its model card loads it
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, args["folder"] + "/adapter").eval()
ids = torch.tensor(args["ids"])
steps = args["steps"]
with torch.no_grad():
    probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    greedy = model.generate(
        ids[:1], do_sample=False, max_new_tokens=steps, min_new_tokens=steps
    )
    beam = model.generate(
        ids[:1], do_sample=False, num_beams=3, max_new_tokens=steps, min_new_tokens=steps
    )
print(json.dumps({"blocked": blocked, "class": type(model).__name__, "probs": probs.tolist(),
                  "greedy": greedy[0].tolist(), "beam": beam[0].tolist()}))
"""
PROBE_IDS = [[5, 17, 300, 41, 9, 1200], [88, 7, 7, 2301, 15, 4]]
STEPS = 4


def _without_project(folder: Path, remote: bool, tmp_path: Path, adapter: bool = False) -> dict:
    env = _env()
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")  # custom code copied here
    args = {"folder": str(folder), "remote": remote, "ids": PROBE_IDS, "steps": STEPS}
    args["adapter"] = adapter
    done = subprocess.run(
        [sys.executable, "-c", NO_PROJECT, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["blocked"]
    return result


def _greedy(logits_fn, ids: list[int], steps: int, eos: int) -> list[int]:
    """Greedy decoding by hand on `logits_fn` (ids -> next-token logits), EOS excluded."""
    seq = list(ids)
    for _ in range(steps):
        logits = logits_fn(seq).double()
        logits[eos] = -float("inf")
        seq.append(int(logits.argmax()))
    return seq


def _beam_search(logits_fn, ids: list[int], steps: int, beams: int, eos: int) -> list[int]:
    """Beam search by hand: keep the `beams` best sequences by summed log-probability of the
    calibrated distribution (EOS excluded, as min_new_tokens does); the best at the end."""
    kept = [(0.0, list(ids))]
    for _ in range(steps):
        candidates = []
        for score, seq in kept:
            logits = logits_fn(seq).double()
            logits[eos] = -float("inf")
            log_probs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(log_probs, beams)
            candidates += [
                (score + float(v), [*seq, int(i)])
                for v, i in zip(top.values, top.indices, strict=True)
            ]
        kept = sorted(candidates, key=lambda c: -c[0])[:beams]
    return kept[0][1]


def _project_logits(calibrated):
    def logits_fn(seq: list[int]) -> torch.Tensor:
        ids = torch.tensor([seq])
        with torch.no_grad():
            return calibrated(ids, torch.ones_like(ids))[0, -1]

    return logits_fn


@pytest.mark.integration
def test_a_temperature_run_folds_into_the_weights_and_serves_without_the_project(ts_run, tmp_path):
    """Must-show: a folded TS export of the tiny (tied) model keeps its embeddings tied, and
    plain AutoModelForCausalLM, where `import calm_lightning` fails, gives the calibrated
    next-token distribution (base / T) to 1e-5 in fp32."""
    from safetensors.torch import load_file

    from calm_lightning import CalibrationLogitsProcessor, load_calibrated
    from calm_lightning.models.loading import load_language_model

    run_dir, cfg = ts_run
    folder = export_run(run_dir, tmp_path / "folded")  # fold=auto: a scalar head folds
    info = json.loads((folder / "calibration.json").read_text())
    temperature = info["head"]["temperature"]
    assert info["serving"]["calibration"] == "folded" and not info["serving"]["trust_remote_code"]
    assert info["serving"]["max_probability_error"] < 1e-5
    assert info["head"]["file"] is None and not (folder / "logit_adjustment.safetensors").exists()
    assert info["serving"]["folded_into"] == "final_norm"
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "auto_map" not in config
    assert not (folder / "modeling_calibrated.py").exists()

    base = load_language_model(cfg.model).model.eval()
    ids = torch.tensor(PROBE_IDS)
    with torch.no_grad():
        expected = torch.softmax(base(input_ids=ids).logits[:, -1] / temperature, dim=-1)
    result = _without_project(folder, remote=False, tmp_path=tmp_path)
    assert result["class"] == "LlamaForCausalLM"
    probs = torch.tensor(result["probs"])
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=0)
    # Teeth: the temperature moved these probabilities well beyond the tolerance.
    with torch.no_grad():
        untouched = torch.softmax(base(input_ids=ids).logits[:, -1], dim=-1)
    assert (untouched - expected).abs().max() > 1e-2
    # Still tied: one embedding, the base's; only the final norm carries 1 / T.
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in weights
    torch.testing.assert_close(weights["model.embed_tokens.weight"], base.model.embed_tokens.weight)
    torch.testing.assert_close(weights["model.norm.weight"], base.model.norm.weight / temperature)
    # The project's readers apply nothing on top.
    assert CalibrationLogitsProcessor.from_pretrained(folder).head is None
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").open()][:4]
    from hydra.utils import instantiate

    by_id = {r.id: r for r in instantiate(cfg.setting.test).load()}
    calibrated = load_calibrated(folder, device="cpu")
    probs = [
        calibrated.option_probabilities(by_id[r["id"]].question, list(by_id[r["id"]].choices))
        for r in records
    ]
    np.testing.assert_allclose(np.array(probs), _predictions(run_dir)[:4], atol=1e-5)


@pytest.mark.slow  # a whole evaluation run; the default suite keeps to ~15 minutes
def test_a_folded_export_evaluates_as_a_base_model(ts_run, tmp_path, compose):
    """The MCQA evaluation of a folded export: `method=base model.local_path=<export>` scores
    the run's test questions as the TS run did."""
    run_dir, cfg = ts_run
    folder = export_run(run_dir, tmp_path / "folded")
    overrides = [
        "model=smollm2",
        f"model.local_path={folder}",
        "method=base",
        f"evaluation.scoring={cfg.evaluation.scoring}",  # the tiny run's, not SmolLM2's default
        "setting=demo_posthoc",
        "setting.test.source.limit=40",
        "trainer.enable_progress_bar=false",
        "logger=none",
    ]
    run_experiment(compose(overrides, tmp_path / "served"))
    np.testing.assert_allclose(_predictions(tmp_path / "served"), _predictions(run_dir), atol=1e-5)


def _untied(model):
    """`model` with an output layer of its own (a copy of the tied embedding)."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(config).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.get_input_embeddings().weight.detach().clone()
    untied.load_state_dict(state)
    return untied


def test_fold_head_is_exact_where_it_folds_and_refuses_where_it_cannot(compose):
    """Each foldable head kind against head(logits) computed by hand: scalar heads into the
    final norm (the tied embedding untouched), vector heads into an untied output layer only;
    the others refused with the reason."""
    from calm_lightning.exported.folding import fold_head, fold_obstacle, fold_target
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    cfg = compose(["model=tiny"])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, (2, 6), generator=generator)
    cases = [("scalar", "none"), ("scalar", "logsumexp"), ("vector", "none"), ("vector", "mean")]
    for kind, center in cases:
        model = load_language_model(cfg.model).model.eval()
        if kind == "vector":
            model = _untied(model)
        embedding = model.model.embed_tokens.weight.detach().clone()
        head = LogitAdjustment(model.config.vocab_size, kind=kind, center=center)
        with torch.no_grad():
            head.scale.copy_(0.3 + torch.rand(head.scale.shape, generator=generator))
            head.bias.fill_(0.7)  # the same for every token: cancels in the softmax
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            z = logits - (logits.mean(-1, keepdim=True) if center == "mean" else 0)
            expected = torch.softmax(head.scale * z + 0.7, dim=-1)
        target = "final_norm" if kind == "scalar" else "output_layer"
        assert fold_target(head, model, adapted_output=False) == (target, None)
        error = fold_head(model, head, ids)
        with torch.no_grad():
            folded = torch.softmax(model(input_ids=ids).logits, dim=-1)
        torch.testing.assert_close(folded, expected, atol=1e-5, rtol=0)
        assert error < 1e-5
        assert (torch.softmax(logits, -1) - expected).abs().max() > 1e-3
        torch.testing.assert_close(model.model.embed_tokens.weight, embedding, atol=0, rtol=0)
        if kind == "scalar":  # still tied: one tensor, the embedding as it was
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = load_language_model(cfg.model).model
    vector = LogitAdjustment(model.config.vocab_size, kind="vector", center="none")
    assert "tie_word_embeddings" in fold_obstacle(vector, model, adapted_output=False)
    assert "adapter" in fold_obstacle(vector, _untied(model), adapted_output=True)
    with torch.no_grad():
        vector.bias[3] = 1.0
    assert "per-token bias" in fold_obstacle(vector, model, adapted_output=False)
    centred = LogitAdjustment(model.config.vocab_size, kind="vector", center="logsumexp")
    assert "logsumexp" in fold_obstacle(centred, model, adapted_output=False)
    scalar = LogitAdjustment(model.config.vocab_size, kind="scalar")
    assert fold_obstacle(scalar, model, adapted_output=True) is None  # the norm is not adapted
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in fold_obstacle(scalar, model, adapted_output=False)
    model.config.final_logit_softcapping = None
    model.config.model_type = "olmo"
    assert "NORM_FORMS" in fold_obstacle(scalar, model, adapted_output=False)


@pytest.mark.integration
def test_a_calm_export_carries_its_head_as_custom_code(calm_run, exported, tmp_path):
    """Must-show: the CALM vector head (per-token l: not foldable) loaded with
    trust_remote_code where `import calm_lightning` fails gives the calibrated next-token
    distribution, and greedy and beam-search generate decode the calibrated model."""
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model

    folder = exported["merged"]
    info = json.loads((folder / "calibration.json").read_text())
    assert info["serving"]["calibration"] == "custom_code"
    assert "per-token bias" in info["serving"]["why_not_folded"]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoModelForCausalLM": "modeling_calibrated.CalibratedForCausalLM"
    }
    assert {"modeling_calibrated.py", "logit_adjustment.py", "calibration_processor.py"} <= {
        p.name for p in folder.iterdir()
    }
    cfg = OmegaConf.load(calm_run / "config_resolved.yaml")
    fresh = load_language_model(cfg.model)
    project = CalibratedLM.load(fresh.model, calm_run / "calibration").eval()
    ids = torch.tensor(PROBE_IDS)
    with torch.no_grad():
        expected = torch.softmax(project(ids, torch.ones_like(ids))[:, -1].double(), -1)
        plain = torch.softmax(project.raw_logits(ids, torch.ones_like(ids))[:, -1].double(), -1)
    assert (plain - expected).abs().max() > 1e-3  # the head matters here
    eos = fresh.tokenizer.eos_token_id
    logits_fn = _project_logits(project)
    remote = _without_project(folder, remote=True, tmp_path=tmp_path)
    assert remote["class"] == "CalibratedLlamaForCausalLM"
    np.testing.assert_allclose(np.array(remote["probs"]), expected.numpy(), atol=1e-4)
    assert remote["greedy"] == _greedy(logits_fn, PROBE_IDS[0], STEPS, eos)
    assert remote["beam"] == _beam_search(logits_fn, PROBE_IDS[0], STEPS, 3, eos)
    # merge=false: the card's snippet, trust_remote_code and the adapter on top, is the same.
    unmerged = _without_project(exported["unmerged"], remote=True, tmp_path=tmp_path, adapter=True)
    np.testing.assert_allclose(np.array(unmerged["probs"]), expected.numpy(), atol=1e-4)
    assert unmerged["greedy"] == remote["greedy"]
    card = (exported["unmerged"] / "README.md").read_text()
    remote_block = card.split("trust_remote_code=True)\n", 1)[1].split("```", 1)[0]
    assert 'PeftModel.from_pretrained(model, f"{folder}/adapter")' in remote_block
    # Without trust_remote_code: the base architecture's checkpoint, the uncalibrated model.
    uncalibrated = _without_project(folder, remote=False, tmp_path=tmp_path)
    assert uncalibrated["class"] == "LlamaForCausalLM"
    np.testing.assert_allclose(np.array(uncalibrated["probs"]), plain.numpy(), atol=1e-4)


def test_the_processor_is_exact_under_beam_search_or_refuses(calm_run, exported, compose):
    """Beam search hands processors log-probabilities: a logsumexp-centred vector head still
    decodes the calibrated model exactly; the CALM head (vector, no centering) refuses."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from calm_lightning import CalibrationLogitsProcessor
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    folder = exported["merged"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROBE_IDS[:1])
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    options = {"do_sample": False, "num_beams": 3, "max_new_tokens": STEPS}
    options["min_new_tokens"] = STEPS
    refusing = LogitsProcessorList(
        [CalibrationLogitsProcessor.from_pretrained(folder, scores="log_probs")]
    )
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        model.generate(ids, logits_processor=refusing, **options)
    # Built for logits (the default) and handed beam search's log-probabilities: it says so.
    for_logits = LogitsProcessorList([CalibrationLogitsProcessor.from_pretrained(folder)])
    with pytest.raises(ValueError, match='scores="log_probs"'):
        model.generate(ids, logits_processor=for_logits, **options)

    head = LogitAdjustment(model.config.vocab_size, kind="vector", center="logsumexp")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.scale.copy_(0.2 + 1.5 * torch.rand(head.vocab_size, generator=generator))
        head.bias.copy_(torch.randn(head.vocab_size, generator=generator))
    processors = LogitsProcessorList([CalibrationLogitsProcessor(head, scores="log_probs")])
    with torch.no_grad():
        out = model.generate(ids, logits_processor=processors, **options)[0].tolist()
        plain = model.generate(ids, **options)[0].tolist()
    expected = _beam_search(_project_logits(CalibratedLM(model, head)), ids[0].tolist(), STEPS,
                            3, eos)  # fmt: skip
    assert out == expected and out != plain


def test_the_card_names_its_protocol_and_holds_no_local_path(calm_run, exported, tmp_path):
    """Hub front matter complete; the serving note first; no absolute path in any file."""
    folder = exported["merged"]
    text = (folder / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    for key in ("library_name", "license", "language", "tags", "model-index"):
        assert meta[key], key
    assert meta["license"] == "other" and "custom_code" in meta["tags"]  # the tiny model's
    (result,) = meta["model-index"][0]["results"]
    run_metrics = json.loads((calm_run / "metrics.json").read_text())["metrics"]
    values = {m["type"]: m["value"] for m in result["metrics"]}
    assert values["conf_ece"] == pytest.approx(run_metrics["conf_ece"], abs=1e-6)
    assert values["accuracy"] == pytest.approx(run_metrics["accuracy"], abs=1e-6)
    # The serving note comes before anything else: whether a server gets the calibration.
    first_section = body.split("\n## ")[1]
    assert first_section.startswith("Serving") and "trust_remote_code=True" in first_section
    assert "uncalibrated" in first_section
    assert "option letters" in body and "cloze" not in body.split("## Evaluation")[0].lower()
    for path in folder.rglob("*"):
        if path.suffix in (".json", ".md", ".py", ".jinja", ".txt"):
            content = path.read_text()
            for private in (str(ROOT), str(calm_run), str(Path.home()), "/tmp/"):
                assert private not in content, (path.name, private)


def test_the_front_matter_lists_the_settings_hub_datasets(compose, ood_overrides):
    from calm_lightning.exported.model_card import hub_datasets

    cfg = compose(["model=smollm2", "method=calm", *ood_overrides])
    assert set(hub_datasets(cfg.setting)) == {
        "tatsu-lab/alpaca",
        "cais/mmlu",
        "openlifescienceai/medmcqa",
        "allenai/openbookqa",
        "allenai/ai2_arc",
    }
    assert cfg.model.license == "apache-2.0"


@pytest.mark.slow
def test_lm_evals_own_hf_model_on_the_calm_export_matches_our_retention(
    calm_run, exported, tmp_path
):
    """Must-show: `lm_eval --model hf --model_args pretrained=<export>,trust_remote_code=True`
    scores PIQA (local files) as our retention scores the run: same accuracy (within 0.01) and
    the same per-choice log-likelihoods, which the head changes."""
    from calm_lightning.evaluation.lm_eval_tasks import local_task_config
    from calm_lightning.retention import evaluate_run

    piqa = str(ROOT / "tests" / "fixtures" / "hub" / "piqa.jsonl")
    arguments = {"tasks": ["piqa"], "data_files": {"piqa": [piqa]}}
    ours = json.loads(evaluate_run(calm_run, arguments, out=tmp_path / "ours").read_text())
    served = json.loads(
        evaluate_run(exported["merged"], arguments, out=tmp_path / "served").read_text()
    )
    assert served["rows"]["export"]["piqa"]["acc"] == ours["rows"]["calm"]["piqa"]["acc"]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    config = {**local_task_config("piqa", (piqa,), ""), "task": "piqa_local"}
    (tasks / "piqa_local.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = _env()
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={exported['merged']},trust_remote_code=True,dtype=float32",
        "--tasks", "piqa_local", "--include_path", str(tasks), "--device", "cpu",
        "--batch_size", "8", "--output_path", str(tmp_path / "lm_eval"), "--log_samples",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "lm_eval").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["piqa_local"]
    assert abs(theirs["acc,none"] - ours["rows"]["calm"]["piqa"]["acc"]) <= 0.01
    (samples,) = (tmp_path / "lm_eval").rglob("samples_piqa_local_*.jsonl")
    their_ll = {
        s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
        for s in map(json.loads, samples.read_text().splitlines())
    }

    def our_ll(name: str) -> dict:
        path = tmp_path / "ours" / "retention" / name / "piqa.jsonl"
        rows = map(json.loads, path.read_text().splitlines())
        return {r["doc_id"]: r["loglikelihoods"] for r in rows}

    calibrated, base = our_ll("calm"), our_ll("base")
    assert their_ll.keys() == calibrated.keys()
    doc_ids = sorted(calibrated)
    theirs_array = np.array([their_ll[i] for i in doc_ids])
    np.testing.assert_allclose(theirs_array, np.array([calibrated[i] for i in doc_ids]), atol=1e-3)
    assert np.abs(theirs_array - np.array([base[i] for i in doc_ids])).max() > 1e-2
