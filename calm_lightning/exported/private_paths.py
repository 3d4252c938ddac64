"""No local path leaves in an export: the run machine's folders (the run, model.local_path,
cache directories, data files) are collected from the run's resolved config, with the
project's default cache folder, Hugging Face's and the user's home folder, and every text file
of the finished folder is searched for them before it is published."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning.errors import ExportError

# The folder's files that are text (the weights are searched by no one: tensors only).
TEXT_SUFFIXES = (".json", ".md", ".py", ".jinja", ".txt", ".yaml", ".model")


def is_local_path(value) -> bool:
    """An absolute or home-relative path of this machine (a string such as "/data/x")."""
    return (
        isinstance(value, str)
        and len(value) > 1
        and (os.path.isabs(value) or value.startswith("~"))
    )


def private_paths(run) -> set[str]:
    """The run's absolute paths: its directory and every path its resolved config names,
    the cache directories the project and huggingface_hub use."""
    found = {str(run.run_dir.resolve()), str(Path(run.run_dir).absolute())}

    def walk(node) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif is_local_path(node):
            found.add(os.path.expanduser(node).rstrip("/") or node)

    walk(OmegaConf.to_container(run.cfg, resolve=False, throw_on_missing=False))
    # Resolved too, where the saved config still holds interpolations; one this machine
    # cannot resolve (an environment variable of the run machine) is no path of its own.
    with contextlib.suppress(Exception):
        walk(OmegaConf.to_container(run.cfg, resolve=True, throw_on_missing=False))
    for name in ("CALM_LIGHTNING_CACHE", "HF_HOME", "HF_HUB_CACHE"):
        if os.environ.get(name):
            found.add(os.environ[name].rstrip("/"))
    from huggingface_hub import constants

    from calm_lightning.models.embedded import cache_root

    found.add(str(constants.HF_HUB_CACHE).rstrip("/"))
    found.add(str(cache_root()).rstrip("/"))  # the project's cache, default or $CALM_..._CACHE
    # "/" or "/tmp" alone would match far too much; a run's own paths are deeper than that.
    paths = {p for p in found if len(Path(p).parts) >= 3}
    # Anything below the home folder names the user (/home/<user>/, or /root/: two parts only).
    home = str(Path.home()).rstrip("/")
    if len(Path(home).parts) >= 2:
        paths.add(home + "/")
    return paths


def public_block(node):
    """A config block as it may leave the machine: each model node it embeds (DACA's
    `model_config`, `reference_model`) reduced to its Hub id or name, each local path to a
    placeholder."""
    if isinstance(node, dict):
        if "source" in node and "name" in node:  # a conf/model or conf/reference_model node
            return node.get("model_id") or node["name"]
        return {key: public_block(value) for key, value in node.items()}
    if isinstance(node, list):
        return [public_block(value) for value in node]
    return "<local path>" if is_local_path(node) else node


def check_no_private_path(folder: Path, paths: set[str]) -> None:
    """Refuse to publish `folder` when one of its text files holds one of `paths`."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(errors="replace")
        leaked = sorted(p for p in paths if p in text)
        if leaked:
            raise ExportError(
                f"the export's {path.relative_to(folder)} would hold the local path "
                f"{leaked[0]!r}; nothing was written (please report this)"
            )
