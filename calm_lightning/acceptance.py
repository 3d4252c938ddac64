"""The GPU acceptance checks behind `scripts/gpu_check.sh`, sized for an offline node.

    python -m calm_lightning.acceptance --out DIR [--cpu]

Every check uses the tiny model or a random-weight shape with the byte-level tokenizer and
the bundled demo data: nothing is downloaded and the embedded-model wheel is not needed. Each
invocation writes into a fresh folder DIR/<date>-<time> (said first): a check's runs are jobs
that a second invocation in the same folder would find finished and not train again. Each
check prints one PASS / FAIL / SKIP line; <folder>/gpu_check.json records its numbers. `--cpu`
runs the same checks on the CPU (the default test suite runs it, so the checks cannot rot);
there the device-comparison checks compare two CPU computations, the collectives run on a
gloo group and the cost ratios are reported without being judged (a shared CPU is too noisy
for the targets).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

from calm_lightning.arguments import parse_list
from calm_lightning.benchmarking.gpu_checks import (  # noqa: F401  (tests reach them here too)
    ORDER,
    SCORE_TOLERANCE,
    Checks,
    Skip,
    distributed_job,
    run_collectives,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="outputs/gpu_check",
        help="where each invocation makes its own <date>-<time> folder of logs and gpu_check.json",
    )
    parser.add_argument("--cpu", action="store_true", help="the same checks on the CPU")
    parser.add_argument(
        "--only", nargs="+", metavar="CHECK", help=f"run these checks only: {', '.join(ORDER)}"
    )


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the checks; 1 if any failed."""
    only = [name for item in args.only or () for name in parse_list(item, "--only")]
    unknown = [name for name in only if name not in ORDER]
    if unknown:
        parser.error(f"--only: no check {', '.join(unknown)} (choose from {', '.join(ORDER)})")
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if not args.cpu and not torch.cuda.is_available():
        print("FAIL cuda: no CUDA GPU visible (run with --cpu for the CPU checks)")
        return 1
    out = fresh_folder(Path(args.out).resolve())  # the runs and file URLs need it absolute
    print(f"gpu_check: writing to {out}", flush=True)
    checks = Checks(out, args.cpu)
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    record = {"mode": "cpu" if args.cpu else "gpu", "device": device, "torch": torch.__version__,
              "gpus": checks.gpus, "checks": []}  # fmt: skip
    for name in only or ORDER:
        start = time.perf_counter()
        entry = {"name": name}
        try:
            entry["data"] = getattr(checks, name)(out / name)
            entry["status"] = "PASS"
        except Skip as why:
            entry["status"], entry["detail"] = "SKIP", str(why)
        except Exception as err:  # a check's failure is reported, the others still run
            entry["status"], entry["detail"] = "FAIL", f"{type(err).__name__}: {err}"
            (out / f"{name}.error.log").write_text(traceback.format_exc())
        entry["seconds"] = round(time.perf_counter() - start, 1)
        record["checks"].append(entry)
        detail = entry.get("detail") or ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in entry.get("data", {}).items()
        )
        print(f"{entry['status']} {name} ({entry['seconds']} s): {detail}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(record, indent=2))
    failed = [c["name"] for c in record["checks"] if c["status"] == "FAIL"]
    print(f"{'some checks failed: ' + ', '.join(failed) if failed else 'all checks passed'} "
          f"(json and logs in {out})")  # fmt: skip
    return 1 if failed else 0


def fresh_folder(parent: Path) -> Path:
    """A new folder `<parent>/<date>-<time>` (`-2`, `-3`, ... when one started this second)."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        folder = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"no free folder name under {parent}")


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.acceptance`: the same as `python -m calm_lightning check`."""
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.acceptance", argv)


if __name__ == "__main__":
    raise SystemExit(main())
