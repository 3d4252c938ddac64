"""`python -m calm_lightning.export run_dir=<run dir> out=<dir> [merge=true] [fold=auto]
[overwrite=false] [dtype=auto]`: a finished run's calibrated model as a standard Hugging Face
model folder.

The calibration travels with the weights. Where it is exact and servers read it, the head is
folded in (`fold=auto`, the default): a scalar head (post-hoc temperature scaling, DACA,
Dual-Align) into the final norm's weight, tied embeddings untouched; a per-token scale into an
untied output layer. The folder is then an ordinary checkpoint of the base architecture
(docs/export.md lists which servers were checked). Other heads (the paper's CALM) travel as
transformers custom code: `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`
applies the head in `forward`; without `trust_remote_code` the folder loads as the
uncalibrated model, and `CalibrationLogitsProcessor` (also in the folder) applies the head in
`generate`. A calibration.json says what was done; docs/export.md describes the folder.

The arguments are a handful of scalars, parsed here as key=value (the same look as a run's
command line) rather than through Hydra: there is nothing to compose, and a Hydra app would
add an output directory, its own logging and a .hydra/ folder the export has no use for.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from calm_lightning.arguments import key_value_arguments, parse_bool
from calm_lightning.errors import ExportError

# A long single action: show the project's INFO log lines (arguments.invoke).
LOGS_PROGRESS = True

USAGE = (
    "usage: python -m calm_lightning.export run_dir=<run dir> out=<folder> "
    "[merge=true|false] [fold=auto|true|false] [overwrite=false|true] "
    "[dtype=auto|float32|bfloat16|float16] [trust_remote_code=false|true]"
)


@dataclass(frozen=True)
class ExportOptions:
    """The command line: which run, where to, and how."""

    run_dir: Path
    out: Path
    merge: bool = True  # merge LoRA adapters into the weights; false: base + PEFT adapter folder
    fold: str = "auto"  # fold the head into the weights: auto = where exact; false = never
    overwrite: bool = False  # replace an existing `out`: an earlier export or an empty folder
    dtype: str = "auto"  # weights' dtype; auto = the run's (a 16-bit copy after 4-bit QLoRA)
    # Run the base model's own code from the Hub; only ever from the command line, never from
    # the run's config (a received run folder is data, docs/security.md).
    trust_remote_code: bool = False


def parse_arguments(argv: list[str]) -> ExportOptions:
    """key=value arguments into `ExportOptions`; anything else stops with the usage line."""
    from calm_lightning.exported.folding import FOLD_NAMES

    keys = tuple(sorted(f.name for f in fields(ExportOptions)))
    values = key_value_arguments(argv, keys, USAGE)
    missing = [k for k in ("run_dir", "out") if not values.get(k)]
    if missing:
        raise ExportError(f"missing {' and '.join(f'{k}=' for k in missing)}\n{USAGE}")
    options = {"run_dir": Path(values["run_dir"]), "out": Path(values["out"])}
    for key in ("merge", "overwrite", "trust_remote_code"):
        if key in values:
            options[key] = parse_bool(values[key], key)
    if "dtype" in values:
        options["dtype"] = values["dtype"]
    if "fold" in values:
        if values["fold"].lower() not in FOLD_NAMES:
            raise ExportError(f"fold={values['fold']!r} is not one of {', '.join(FOLD_NAMES)}")
        options["fold"] = values["fold"].lower()
    return ExportOptions(**options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "arguments",
        nargs="*",
        metavar="key=value",
        help="run_dir=<run dir> out=<folder> (both required), merge=true|false (default true), "
        "fold=auto|true|false (auto), overwrite=false|true (false; replaces only an earlier "
        "export or an empty folder), dtype=auto|float32|bfloat16|float16 (auto), "
        "trust_remote_code=false|true (false: the base model's Hub code never runs, whatever "
        "the run's config says); docs/export.md",
    )


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Export the run the arguments name."""
    from calm_lightning.exported.writer import export_run

    options = parse_arguments(args.arguments)
    out = export_run(**{f.name: getattr(options, f.name) for f in fields(ExportOptions)})
    print(f"exported to {out} (see {out / 'README.md'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.export`: the same as `python -m calm_lightning export`."""
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.export", argv)


if __name__ == "__main__":
    raise SystemExit(main())
