"""The sweep's W&B dashboard: saved views built with W&B's own library (`wandb-workspaces`).

For every (model, setting, method) of a sweep logged with W&B, one view of its grid: a
parallel-coordinates panel over the swept hyper-parameters (the config keys that differ
within the group, as the report finds them) to the method's calibration error and accuracy,
the runset restricted to the grid's runs, and the run the selection rule picked (every seed of
the chosen setting) pinned, set as the baseline and coloured, the others grey. Then one view
of the picked runs of every method: their reliability diagrams side by side and, for CALM,
its per-step series (g, q, entropy, lambda, the head's statistics).

`write_dashboard` writes the views' definitions (W&B's own view spec, as `Workspace.save`
would send it, plus which runs and picks it names) to the sweep folder, with no network;
`publish` creates the views on W&B (needs a login; the runs synced first, `wandb sync`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from calm_lightning.reporting.collect import Run
from calm_lightning.reporting.completeness import relative_path
from calm_lightning.reporting.selection import (
    Choice,
    calibration_key,
    method_order,
    select,
    table_positions,
)
from calm_lightning.runtime.loggers import RELIABILITY_KEY
from calm_lightning.runtime.run_record import read_wandb_id

DASHBOARD_FILE = "wandb_views.json"  # in the sweep folder, beside report/
PICKED_COLOR = "#d62728"
OTHER_COLOR = "#9e9e9e"


def logged_runs(runs: list[Run]) -> dict[Path, str]:
    """The finished runs logged with W&B: run folder -> W&B run id (wandb_id.txt)."""
    ids = {}
    for run in runs:
        if not run.metrics or not run.config.get("logger.wandb._target_"):
            continue
        run_id = read_wandb_id(run.path)
        if run_id:
            ids[run.path] = run_id
    return ids


def _project(runs: list[Run]) -> tuple[str, str | None]:
    projects = {r.config.get("logger.wandb.project") for r in runs}
    entities = {r.config.get("logger.wandb.entity") for r in runs}
    if len(projects) != 1 or len(entities) != 1:
        raise ValueError(
            f"the runs were logged to several W&B projects {sorted(map(str, projects))} / "
            f"entities {sorted(map(str, entities))}: report one sweep at a time"
        )
    return projects.pop(), entities.pop()


def grid_view(choice: Choice, members: list[Run], ids: dict[Path, str], entity, project, name):
    """The view of one method's grid: parallel coordinates, pick pinned and coloured."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    key = calibration_key(choice.mean)
    picked = [ids[r.path] for r in choice.runs if r.path in ids]
    grid = [ids[r.path] for r in members if r.path in ids]
    columns = [
        wr.ParallelCoordinatesPlotColumn(metric=wr.Config(k), display_name=k.split(".")[-1])
        for k in sorted(choice.params)
    ]
    columns += [
        wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(f"{choice.method}/{m}"))
        for m in (key, "accuracy")
    ]
    title = f"{choice.model} / {choice.setting} / {choice.method}"
    panels = [
        wr.ParallelCoordinatesPlot(title=f"{title}: grid -> {key}, accuracy", columns=columns),
        wr.RunComparer(diff_only="split"),
    ]
    return ws.Workspace(
        entity=entity or "",
        project=project,
        name=f"{name} · {title}",
        sections=[ws.Section(name=f"{title}: grid", panels=panels, is_open=True)],
        runset_settings=ws.RunsetSettings(
            filters=expr.And(expr.Metric("ID").isin(grid)),
            run_settings={
                i: ws.RunSettings(color=PICKED_COLOR if i in picked else OTHER_COLOR) for i in grid
            },
            pinned_runs=picked,
            baseline_run=picked[0] if picked else None,
        ),
    )


def picked_view(choices: list[Choice], ids: dict[Path, str], entity, project, name):
    """The view of the picked runs: reliability diagrams, and CALM's per-step series."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    picked = [ids[r.path] for c in choices for r in c.runs if r.path in ids]
    sections = [
        ws.Section(
            name="picked runs: reliability diagrams",
            panels=[wr.MediaBrowser(title="reliability", media_keys=[RELIABILITY_KEY])],
            is_open=True,
        )
    ]
    # Each method's per-step series, as its runs' configs declare them (method.traits).
    declared = {c.method: c.runs[0].step_series for c in choices if c.runs}
    for method, step_series in sorted(declared.items()):
        if not step_series:
            continue
        series = [wr.LinePlot(title=s.split("/")[-1], x="Step", y=[s]) for s in step_series]
        sections.append(
            ws.Section(name=f"{method} per step (picked run)", panels=series, is_open=True)
        )
    return ws.Workspace(
        entity=entity or "",
        project=project,
        name=f"{name} · picked",
        sections=sections,
        runset_settings=ws.RunsetSettings(
            filters=expr.And(expr.Metric("ID").isin(picked)),
            run_settings={i: ws.RunSettings(color=PICKED_COLOR) for i in picked},
        ),
    )


def sweep_views(
    runs: list[Run],
    name: str,
    min_accuracy_ratio: float = 0.8,
    entity: str | None = None,
    folder: Path | None = None,
) -> tuple[list, dict]:
    """The views of a sweep's W&B runs and what they name (runs, picks, each run's folder
    relative to `folder`, where wandb_views.json goes); ([], {}) when no run was logged with
    W&B."""
    ids = logged_runs(runs)
    logged = [r for r in runs if r.path in ids]
    if not logged:
        return [], {}
    project, logged_entity = _project(logged)
    entity = entity or logged_entity
    choices = select(logged, min_accuracy_ratio)
    positions = table_positions(choices)
    choices.sort(key=lambda c: (c.model, c.setting, method_order(c.method, positions)))
    groups = defaultdict(list)
    for run in logged:
        groups[(run.model, run.setting, run.method)].append(run)
    views = [
        grid_view(c, groups[(c.model, c.setting, c.method)], ids, entity, project, name)
        for c in choices
    ]
    views.append(picked_view(choices, ids, entity, project, name))
    picks = {f"{c.model}/{c.setting}/{c.method}": [ids[r.path] for r in c.runs] for c in choices}
    names = {
        "sweep": name,
        "entity": entity,
        "project": project,
        "runs": [
            {
                "id": ids[r.path],
                "path": relative_path(r.path, folder) if folder else r.path.name,
                "model": r.model,
                "setting": r.setting,
                "method": r.method,
                "params": {k: r.params[k] for k in sorted(r.params)},
                "picked": any(ids[r.path] in p for p in picks.values()),
            }
            for r in logged
        ],
        "picked": picks,
    }
    return views, names


def view_spec(view) -> dict:
    """A view as W&B stores it (the payload `Workspace.save` sends), built offline."""
    return view._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def write_dashboard(
    runs: list[Run], folder: str | Path, min_accuracy_ratio: float = 0.8, entity=None
) -> Path | None:
    """<folder>/wandb_views.json: the sweep's views and what they name; None without W&B runs."""
    folder = Path(folder)
    views, names = sweep_views(runs, folder.resolve().name, min_accuracy_ratio, entity, folder)
    if not views:
        return None
    payload = {
        **names,
        "created_with": "wandb-workspaces",
        "publish": "python -m calm_lightning.report <the folder of this file> --publish",
        "views": [{"name": v.name, "view": view_spec(v)} for v in views],
    }
    path = folder / DASHBOARD_FILE
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def publish(runs: list[Run], folder: str | Path, min_accuracy_ratio: float = 0.8, entity=None):
    """Create the views on W&B; their URLs. The entity defaults to the logged-in user's."""
    if entity is None:
        import wandb

        entity = next((r.config.get("logger.wandb.entity") for r in runs), None) or (
            wandb.Api().default_entity
        )
    views, _ = sweep_views(runs, Path(folder).resolve().name, min_accuracy_ratio, entity)
    return [view.save().url for view in views]
