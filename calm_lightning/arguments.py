"""Argument readers the commands share: booleans and lists read the same everywhere
(`parse_bool`, `parse_list`), as do the key=value arguments of export and retention
(`key_value_arguments`). Commands import these from here, not from the dispatcher (cli.py)."""

from __future__ import annotations

from calm_lightning.errors import ConfigError

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
