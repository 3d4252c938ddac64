"""Check every job of a sweep before anything is submitted: on a login node, without weights and
without a GPU.

    python -m calm_lightning preflight multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning preflight model=mistral method=calm setting=ood --device h100
    python -m calm_lightning preflight +sweep=calm_ood model=olmo2 --json preflight.json

Per job: the config (composes, validates), the data (each split at its configured size, rows
dropped and why, splits disjoint), the tokenizer (BOS, the scored option ids, the chat
template, lengths), the model's config.json (vocabulary, LoRA targets on the meta device,
quantization), memory and time against the device and the launcher, a pinned revision. A
table of jobs x checks with PASS / WARN / FAIL / SKIP, then the reason of every row that is
not PASS (calm_lightning/planning/preflight.py). Exit 1 on any FAIL, else 0: offline with
nothing cached is SKIP with the reason, not a failure. A sweep script is run with a recording
stand-in for Python, as `plan` does: its non-Python commands (mkdir, echo) run for real.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from calm_lightning.planning import cost_model

STATUS_MARK = {"PASS": "ok", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def add_arguments(parser) -> None:
    parser.add_argument(
        "target", help="a multirun_sweeps/*.sh script, +sweep=NAME, or the first override"
    )
    parser.add_argument("overrides", nargs="*", help="model=NAME and other key=value overrides")
    parser.add_argument(
        "--device",
        choices=sorted(cost_model.DEVICES),
        help="the GPU to check memory against (default: the local GPU, else a100_40g)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every check here")


def command(args, parser) -> int:
    """Check every job of `args.target`; 1 when any check FAILs."""
    from calm_lightning.planning.preflight import CHECKS, preflight, record

    device = args.device or cost_model.default_device()
    print(f"preflight: {args.target} {shlex.join(args.overrides)} (device {device})")
    reports = preflight(args.target, args.overrides, device)
    common = set.intersection(*(set(r.overrides) for r in reports)) if reports else set()
    print(f"{len(reports)} jobs; every job has: {' '.join(sorted(common))}\n")
    print("| job | " + " | ".join(CHECKS) + " | overrides |")
    print("|---|" + "---|" * (len(CHECKS) + 1))
    for index, report in enumerate(reports):
        cells = [STATUS_MARK[report.status(name)] for name in CHECKS]
        own = " ".join(o for o in report.overrides if o not in common)
        print(f"| {index} | " + " | ".join(cells) + f" | {own} |")
    print()
    # Each reason once, with the jobs it holds for (a sweep repeats them job after job).
    reasons: dict[tuple[str, str, str], list[int]] = {}
    for index, report in enumerate(reports):
        for check in report.checks:
            if check.status != "PASS":
                reasons.setdefault((check.status, check.name, check.detail), []).append(index)
    order = {"FAIL": 0, "WARN": 1, "SKIP": 2}
    for (status, name, detail), jobs in sorted(reasons.items(), key=lambda r: order[r[0][0]]):
        print(f"{status} {name} (jobs {_ranges(jobs)}): {detail}")
    failed = [i for i, r in enumerate(reports) if r.failed]
    if args.json:
        Path(args.json).write_text(json.dumps(record(reports), indent=2) + "\n")
        print(f"wrote {args.json}")
    if failed:
        print(f"\n{len(failed)} of {len(reports)} jobs FAIL: fix them before submitting")
        return 1
    print(f"\nno job FAILs ({len(reports)} checked)")
    return 0


def _ranges(indices: list[int]) -> str:
    """0, 1, 2, 5 -> '#0-2, #5'."""
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(f"#{start}" if start == index else f"#{start}-{index}")
            start = None
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.preflight`: the same as `python -m calm_lightning preflight`."""
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.preflight", argv)


if __name__ == "__main__":
    raise SystemExit(main())
