"""What `conf/method_setting/<method>_<setting>.yaml` changed in a run.

Run configs pick such a file automatically when it exists (it sizes a method for a setting, e.g.
CALM's demo LRs); a run must say so. `applied_method_setting` reports every value the file sets,
next to the value the method / setting / trainer group file documents and the value the run
finally used (a command-line override wins over the file).
"""

from __future__ import annotations

import logging
from importlib import resources

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
CONF_PACKAGE = "calm_lightning.conf"
UNSET = "(unset)"


def _conf_file(*parts: str):
    path = resources.files(CONF_PACKAGE).joinpath(*parts)
    return path if path.is_file() else None


def _leaves(node, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _group_choices(cfg: DictConfig) -> dict[str, str]:
    """Which option of each group the run composed (Hydra's record when there is one)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return {k: v for k, v in HydraConfig.get().runtime.choices.items() if v is not None}
    # Composed without a Hydra app (tests, the Python API): option names equal the `name`
    # fields (tests/test_configs.py checks this).
    return {"method": cfg.method.name, "setting": cfg.setting.name, "trainer": "default"}


def _documented_value(group: str, option: str | None, key: str):
    """`key` as the group's option file writes it (interpolations unresolved), or UNSET."""
    path = _conf_file(group, f"{option}.yaml") if option else None
    if path is None:
        return UNSET
    node = OmegaConf.to_container(OmegaConf.create(path.read_text()), resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return UNSET
        node = node[part]
    return node


def applied_method_setting(cfg: DictConfig) -> dict | None:
    """{file, values: {key: {default, method_setting, value}}} or None when no file applied."""
    name = f"{cfg.method.name}_{cfg.setting.name}"
    path = _conf_file("method_setting", f"{name}.yaml")
    if path is None:
        return None
    choices = _group_choices(cfg)
    values = {}
    for key, set_to in _leaves(OmegaConf.to_container(OmegaConf.create(path.read_text()))):
        group, _, rest = key.partition(".")
        values[key] = {
            "default": _documented_value(group, choices.get(group), rest),
            "method_setting": set_to,
            "value": OmegaConf.select(cfg, key),
        }
    return {"file": f"conf/method_setting/{name}.yaml", "values": values}


def log_method_setting(applied: dict | None) -> None:
    """One log line per value the file changed (and whether the command line overrode it)."""
    if not applied:
        return
    for key, row in applied["values"].items():
        note = "" if row["value"] == row["method_setting"] else f" (command line: {row['value']})"
        log.info(
            "%s sets %s: %s -> %s%s",
            applied["file"],
            key,
            row["default"],
            row["method_setting"],
            note,
        )
