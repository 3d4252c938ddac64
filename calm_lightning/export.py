"""`python -m calm_lightning.export run_dir=<run dir> out=<dir> [merge=true] [fold=auto]
[overwrite=false] [dtype=auto]`: a finished run's calibrated model as a standard Hugging Face
model folder.

The calibration travels with the weights. Where it is exact (a scalar head, as post-hoc
temperature scaling, DACA and Dual-Align learn; a vector head without a per-token bias), the
head is folded into the output layer (`fold=auto`, the default): the folder is an ordinary
checkpoint that every server reproduces. Other heads (the paper's CALM) travel as transformers
custom code: `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` applies the
head in `forward`; without `trust_remote_code` the folder loads as the uncalibrated model, and
`CalibrationLogitsProcessor` (also in the folder) applies the head in `generate`. A
calibration.json says what was done; docs/export.md describes the folder.

The arguments are a handful of scalars, parsed here as key=value (the same look as a run's
command line) rather than through Hydra: there is nothing to compose, and a Hydra app would
add an output directory, its own logging and a .hydra/ folder the export has no use for.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from calm_lightning.errors import ExportError, run_command

USAGE = (
    "usage: python -m calm_lightning.export run_dir=<run dir> out=<folder> "
    "[merge=true|false] [fold=auto|true|false] [overwrite=false|true] "
    "[dtype=auto|float32|bfloat16|float16]"
)


@dataclass(frozen=True)
class ExportOptions:
    """The command line: which run, where to, and how."""

    run_dir: Path
    out: Path
    merge: bool = True  # merge LoRA adapters into the weights; false: base + PEFT adapter folder
    fold: str = "auto"  # fold the head into the output layer: auto = where exact; false = never
    overwrite: bool = False  # replace an existing `out`
    dtype: str = "auto"  # weights' dtype; auto = the run's (a 16-bit copy after 4-bit QLoRA)


def parse_arguments(argv: list[str]) -> ExportOptions:
    """key=value arguments into `ExportOptions`; anything else stops with the usage line."""
    from calm_lightning.exported.folding import FOLD_NAMES

    known = {f.name for f in fields(ExportOptions)}
    values: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in known:
            raise ExportError(
                f"unknown argument {arg!r} (arguments are key=value, keys: "
                f"{', '.join(sorted(known))})\n{USAGE}"
            )
        values[key] = value
    missing = [k for k in ("run_dir", "out") if not values.get(k)]
    if missing:
        raise ExportError(f"missing {' and '.join(f'{k}=' for k in missing)}\n{USAGE}")
    options = {"run_dir": Path(values["run_dir"]), "out": Path(values["out"])}
    for key in ("merge", "overwrite"):
        if key in values:
            options[key] = _boolean(key, values[key])
    if "dtype" in values:
        options["dtype"] = values["dtype"]
    if "fold" in values:
        if values["fold"].lower() not in FOLD_NAMES:
            raise ExportError(f"fold={values['fold']!r} is not one of {', '.join(FOLD_NAMES)}")
        options["fold"] = values["fold"].lower()
    return ExportOptions(**options)


def _boolean(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ExportError(f"{key}={value!r} is not true or false")


def main(argv: list[str] | None = None) -> int:
    """The command line; errors the user can fix print their message without a traceback."""

    def action(args: list[str]) -> str:
        from calm_lightning.exported.writer import export_run

        options = parse_arguments(args)
        out = export_run(**{f.name: getattr(options, f.name) for f in fields(ExportOptions)})
        return f"exported to {out} (see {out / 'README.md'})"

    return run_command(argv, __doc__.split("\n\n")[0], USAGE, action)


if __name__ == "__main__":
    raise SystemExit(main())
