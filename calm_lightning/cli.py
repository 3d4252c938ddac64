"""`python -m calm_lightning <command>` (also `calm-lightning <command>`): the project's one
command line.

`run` hands the rest of its command line to the Hydra app unchanged (`group=option key=value`,
`--multirun`, Hydra's `--help`). The other commands are argparse subcommands: the module that
does the work (report.py, plan.py, preflight.py, export.py, retention.py, acceptance.py) adds
its arguments (`add_arguments(parser)`) and runs them (`command(args, parser)`); `python -m
calm_lightning.<module>` runs the same code. A user error (a `CalmLightningError`) prints its
message without a traceback and exits 1, whichever command raised it. What the commands
share (argument readers, `command_main`, `invoke`) lives in arguments.py, which the commands
import: nothing imports this dispatcher but `__main__.py`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

from calm_lightning.arguments import describe, invoke


@dataclass(frozen=True)
class Command:
    """A subcommand: the module that does the work and its line in `--help`."""

    module: str
    summary: str


COMMANDS = {
    "run": Command(
        "calm_lightning.run", "run a job or a sweep (Hydra: group=option key=value, --multirun)"
    ),
    "report": Command(
        "calm_lightning.report", "tables, chosen hyper-parameters and figures from finished runs"
    ),
    "plan": Command(
        "calm_lightning.plan", "a sweep's jobs and their estimated cost, before it runs"
    ),
    "preflight": Command(
        "calm_lightning.preflight", "every job of a sweep checked before submitting (no GPU)"
    ),
    "export": Command("calm_lightning.export", "a finished run as a Hugging Face model folder"),
    "retention": Command(
        "calm_lightning.retention", "lm-eval retention of a saved run or an exported folder"
    ),
    "check": Command(
        "calm_lightning.acceptance", "the offline GPU acceptance checks (--cpu: on the CPU)"
    ),
}


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning <command> ...`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "run":
        return run_hydra_app(argv[1:])
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    return invoke(args.module, args, args.command_parser)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only the `selected` command's module is imported (the others'
    entries are their `--help` line), so `--help` costs no heavy import."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description=__doc__.split("\n\n")[0],
        epilog="`<command> --help` shows a command's arguments (for `run`, Hydra's help: the "
        "config groups and their options).",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="<command>", title="commands"
    )
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.summary, description=command.summary)
        if name == selected and name != "run":
            module = importlib.import_module(command.module)
            describe(sub, module)
            sub.set_defaults(module=module, command_parser=sub)
    return parser


def run_hydra_app(args: list[str]) -> int:
    """`run`: the Hydra app with `args` as its whole command line, as `python -m
    calm_lightning.run args...` would run it."""
    import importlib.util

    spec = importlib.util.find_spec("calm_lightning.run")
    entry = sys.modules["__main__"]
    saved = sys.argv, getattr(entry, "__spec__", None)
    # Hydra reads sys.argv. Lightning's DDP launcher starts each further process as `python -m
    # <__main__.__spec__.name> <sys.argv[1:]>`, and multiprocessing's spawn imports the same
    # module: both must see calm_lightning.run, as if it had been started directly.
    sys.argv = [spec.origin, *args]
    entry.__spec__ = spec
    try:
        from calm_lightning.run import main as hydra_app

        hydra_app()
    finally:
        sys.argv, entry.__spec__ = saved
    return 0


def _prog() -> str:
    """How the user called us, for the usage line."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not called or called == "__main__.py" or called.startswith("-"):  # -m, -c
        return "python -m calm_lightning"
    return called
