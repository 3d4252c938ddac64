"""Wall time of a CALM sweep with the base cache vs without, measured in one run.

Runs the same `--multirun` sweep (tiny model by default, `method=calm` over `--jobs` upper
LRs) twice through the command line, once with `evaluation.base_cache=true` (the first job
scores the base model, the others read it) and once with `evaluation.base_cache=false` (every
job scores it), alternating which goes first over `--repeats`, and prints the wall times, the
seconds spent on the base row, their ratio, and whether both sweeps wrote the same base rows.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/base_cache.py              # 3 jobs, 320 questions
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/base_cache.py --model smollm2 --limit 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calm_lightning.runtime.run_record import BASE_DIR, find_runs


def sweep(folder: Path, cached: bool, args) -> float:
    """One multirun; its wall time in seconds."""
    lrs = ",".join(str(0.01 * (i + 1)) for i in range(args.jobs))
    command = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "--multirun",
        f"model={args.model}",
        "method=calm",
        "setting=demo",
        f"setting.test.limit={args.limit}",
        f"setting.eval_batch_size={args.eval_batch}",
        "trainer.limit_train_batches=1",
        "method.module.inner_steps=1",
        "trainer.enable_progress_bar=false",
        "logger=none",
        f"evaluation.base_cache={str(cached).lower()}",
        f"method.module.upper_lr={lrs}",
        f"hydra.sweep.dir={folder}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return seconds


def phase_seconds(folder: Path) -> tuple[dict, list[str]]:
    """Seconds the sweep's jobs spent per phase (summed over jobs), and each job's cache
    status."""
    runs = [r for r in find_runs([folder]) if r.finished]
    if len(runs) == 0:
        raise SystemExit(f"{folder}: no finished runs")
    phases: dict[str, float] = {}
    for run in runs:
        for phase, seconds in run.summary["timings"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return phases, [r.summary["base_cache"]["base"]["status"] for r in runs]


def base_files(folder: Path) -> list[dict]:
    return [
        {p.name: p.read_bytes() for p in (r.path / BASE_DIR).iterdir()} for r in find_runs([folder])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model config (tiny, smollm2, ...)")
    parser.add_argument("--jobs", type=int, default=3, help="jobs of the sweep")
    parser.add_argument("--limit", type=int, default=320, help="test questions scored")
    parser.add_argument("--eval-batch", type=int, default=16, help="setting.eval_batch_size")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of sweeps (alternating)")
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    base: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for cached in order:
                folder = Path(tmp) / f"{'cached' if cached else 'uncached'}_{repeat}"
                times[cached].append(sweep(folder, cached, args))
                phases, statuses = phase_seconds(folder)
                base[cached].append(phases["evaluate_base_s"])
                print(
                    f"sweep {repeat} {'with' if cached else 'without'} cache: "
                    f"{times[cached][-1]:.1f} s wall ({', '.join(statuses)}); summed over jobs: "
                    + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in phases.items())
                )
        same = base_files(Path(tmp) / "cached_0") == base_files(Path(tmp) / "uncached_0")
    with_cache, without = statistics.median(times[True]), statistics.median(times[False])
    print(
        json.dumps(
            {
                "model": args.model,
                "jobs": args.jobs,
                "test_questions": args.limit,
                "wall_s_with_cache": round(with_cache, 2),
                "wall_s_without_cache": round(without, 2),
                "base_s_with_cache": round(statistics.median(base[True]), 2),
                "base_s_without_cache": round(statistics.median(base[False]), 2),
            }
        )
    )
    print(f"base rows byte-identical with and without the cache: {same}")
    print(f"wall-time ratio with / without cache: {with_cache / without:.3f}")


if __name__ == "__main__":
    main()
