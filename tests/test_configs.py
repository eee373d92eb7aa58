"""Every shipped config loads; every config field is documented; the CLI surface is frozen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs.submit import parse_args
from rftpipe.config.loader import field_docs, iter_fields, load_config
from rftpipe.config.schema import RunConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    cfg = load_config(RunConfig, path)
    assert cfg.total_steps >= 1


def test_every_field_has_a_docstring() -> None:
    missing = []
    for dotted, _hint, _default in iter_fields(RunConfig):
        owner = RunConfig
        *parents, name = dotted.split(".")
        for part in parents:
            owner = type(getattr(owner(), part)) if isinstance(owner, type) else owner
        if not field_docs(owner).get(name):
            missing.append(dotted)
    assert not missing, missing


def test_cli_flags_are_frozen_and_documented() -> None:
    parser_flags = {a for action in parse_args([])._get_kwargs() for a in [action[0]]}
    assert parser_flags == {
        "cluster",
        "config",
        "run_dir",
        "tasks_per_node",
        "repair",
        "allow_fingerprint_mismatch",
        "create_only",
        "nodes",
        "gpus_per_node",
        "cpus_per_task",
        "mem",
        "partition",
        "account",
        "qos",
        "time",
        "constraint",
        "exclusive",
        "signal_delay",
        "sbatch",
        "job_name",
        "dry_run",
        "wait",
        "overrides",
    }
    help_text = subprocess.run(
        [sys.executable, "-m", "jobs.submit", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    for flag in parser_flags - {"overrides"}:
        assert "--" + flag.replace("_", "-") in help_text, flag
