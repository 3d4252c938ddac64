"""Every job of a sweep checked before anything is submitted: on a login node, without weights
and without a GPU (`calm-lightning preflight`, calm_lightning/preflight.py).

Per job, in order: the config composes and validates (`config`); each data split loads at its
configured size from the Hub, its cache or local files, with the rows dropped and why, and the
splits are disjoint (`data`); the tokenizer puts BOS where its default says, the scored option
ids equal the joint encoding of prompt + letter, the chat template renders and the prompt is a
prefix of prompt + answer, and the lengths fit the model's context (`tokenizer`); the model's
config.json against the tokenizer's vocabulary, the LoRA target modules present on a meta-device
copy of the architecture, and the quantization the plan assumes available (`model`); the
planned peak against the device's usable memory (`memory`) and the planned time against the
launcher's limit x (requeues + 1) (`time`); the model revision pinned (`revision`).

A check shared by many jobs (the same data node, the same model and tokenizer) runs once
(`Memo`). A check that cannot run here (offline and nothing cached, a model that is not
converted yet) is SKIP with the reason; a job whose config does not compose is FAIL on `config`
and its other checks SKIP, while the other jobs are still checked. Nothing here loads weights:
the architecture is built on the meta device, and data and tokenizers are what a run reads
before its model loads anyway.
"""

from __future__ import annotations

from dataclasses import asdict

from omegaconf import OmegaConf

from calm_lightning.errors import CalmLightningError, DataSizeError, first_line
from calm_lightning.planning.model_checks import check_model, check_quantization, check_tokenizer
from calm_lightning.planning.preflight_checks import (
    CHECKS,
    FAIL,
    PASS,
    SKIP,
    SPLITS,
    UNAVAILABLE,
    UNWRITTEN_FOLDER,
    WARN,
    Check,
    JobReport,
    Memo,
    guarded,
    node_key,
)


def check_config(overrides: list[str]):
    """(the composed config, its Check): composes as `calm_lightning.run` would, then every
    value rule and the method's requirements (validation.py), nothing read or loaded."""
    from calm_lightning.methods.base import method_class
    from calm_lightning.planning.jobs import compose_run
    from calm_lightning.validation import validate_config

    try:
        # The run folder Hydra would make: a name only (nothing is written), so that the
        # config resolves outside a Hydra app.
        cfg = compose_run([*overrides, f"paths.output_dir={UNWRITTEN_FOLDER}"])
        cls = method_class(cfg)
        # as on the GPU node the job will run on (this may be a login node without one)
        validate_config(cfg, cls, _sources(cfg), cuda=True)
    except CalmLightningError as err:
        return None, Check("config", FAIL, first_line(err))
    return cfg, Check("config", PASS, f"{cfg.model.name} / {cfg.method.name} / {cfg.setting.name}")


def _sources(cfg) -> dict:
    """The setting's split sources, as the pipeline builds them (nothing read yet)."""
    from hydra.utils import instantiate

    setting = cfg.setting
    return {s: instantiate(setting[s]) for s in SPLITS if setting.get(s) is not None}


def check_data(cfg, memo: Memo) -> list[Check]:
    """Each split loads at its configured size (rows available, dropped and why), and the
    splits read from one pool share no record. A split's size is the loaders' to judge: they
    raise DataSizeError for a real shortfall (rows they drop, such as Alpaca's empty outputs,
    are counted, not a shortfall)."""
    rows, loaded = [], {}
    for split in SPLITS:
        node = cfg.setting.get(split)
        if node is None:
            continue
        check, ids = memo.get("data:" + node_key(node), lambda n=node, s=split: _load_split(n, s))
        rows.append(check)
        if ids is not None:
            loaded[split] = ids
    rows.append(_disjoint(loaded))
    return rows


def _load_split(node, split: str) -> tuple[Check, list[str] | None]:
    from hydra.utils import instantiate

    name = f"data.{split}"
    try:
        source = instantiate(node)
        records = source.load()
        described = source.describe() if hasattr(source, "describe") else {}
    except UNAVAILABLE as err:
        return Check(name, SKIP, f"offline or not cached: {first_line(err)}"), None
    except DataSizeError as err:
        detail = (
            f"split {err.split} of {err.source}: {err.available} rows available, {err.asked} "
            f"asked ({first_line(err)})"
        )
        return Check(name, FAIL, detail), None
    except CalmLightningError as err:
        return Check(name, FAIL, first_line(err)), None
    skipped = _skipped(described)
    detail = f"{len(records)} rows from {described.get('name', type(source).__name__)}"
    detail += f"; dropped: {skipped}" if skipped else ""
    ids = [str(getattr(r, "id", None) or i) for i, r in enumerate(records)]
    return Check(name, PASS, detail), ids


def _skipped(described: dict) -> str:
    """`reason: count` of the rows a source dropped, wherever its describe() keeps them."""
    counts: dict[str, int] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "skipped" and isinstance(value, dict):
                    for reason, n in value.items():
                        if isinstance(n, int):
                            counts[reason] = counts.get(reason, 0) + n
                        else:
                            walk(n)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(described)
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))


def _disjoint(loaded: dict[str, list[str]]) -> Check:
    """No record id in two splits (ids are per source: a pool's splits are disjoint blocks)."""
    if len(loaded) < 2:
        return Check("data.disjoint", SKIP, "fewer than two splits loaded")
    seen: dict[str, str] = {}
    for split, ids in loaded.items():
        for record_id in ids:
            if record_id in seen and seen[record_id] != split:
                return Check(
                    "data.disjoint",
                    FAIL,
                    f"record {record_id} is in both {seen[record_id]} and {split}",
                )
            seen[record_id] = split
    return Check("data.disjoint", PASS, " / ".join(loaded))


def check_cost(overrides: list[str], cfg, device: str, launcher: list[str]) -> list[Check]:
    """The plan's peak memory against the device's usable memory (as CUDA reports it), its
    time (with the plan's margin) against the launcher's limit x (requeues + 1)."""
    from calm_lightning.planning.jobs import compose_run, describe
    from calm_lightning.planning.pricing import price, slurm_timeout_min

    job = describe(overrides)
    price([job], device, None)
    estimate = job.estimate
    if "peak_gib" not in estimate:
        return [Check("memory", SKIP, estimate.get("basis", "no estimate"))]
    rows = [
        Check(
            "memory",
            PASS if estimate["fits"] else FAIL,
            f"planned peak {estimate['peak_gib']:.1f} GiB against {estimate['usable_gib']:.2f} GiB "
            f"usable on {device} ({job.quantization_reason})",
        )
    ]
    # The launcher's settings are the call's (`hydra.launcher.*` applies to every job of it).
    launcher = OmegaConf.select(compose_run([*overrides, *launcher], hydra=True), "hydra.launcher")
    limit = launcher.get("timeout_min") if launcher is not None else None
    if limit is None:
        rows.append(Check("time", SKIP, "a local launcher: no time limit"))
        return rows
    requeues = int(launcher.get("max_num_timeout", 0) or 0)
    available = float(limit) * (requeues + 1)
    needed = slurm_timeout_min(estimate["gpu_hours"])
    rows.append(
        Check(
            "time",
            PASS if needed <= available else FAIL,
            f"planned {needed} min (with the plan's margin) against timeout_min {limit} x "
            f"({requeues} requeues + 1)",
        )
    )
    return rows


def check_revision(cfg) -> Check:
    """A Hub model not pinned to a commit reads whatever its branch is at launch: WARN."""
    from calm_lightning.models.model_node import revision_note

    model = OmegaConf.to_container(cfg.model, resolve=True)
    note = revision_note(model)
    if note is not None:
        return Check("revision", WARN, note)
    return Check("revision", PASS, str(model.get("revision") or model.get("source")))


def check_job(overrides: list[str], device: str, memo: Memo, launcher: list[str] = ()) -> JobReport:
    """Every check of one job; the first FAIL on `config` leaves the others SKIP."""
    report = JobReport(list(overrides))
    cfg, config = check_config(overrides)
    report.checks.append(config)
    if cfg is None:
        report.checks += [Check(name, SKIP, "the config does not compose") for name in CHECKS[1:]]
        return report
    report.checks += check_data(cfg, memo)
    report.checks += check_tokenizer(cfg, memo)
    report.checks += check_model(cfg, memo)
    report.checks += guarded("model.quantization", lambda: [check_quantization(cfg)])
    report.checks += guarded("memory", lambda: check_cost(overrides, cfg, device, list(launcher)))
    report.checks.append(check_revision(cfg))
    return report


def preflight(target: str, extra: list[str], device: str) -> list[JobReport]:
    """Every job `target` (a sweep script, `+sweep=NAME` or plain overrides) launches,
    checked."""
    from calm_lightning.planning.sweep import expand_call, sweep_calls

    memo, reports = Memo(), []
    for call in sweep_calls(target, extra):
        try:
            jobs, _ = expand_call(call)
        except CalmLightningError as err:
            report = JobReport(list(call), [Check("config", FAIL, first_line(err))])
            report.checks += [Check(n, SKIP, "the config does not compose") for n in CHECKS[1:]]
            reports.append(report)
            continue
        launcher = [o for o in call if o.startswith("hydra.launcher.")]
        reports += [check_job(job, device, memo, launcher) for job in jobs]
    return reports


def record(reports: list[JobReport]) -> dict:
    """The `--json` record: {"jobs": [{"overrides": [...], "checks": [{name, status, detail}]}]}."""
    return {
        "jobs": [
            {"overrides": r.overrides, "checks": [asdict(c) for c in r.checks]} for r in reports
        ]
    }
