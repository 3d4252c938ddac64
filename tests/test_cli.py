"""`python -m calm_lightning <command>`: the shared argument parsers against hand-written cases,
the top-level help, each command's help, the module entries, and `run` starting DDP processes
through the one command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calm_lightning.arguments import key_value_arguments, parse_bool, parse_list
from calm_lightning.cli import COMMANDS, build_parser, main
from calm_lightning.errors import ConfigError, first_line

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("run", "report", "plan", "preflight", "export", "retention", "check")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("true", True), ("True", True), ("TRUE", True), ("1", True), ("yes", True),
        (" yes ", True), ("false", False), ("False", False), ("0", False), ("no", False),
        ("NO", False), (True, True), (False, False),
    ],
)  # fmt: skip
def test_parse_bool_reads_the_usual_words(text, expected):
    assert parse_bool(text, "flag") is expected


@pytest.mark.parametrize("text", ["perhaps", "", "2", "on", "t"])
def test_parse_bool_refuses_anything_else_naming_the_argument(text):
    with pytest.raises(ConfigError, match=f"^merge={text!r} is not true or false$"):
        parse_bool(text, "merge")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[piqa,winogrande]", ["piqa", "winogrande"]),
        ("piqa,winogrande", ["piqa", "winogrande"]),
        ("[ piqa , winogrande ]", ["piqa", "winogrande"]),
        ("piqa", ["piqa"]),
        ("[piqa]", ["piqa"]),
        ("['a b', \"c\"]", ["a b", "c"]),
        ("[/data/x.jsonl,/data/y.jsonl]", ["/data/x.jsonl", "/data/y.jsonl"]),
        ("[]", []),
        ("", []),
        ("a,,b,", ["a", "b"]),
        (["x", 1], ["x", "1"]),
    ],
)
def test_parse_list_reads_brackets_and_bare_commas(text, expected):
    assert parse_list(text, "tasks") == expected


@pytest.mark.parametrize("text", ["[piqa", "piqa]"])
def test_parse_list_refuses_an_unclosed_bracket(text):
    with pytest.raises(ConfigError, match="is not a list"):
        parse_list(text, "tasks")


def test_the_documented_retention_lists_read_as_omegaconf_read_them():
    """The key=value forms docs/retention.md shows, against the parser they replaced
    (OmegaConf's dotlist)."""
    from calm_lightning.retention import parse_arguments

    argv = [
        "run_dir=outputs/runs/x",
        "tasks=[piqa,winogrande,arc_challenge]",
        "data_files.arc_challenge=[/data/arc_challenge_test.jsonl]",
        "data_files.piqa=[/data/a.jsonl, /data/b.jsonl]",
        "limit=200",
        "batch_size=4",
        "out=/tmp/o",
    ]
    assert parse_arguments(argv) == OmegaConf.to_container(OmegaConf.from_dotlist(argv))
    assert parse_arguments(["run_dir=r", "limit=null", "overwrite=true"]) == {
        "run_dir": "r",
        "limit": None,
        "overwrite": True,
    }
    with pytest.raises(ConfigError, match="limit='many' is not a whole number"):
        parse_arguments(["run_dir=r", "limit=many"])


def test_key_value_arguments_take_known_and_nested_keys_only():
    keys = ("run_dir", "data_files", "out")
    nested = ("data_files",)
    got = key_value_arguments(["run_dir=a=b", "data_files.piqa=[x]"], keys, "usage", nested)
    assert got == {"run_dir": "a=b", "data_files.piqa": "[x]"}  # the first `=` splits
    for bad in ("colour=red", "run_dir", "data_files=[x]", "data_files.=x", "out.x=y"):
        message = re.escape(f"unknown argument {bad!r} (arguments are key=value, keys: run_dir, ")
        with pytest.raises(ConfigError, match=message):
            key_value_arguments([bad], keys, "usage", nested)


def test_the_top_level_help_lists_every_command_with_its_line(capsys):
    assert set(COMMANDS) == set(SUBCOMMANDS)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for name in SUBCOMMANDS:
        assert f"{name} {COMMANDS[name].summary}" in printed


@pytest.mark.parametrize("name", [n for n in SUBCOMMANDS if n != "run"])
def test_each_command_has_its_own_help(name, capsys):
    """(`run --help` is Hydra's; the packaging test runs it in a fresh process.)"""
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: ") and f" {name} [-h]" in printed.splitlines()[0]


@pytest.mark.integration
def test_only_the_chosen_commands_module_is_imported():
    code = (
        "import json, sys; from calm_lightning.cli import build_parser; build_parser('plan');"
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = set(json.loads(done.stdout))
    assert {"calm_lightning.plan", "calm_lightning.cli"} <= imported
    assert not imported & {"calm_lightning.report", "calm_lightning.acceptance", "torch"}


def test_a_module_entry_is_the_same_command_under_its_own_name(tmp_path, capsys):
    from calm_lightning import export, plan, report, retention

    for module, name in ((export, "export"), (plan, "plan"), (report, "report")):
        with pytest.raises(SystemExit):
            module.main(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: python -m calm_lightning.{name} ")
    # The same user error, the same message and status from both entries.
    for call in (lambda a: retention.main(a), lambda a: main(["retention", *a])):
        assert call([f"run_dir={tmp_path}", "overwrite=perhaps"]) == 1
        assert "overwrite='perhaps' is not true or false" in capsys.readouterr().err
    assert build_parser("export").parse_args(["export", "out=x"]).arguments == ["out=x"]


@pytest.mark.system
def test_run_starts_its_ddp_processes_through_the_one_command_line(tmp_path):
    """Lightning re-runs the command line for each further DDP process; through `python -m
    calm_lightning run` that must again be the Hydra app with the same overrides."""
    out = tmp_path / "ddp"
    overrides = [
        "model=tiny", "method=base", "setting.test.limit=4", "logger=none",
        "trainer.enable_progress_bar=false", "trainer=ddp", "trainer.accelerator=cpu",
        "trainer.devices=2", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "calm_lightning", "run", *overrides],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "MEMBER: 2/2" in done.stdout + done.stderr  # the second process joined
    assert json.loads((out / "metrics.json").read_text())["metrics"]["n"] == 4


def test_a_one_line_message_quotes_an_errors_first_line_or_its_class():
    assert first_line(ValueError("  bad value\n  at line 3\n")) == "bad value"
    assert first_line(KeyError()) == "KeyError"  # no text: an empty quote would say nothing
    assert first_line(OSError("x" * 300), 200) == "x" * 200
