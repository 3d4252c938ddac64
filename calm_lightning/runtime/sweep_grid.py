"""Which jobs a basic-sweeper multirun launches, as Hydra's own sweeper expands them: the
planner asks before a sweep runs (planning/sweep.py), the report after it ran
(reporting/completeness.py, from the sweep folder's multirun.yaml)."""

from __future__ import annotations

from calm_lightning.errors import ConfigError, first_line


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of `overrides`; a malformed one as a one-line ConfigError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(
            f"{' '.join(overrides)}: not an override Hydra reads ({first_line(err)})"
        ) from err


def basic_sweeper_jobs(params: dict, task: list[str]) -> list[list[str]]:
    """The override list of every job Hydra's basic sweeper launches, in job-number order: the
    grid in `hydra.sweeper.params` followed by the command line's task overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    grid = [f"{key}={value}" for key, value in (params or {}).items()]
    (jobs,) = BasicSweeper.split_arguments(parse_overrides(grid + list(task)), None)
    return jobs
