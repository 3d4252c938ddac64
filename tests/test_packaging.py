"""The package as users install it: `pip install .` (not editable) into a fresh virtual
environment finds the top-level `conf/` tree, offers every command of `python -m calm_lightning`
(the acceptance check's measurements included, without the repository's benchmarks/) and runs a
job from another directory."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    """setuptools' explicit package list (needed to map conf/ into the package) must name
    every folder with an __init__.py, or a wheel silently lacks it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "calm_lightning").rglob("__init__.py")
    }
    assert found | {"calm_lightning.conf"} == listed


# In the installed copy: every command's --help (run's is Hydra's) in one process, and the
# packaged benchmarks' own --help (they read calm.yaml from the installed config package).
HELP_LOOP = """
import contextlib, io, json, sys
from calm_lightning.benchmarking import calm_step, sampling
from calm_lightning.cli import COMMANDS, main
status = {}
calls = [(name, lambda n=name: main([n, "--help"])) for name in COMMANDS]
calls += [(m.__name__, lambda m=m: m.main(["--help"])) for m in (calm_step, sampling)]
for name, call in calls:
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            call()
        status[name] = None
    except SystemExit as done:
        status[name] = done.code
    status[name + " printed"] = printed.getvalue()
print(json.dumps(status))
"""


@pytest.mark.integration
def test_pip_install_into_a_fresh_venv_runs_a_job_from_another_directory(tmp_path):
    # A copy of the source tree without build leftovers (an in-tree build/ could carry stale
    # modules into the wheel).
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "outputs",
            "multirun",
            "__pycache__",
            ".pytest_cache",
            ".ruff_cache",
            "wandb",
        ),
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # The fresh environment borrows the already-installed dependencies (torch, transformers, ...)
    # through a path entry, so the test installs only this project and needs no network. A
    # plain path entry does not run the dependency environment's .pth files, so the editable
    # install of the checkout stays invisible there.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    where = subprocess.run(
        [str(python), "-c", "import calm_lightning.conf as c; print(c.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(purelib), where  # the installed copy, not the checkout
    assert Path(where).with_name("run.yaml").is_file()
    _check_the_command_line(python, elsewhere, env)
    # The job through the installed `calm-lightning run` script (python -m calm_lightning.run
    # runs the same Hydra app, and every other test starts it so).
    done = subprocess.run(
        [
            str(env_dir / "bin" / "calm-lightning"),
            "run",
            "model=tiny",
            "method=base",
            "setting.test.limit=4",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"n": 4' in (tmp_path / "run" / "metrics.json").read_text()


def _check_the_command_line(python: Path, cwd: Path, env: dict) -> None:
    """`python -m calm_lightning --help` lists the six commands and each command's --help
    exits 0, in the installed copy."""
    from calm_lightning.cli import COMMANDS

    listed = subprocess.run(
        [str(python), "-m", "calm_lightning", "--help"],
        cwd=cwd, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    printed = " ".join(listed.stdout.split())
    for name, command in COMMANDS.items():
        assert f"{name} {command.summary}" in printed, name
    done = subprocess.run(
        [str(python), "-c", HELP_LOOP], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads(done.stdout.splitlines()[-1])
    benchmarks = [f"calm_lightning.benchmarking.{name}" for name in ("calm_step", "sampling")]
    for name in [*COMMANDS, *benchmarks]:
        assert status[name] == 0, (name, status[name], status[name + " printed"][-2000:])
        assert status[name + " printed"].startswith(("usage:", "run is powered by Hydra")), name
