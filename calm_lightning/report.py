"""`python -m calm_lightning.report <run or sweep dirs> [--out DIR] [--min-accuracy-ratio 0.8]
[--select-on test|heldout|both] [--reference ts] [--resamples 1000] [--publish]`: paper-style
tables with 95 % intervals, paired differences against base and a reference method, per-source
tables, chosen hyper-parameters and a reliability-diagram grid from finished runs; for runs
logged with W&B, the sweep's dashboard (saved W&B views) written to the first folder as
wandb_views.json and, with --publish, created on W&B."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", help="run or multirun directories to read")
    parser.add_argument("--out", help="where to write (default: <first dir>/report)")
    parser.add_argument(
        "--min-accuracy-ratio",
        type=float,
        default=0.8,
        help="keep runs whose accuracy exceeds this fraction of base (paper: 0.8)",
    )
    parser.add_argument(
        "--select-on",
        choices=("test", "heldout", "both"),
        default="test",
        help="where the rule picks each method's setting: test (the paper's rule, on the test "
        "split itself), heldout (each run's held-out metrics) or both, side by side",
    )
    parser.add_argument(
        "--reference",
        default="ts",
        help="the method every other is compared with on the same questions, besides base",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=1000,
        help="paired-bootstrap resamples of each comparison (0: differences without intervals)",
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="create the sweep's W&B views online (needs a login and the runs synced)",
    )
    parser.add_argument("--entity", help="W&B entity of the views (default: the runs' or yours)")


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Write the report of `args.dirs` and print its tables."""
    from calm_lightning.metrics.bootstrap import BootstrapSettings
    from calm_lightning.reporting.collect import collect
    from calm_lightning.reporting.dashboard import publish, write_dashboard
    from calm_lightning.reporting.render import write_report
    from calm_lightning.runtime.run_record import CONFIG_FILE

    missing = [d for d in args.dirs if not Path(d).is_dir()]
    if missing:
        parser.error(f"not a directory: {', '.join(missing)}")
    collection = collect(args.dirs)
    runs = collection.runs
    if not runs:
        parser.error(f"no runs found (no readable {CONFIG_FILE} below the given directories)")
    out = Path(args.out) if args.out else Path(args.dirs[0]) / "report"
    bootstrap = BootstrapSettings(resamples=max(0, args.resamples), smece_resamples=0)
    result = write_report(
        runs,
        out,
        args.min_accuracy_ratio,
        collection,
        select_on=args.select_on,
        reference=args.reference,
        bootstrap=bootstrap,
    )
    print(result["markdown"])
    print(
        f"written: {out}/report.md, results.csv, selected.csv"
        + (", retention.csv" if result["retention"] else "")
        + (", reliability_grid.png" if result["grid"] else "")
    )
    try:
        dashboard = write_dashboard(runs, args.dirs[0], args.min_accuracy_ratio, args.entity)
    except ValueError as err:  # runs of several W&B projects: no one dashboard
        parser.error(str(err))
    if dashboard is not None:
        print(f"W&B views of the sweep: {dashboard}")
        if args.publish:
            for url in publish(runs, args.dirs[0], args.min_accuracy_ratio, args.entity):
                print(f"published: {url}")
    elif args.publish:
        parser.error("--publish: none of the runs was logged with W&B (logger=wandb)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.report`: the same as `python -m calm_lightning report`."""
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.report", argv)


if __name__ == "__main__":
    raise SystemExit(main())
