"""The exported folder's README.md in the Hub's model-card format: YAML front matter (library,
base model, license, datasets, language, tags, a model-index with the run's calibration
metrics), then how the calibration is served (first: it decides whether a server gets the
calibrated model at all), how to use the model, what the calibration computes and how answers
were scored, the run's base-versus-calibrated metrics with its reliability diagrams, its data
and its method block. No local path of the machine that ran it goes into the card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from calm_lightning.exported.private_paths import is_local_path, public_block
from calm_lightning.metrics.names import PERCENT, run_table_columns
from calm_lightning.runtime.run_record import BASE_DIR, DATA_SUMMARY_FILE, RELIABILITY_FILE

# The run's diagrams (path in the run directory) -> their names in the exported folder.
DIAGRAMS = {
    RELIABILITY_FILE: "reliability.png",
    f"{BASE_DIR}/{RELIABILITY_FILE}": "reliability_base.png",
}


def write_model_card(run, folder: Path, info: dict) -> Path:
    """Copy the reliability diagrams into `folder` and write its README.md."""
    diagrams = {}
    for source, name in DIAGRAMS.items():
        if (run.run_dir / source).is_file():
            shutil.copyfile(run.run_dir / source, folder / name)
            diagrams[source] = name
    text = "\n".join(
        [
            _front_matter(run, info),
            _title(run, info),
            _serving(info),
            _usage(info),
            _calibration(info),
            _evaluation(run, diagrams),
            _data(run),
            _hyper_parameters(run),
            _files(info, diagrams),
        ]
    )
    path = folder / "README.md"
    path.write_text(text)
    return path


# Metrics of the model-index, in the Hub's {type, name} form (the run table's keys).
INDEX_METRICS = {
    "accuracy": "Accuracy",
    "conf_ece": "Confidence ECE",
    "cw_ece": "Classwise ECE",
    "brier": "Brier score",
    "nll": "Negative log-likelihood",
}


def hub_datasets(node) -> list[str]:
    """The Hub dataset ids a config node names (the setting: its train, held-out and test
    sources; one split's block: its own)."""
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "hub_id" and isinstance(value, str) and value not in found:
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(OmegaConf.to_container(node, resolve=True))
    return found


def _front_matter(run, info: dict) -> str:
    meta: dict = {"library_name": "transformers"}
    if run.base_model_id:
        meta["base_model"] = run.base_model_id
    meta["license"] = run.cfg.model.get("license") or "other"
    datasets = hub_datasets(run.cfg.setting)
    if datasets:
        meta["datasets"] = datasets
    meta["language"] = ["en"]
    tags = ["calibration", "calm-lightning", run.method]
    if info["weights"]["adapter"]:
        tags += ["lora", "peft"] if info["weights"]["adapter"] != "merged" else ["lora-merged"]
    if info["head"] and info["head"].get("temperature") is not None:
        tags.append("temperature-scaling")
    if info["serving"]["trust_remote_code"]:
        tags.append("custom_code")
    meta["tags"] = tags
    meta["pipeline_tag"] = "text-generation"
    meta["model-index"] = [_model_index(run, info)]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _model_index(run, info: dict) -> dict:
    metrics = run.metrics.get("metrics", {})
    test = (run.record.data_summary or {}).get("test") or {}
    datasets = hub_datasets(run.cfg.setting.test)
    scoring = info["prompt"].get("scoring", "letter")
    return {
        "name": f"{run.base_model_id or run.cfg.model.name}-{run.method}",
        "results": [
            {
                "task": {"type": "multiple-choice", "name": f"Multiple-choice QA ({scoring})"},
                "dataset": {
                    "name": test.get("name") or str(run.cfg.setting.name),
                    "type": datasets[0] if datasets else str(test.get("name") or "local"),
                    "split": str(run.cfg.setting.test.get("split", "test")),
                },
                "metrics": [
                    {"type": key, "name": name, "value": round(float(metrics[key]), 6)}
                    for key, name in INDEX_METRICS.items()
                    if metrics.get(key) is not None
                ],
            }
        ],
    }


def _title(run, info: dict) -> str:
    base = run.base_model_id or run.cfg.model.name
    return (
        f"# {base}, calibrated with `{run.method}`\n\n"
        f"Exported by `python -m calm_lightning.export` from a calm-lightning run "
        f"(model `{run.cfg.model.name}`, method `{run.method}`, setting "
        f"`{run.cfg.setting.name}`, seed {run.cfg.get('seed')}). {_weights(info)} "
        f"Weights are stored in {info['weights']['dtype']}.{_qlora_note(info)}\n"
    )


def _weights(info: dict) -> str:
    """What the weights are, against the base model's."""
    weights = info["weights"]
    scale = weights.get("logit_scale", 1.0)
    changed = {
        "final_norm": " except the final norm's weight, which carries the calibration (below).",
        "output_layer": " except the output layer, which carries the calibration (below).",
        None: " except the final norm's weight (the logit scale below)."
        if scale != 1.0
        else ", unchanged.",
    }[info["serving"].get("folded_into")]
    text = {
        None: "The weights are the base model's" + changed,
        "merged": "The method's LoRA adapters are merged into the weights.",
        "adapter": "The weights are the base model's; the method's LoRA adapter is in "
        "`adapter/` (load it with PEFT, below).",
    }[weights["adapter"]]
    if scale != 1.0:
        text += (
            f" **Logit scale {scale:g}:** the run multiplied every logit by k = {scale:g} "
            "(`model.logit_scale`, a deliberately over-confident model, through the final "
            "norm's weight), and these weights carry that factor too (`calibration.json`: "
            "`weights.logit_scale`); calm-lightning refuses to load them with "
            "`model.logit_scale` again."
        )
    return text


def _qlora_note(info: dict) -> str:
    if not (info["weights"]["trained_on_4bit_base"] and info["weights"]["adapter"]):
        return ""
    return (
        " The adapters were trained on the base model's 4-bit nf4 weights and are applied "
        f"here to its original weights in {info['weights']['dtype']}, not to the dequantized "
        "4-bit ones: this model's numbers differ slightly from the run's."
    )


def _serving(info: dict) -> str:
    """The first thing a user serving this model must know."""
    mode = info["serving"]["calibration"]
    if mode == "weights":
        text = (
            "**The calibration is in the weights** (the method trains adapters only): any "
            "server that loads this checkpoint serves the calibrated model."
        )
    elif mode == "folded":
        text = FOLDED_NOTES[info["serving"]["folded_into"]] + (
            " Prompt log-probabilities are calibrated too. Do not apply a calibration on top."
        )
    else:
        serving = info["serving"]
        text = (
            "**Load with `trust_remote_code=True`.** The calibration head cannot be folded into "
            f"the weights ({serving['why_not_folded']}); `{serving['modeling_file']}` "
            "applies it in `forward`, so `generate` (greedy, sampling, beam search), pipelines "
            "and lm-eval's `hf` model see calibrated logits. **Loaded without it** (plain "
            "transformers; TGI, which runs no custom code for this architecture) **this is the "
            "uncalibrated model**; with plain transformers apply "
            f"`{serving['processor_file']}` in `generate` instead (never both). vLLM refuses "
            "the head's tensors and llama.cpp's GGUF converter stops at them: no server path "
            "serves this head calibrated."
        )
    return "## Serving\n\n" + text + "\n"


# The serving note of a folded head, by where it was folded (folding.py). Which servers read
# which tensor, and how each claim was checked: docs/export.md, "Which servers serve it".
FOLDED_NOTES = {
    "final_norm": "**The calibration is folded into the final norm's weight** (a temperature T "
    "divides every logit: the norm's gain is scaled by 1 / T; exact, and the input/output "
    "embeddings stay as the base model has them). This is an ordinary checkpoint of the base "
    "architecture: transformers (`AutoModelForCausalLM`, `pipeline`) and lm-eval's `hf` model "
    "serve the calibrated distribution, and vLLM, TGI and llama.cpp's GGUF converter read the "
    "final norm's weight as any other. One side effect: the last entry of "
    "`output_hidden_states` is divided by T as well.",
    "output_layer": "**The calibration is folded into the output layer** (`lm_head.weight`, "
    "row y scaled by d_y; exact for this head, and this model's output layer is its own, not "
    "the input embedding). This is an ordinary checkpoint of the base architecture: "
    "transformers (`AutoModelForCausalLM`, `pipeline`) and lm-eval's `hf` model serve the "
    "calibrated distribution, and vLLM, TGI and llama.cpp's GGUF converter read an untied "
    "`lm_head.weight` of this architecture.",
}


def _usage(info: dict) -> str:
    if info["serving"]["calibration"] in ("weights", "folded"):
        return (
            "## Use it\n\n"
            "```python\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'folder = "path/to/this/folder"  # or its Hub id\n'
            "model = AutoModelForCausalLM.from_pretrained(folder)\n"
            "tokenizer = AutoTokenizer.from_pretrained(folder)\n"
            "```\n"
        )
    adapter = ""
    if info["weights"]["adapter"] == "adapter":
        adapter = (
            "from peft import PeftModel\n"
            'model = PeftModel.from_pretrained(model, f"{folder}/adapter")  '
            "# merge=false export\n"
        )
    return (
        "## Use it\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'folder = "path/to/this/folder"  # or its Hub id\n'
        "model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)\n"
        f"{adapter}"
        "```\n\n"
        "Or without custom code: the calibration as a logits processor (torch and transformers "
        "only), applied to the next-token scores before sampling.\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from transformers.dynamic_module_utils import get_class_from_dynamic_module\n\n"
        "CalibrationLogitsProcessor = get_class_from_dynamic_module(\n"
        '    "calibration_processor.CalibrationLogitsProcessor", folder\n'
        ")\n"
        "model = AutoModelForCausalLM.from_pretrained(folder)\n"
        f"{adapter}"
        "tokenizer = AutoTokenizer.from_pretrained(folder)\n"
        "processor = CalibrationLogitsProcessor.from_pretrained(folder)\n"
        "inputs = tokenizer.apply_chat_template(\n"
        '    [{"role": "user", "content": "Name a primary colour."}],\n'
        '    add_generation_prompt=True, return_tensors="pt", return_dict=True,\n'
        ")\n"
        "out = model.generate(**inputs, logits_processor=[processor], do_sample=True, "
        "max_new_tokens=32)\n"
        "```\n\n"
        "Multiple-choice confidence as the run measured it (needs `calm_lightning`):\n\n"
        "```python\n"
        "from calm_lightning import load_calibrated\n\n"
        "calibrated = load_calibrated(folder)\n"
        'calibrated.option_probabilities("What is the capital of France?", '
        '["Paris", "Lyon", "Nice", "Lille"])\n'
        "```\n"
    )


def _calibration(info: dict) -> str:
    lines = ["## Calibration\n", f"`{info['formula']}` (`calibration.json`)."]
    head = info["head"]
    if head is not None:
        lines.append(
            f"Head: `{head['kind']}` (d and l in `{head['file']}`, tensors `scale` and "
            f"`bias`), {info['terms']['c']}."
        )
        if head.get("temperature") is not None:
            lines.append(f"Post-hoc temperature T = {head['temperature']:.4f} (d = 1 / T).")
    else:
        lines.append("This method has no head: its calibration is in the weights.")
    lines.append(_scoring(info))
    return "\n".join(lines) + "\n"


def _scoring(info: dict) -> str:
    """How the run scored its multiple-choice answers (calibration.json's `prompt`), in the
    words of the scorer that recorded it."""
    from calm_lightning.evaluation.scorers import scorer_from_prompt

    prompt = info["prompt"]
    return scorer_from_prompt(prompt).describe(prompt, info["option_tokens"])


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if key in PERCENT else f"{value:.4f}"


def _evaluation(run, diagrams: dict) -> str:
    rows = run.metrics.get("comparison") or {run.method: run.metrics.get("metrics", {})}
    columns = run_table_columns(rows)
    n = run.metrics.get("metrics", {}).get("n")
    lines = [
        "## Evaluation\n",
        f"Test split of setting `{run.cfg.setting.name}`"
        + (f" ({n} questions)" if n is not None else "")
        + "; the `base` row is the untouched model scored by the same code in the same run.\n",
        "| model | " + " | ".join(label for _, label in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, metrics in rows.items():
        cells = [_cell(k, metrics.get(k)) for k, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for source, name in diagrams.items():
        shown = run.method if source == RELIABILITY_FILE else "base"
        lines.append(f"![reliability diagram, {shown}]({name})")
    return "\n".join(lines) + "\n"


def _data(run) -> str:
    summary = run.record.data_summary
    if summary is None:
        return "## Data\n\nThe run recorded no data summary.\n"
    lines = ["## Data\n", "| split | source | kind | examples |", "|---|---|---|---:|"]
    for split in ("train", "heldout", "test"):
        part = summary.get(split)
        if isinstance(part, dict):
            lines.append(
                f"| {split} | {part.get('name', '-')} | {part.get('kind', '-')} | "
                f"{part.get('n', '-')} |"
            )
    lines += [
        "",
        f"<details><summary>the run's {DATA_SUMMARY_FILE} (file names, truncations)</summary>",
        "",
        "```json",
        json.dumps(_without_paths(summary), indent=2),
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines) + "\n"


def _without_paths(node):
    """The data summary with each file reduced to its name: no local directory leaves."""
    if isinstance(node, dict):
        return {k: (_names(v) if k == "files" else _without_paths(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_without_paths(v) for v in node]
    return Path(node).name if is_local_path(node) else node


def _names(files):
    if isinstance(files, (list, tuple)):
        return [_names(f) for f in files]
    if isinstance(files, dict):  # a file as data sources record it: name and content hash
        return _without_paths(files)
    return Path(str(files)).name if files else files


def _hyper_parameters(run) -> str:
    blocks = {"method": run.cfg.method}
    if run.adapter_dir is not None:
        blocks["peft"] = run.cfg.get("peft")
    kept = {k: OmegaConf.to_container(v, resolve=True) for k, v in blocks.items() if v is not None}
    text = yaml.safe_dump(public_block(kept), sort_keys=False)
    return (
        "## Hyper-parameters\n\n"
        "The run's `method` block (and `peft` for adapters), from its `config_resolved.yaml` "
        "(the models it names by their Hub id, local paths left out):"
        "\n\n```yaml\n" + text + "```\n"
    )


def _files(info: dict, diagrams: dict) -> str:
    files = [
        ("config.json, model.safetensors, generation_config.json", "the model (transformers)"),
        ("tokenizer files, chat_template.jinja", "the tokenizer and its chat template"),
        ("calibration.json", "what the calibration computes, method, option tokens, prompt"),
    ]
    if info["head"] and info["head"]["file"]:
        files.append((info["head"]["file"], "the head's d (`scale`) and l (`bias`)"))
    if info["serving"]["trust_remote_code"]:
        files += [
            (info["serving"]["modeling_file"], "custom code: the base class + the head"),
            (info["serving"]["processor_file"], "the head as a `generate` logits processor"),
            ("logit_adjustment.py", "the head's module (torch + safetensors)"),
        ]
    if info["weights"]["adapter"] == "adapter":
        files.append(("adapter/", "the PEFT LoRA adapter (merge=false)"))
    files += [(name, "reliability diagram") for name in diagrams.values()]
    return "## Files\n\n" + "\n".join(f"- `{name}`: {what}" for name, what in files) + "\n"
