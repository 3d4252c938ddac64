"""Rows of a Hugging Face Hub dataset (or its local cache) through `datasets`, with an error
that says what to do when neither the Hub nor a cache is available."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from calm_lightning.errors import DataUnavailableError

log = logging.getLogger(__name__)


def _unavailable(hub_id: str, config: str | None, split: str, option: str, reason: str) -> str:
    name = f"'{hub_id}'" + (f" (config '{config}')" if config else "")
    load = f"datasets.load_dataset('{hub_id}'" + (f", '{config}'" if config else "") + ")"
    return (
        f"Cannot load dataset {name}, split '{split}': {reason}\n"
        "Either:\n"
        f"  * pass local files in the dataset's own schema: {option}=[/path/a.jsonl,...] "
        "(json, jsonl, csv, tsv or parquet); or\n"
        f"  * pre-populate the Hugging Face cache on a machine with network: "
        f'HF_HOME=/shared/hf python -c "import datasets; {load}", then copy that directory '
        "here and set HF_HOME=/shared/hf (HF_DATASETS_OFFLINE=1 then never tries the network)."
    )


def hub_rows(
    hub_id: str, config: str | None, split: str, option: str
) -> Iterator[tuple[int, dict]]:
    """Yield (row number, row) of one split; `option` names the config key for local files."""
    try:
        import datasets
    except ImportError as err:
        raise DataUnavailableError(
            _unavailable(
                hub_id,
                config,
                split,
                option,
                "the `datasets` package is missing (pip install datasets)",
            )
        ) from err
    try:
        dataset = datasets.load_dataset(hub_id, config, split=split)
    except Exception as err:  # offline, unreachable, missing cache: many exception classes
        raise DataUnavailableError(
            _unavailable(hub_id, config, split, option, f"{type(err).__name__}: {err}")
        ) from err
    log.info("loaded %s/%s[%s]: %d rows", hub_id, config or "-", split, len(dataset))
    yield from enumerate(dataset, start=1)
