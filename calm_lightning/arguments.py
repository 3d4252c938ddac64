"""What the commands share: argument readers (booleans and lists read the same everywhere,
`parse_bool`, `parse_list`, as do the key=value arguments of export and retention,
`key_value_arguments`) and how a command module runs (`command_main` for `python -m
calm_lightning.<module>`, `invoke` for it and the dispatcher: a user error prints without a
traceback). Commands import these from here, not from the dispatcher (cli.py), which sits
above them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from calm_lightning.errors import CalmLightningError, ConfigError

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


def parse_bool(value: str | bool, name: str) -> bool:
    """`true` / `false` (or 1 / 0, yes / no, in any case) as a bool; `name` is the argument
    the error message names."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={value!r} is not true or false")


def parse_list(value: str | list | tuple, name: str) -> list[str]:
    """`[a,b]` or `a,b` (one item: `a`) as a list of strings; items lose surrounding spaces and
    quotes, and empty items are dropped (`[]` is the empty list)."""
    if isinstance(value, list | tuple):
        return [str(item) for item in value]
    text = str(value).strip()
    if text.startswith("[") != text.endswith("]"):
        raise ConfigError(f"{name}={value!r} is not a list: write [a,b] or a,b")
    if text.startswith("["):
        text = text[1:-1]
    items = []
    for item in text.split(","):
        item = item.strip()
        if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
            item = item[1:-1]
        if item:
            items.append(item)
    return items


def key_value_arguments(
    argv: list[str], keys: tuple[str, ...], usage: str, nested: tuple[str, ...] = ()
) -> dict[str, str]:
    """`key=value` arguments (the look of a run's command line) as a dict of strings; a key in
    `nested` is given per name (`data_files.piqa=...`). Anything else stops with the usage."""
    values: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        head, dot, name = key.partition(".")
        known = (key in keys and key not in nested) or (head in nested and dot and name)
        if not sep or not known:
            raise ConfigError(
                f"unknown argument {arg!r} (arguments are key=value, keys: "
                f"{', '.join(keys)})\n{usage}"
            )
        values[key] = value
    return values


def command_main(module_name: str, argv: list[str] | None = None) -> int:
    """`python -m <module_name>`: the command that module implements, under the module's own
    name; the same code as its `python -m calm_lightning <command>`."""
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"python -m {module_name}")
    describe(parser, module)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return invoke(module, args, parser)


def describe(parser: argparse.ArgumentParser, module) -> None:
    """The command module's first docstring paragraph as the description, then its
    arguments (`add_arguments`)."""
    parser.description = module.__doc__.split("\n\n")[0]
    module.add_arguments(parser)


def invoke(module, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the command module on its parsed arguments; a user error prints its message
    without a traceback (exit 1; HYDRA_FULL_ERROR=1 shows the traceback, as for a run). A
    module with `LOGS_PROGRESS = True` (long single actions) shows the project's INFO lines."""
    if getattr(module, "LOGS_PROGRESS", False):
        import logging

        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        return module.command(args, parser)
    except CalmLightningError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"\nerror: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        return 1
