"""The package as users install it: `pip install .` (not editable) into a fresh virtual
environment finds the top-level `conf/` tree and runs a job from another directory."""

from __future__ import annotations

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
    done = subprocess.run(
        [
            str(python),
            "-m",
            "calm_lightning.run",
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
