"""The exported folder's README.md in the Hub's model-card format: YAML front matter (library,
base model, tags), then how to use the model, what the calibration computes, the run's
base-versus-calibrated metrics with its reliability diagrams, its data and its method block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from omegaconf import OmegaConf

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


def _front_matter(run, info: dict) -> str:
    meta: dict = {"library_name": "transformers"}
    if run.base_model_id:
        meta["base_model"] = run.base_model_id
    tags = ["calibration", "calm-lightning", run.method]
    if info["weights"]["adapter"]:
        tags += ["lora", "peft"] if info["weights"]["adapter"] != "merged" else ["lora-merged"]
    if info["head"] and info["head"].get("temperature") is not None:
        tags.append("temperature-scaling")
    meta["tags"] = tags
    meta["pipeline_tag"] = "text-generation"
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _title(run, info: dict) -> str:
    base = run.base_model_id or run.cfg.model.name
    weights = {
        None: "The weights are the base model's, unchanged.",
        "merged": "The method's LoRA adapters are merged into the weights.",
        "adapter": "The weights are the base model's; the method's LoRA adapter is in "
        "`adapter/` (load it with PEFT, below).",
    }[info["weights"]["adapter"]]
    return (
        f"# {base}, calibrated with `{run.method}`\n\n"
        f"Exported by `python -m calm_lightning.export` from a calm-lightning run "
        f"(model `{run.cfg.model.name}`, method `{run.method}`, setting "
        f"`{run.cfg.setting.name}`, seed {run.cfg.get('seed')}). {weights} "
        f"Weights are stored in {info['weights']['dtype']}.\n"
    )


def _usage(info: dict) -> str:
    adapter = ""
    if info["weights"]["adapter"] == "adapter":
        adapter = (
            "from peft import PeftModel\n"
            'model = PeftModel.from_pretrained(model, f"{folder}/adapter")  '
            "# merge=false export\n"
        )
    return (
        "## Use it\n\n"
        "With plain transformers: the calibration is a logits processor, applied to the "
        "next-token scores before sampling.\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from calm_lightning import CalibrationLogitsProcessor\n\n"
        'folder = "path/to/this/folder"\n'
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
        "Multiple-choice confidence as the run measured it:\n\n"
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
    tokens = info["option_tokens"]
    if tokens:
        lines.append(
            f"Multiple-choice answers are scored on the option letters {tokens['letters']} "
            f"spelled `{tokens['style']}` (token ids {tokens['ids']}) at the answer slot of "
            "the chat-templated prompt described in `calibration.json` (`prompt`)."
        )
    return "\n".join(lines) + "\n"


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
        f"<details><summary>the run's {DATA_SUMMARY_FILE} (files, truncations)</summary>",
        "",
        "```json",
        json.dumps(summary, indent=2),
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines) + "\n"


def _hyper_parameters(run) -> str:
    blocks = {"method": run.cfg.method}
    if run.adapter_dir is not None:
        blocks["peft"] = run.cfg.get("peft")
    text = OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in blocks.items() if v is not None}))
    return (
        "## Hyper-parameters\n\n"
        "The run's `method` block (and `peft` for adapters), from its `config_resolved.yaml`:"
        "\n\n```yaml\n" + text + "```\n"
    )


def _files(info: dict, diagrams: dict) -> str:
    files = [
        ("config.json, model.safetensors, generation_config.json", "the model (transformers)"),
        ("tokenizer files, chat_template.jinja", "the tokenizer and its chat template"),
        ("calibration.json", "what the calibration computes, method, option tokens, prompt"),
    ]
    if info["head"]:
        files.append((info["head"]["file"], "the head's d (`scale`) and l (`bias`)"))
    if info["weights"]["adapter"] == "adapter":
        files.append(("adapter/", "the PEFT LoRA adapter (merge=false)"))
    files += [(name, "reliability diagram") for name in diagrams.values()]
    return "## Files\n\n" + "\n".join(f"- `{name}`: {what}" for name, what in files) + "\n"
