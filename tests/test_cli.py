"""The `rftpipe` console script and what the wheel installs."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "run_v2_sapo"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_help_lists_the_commands_and_imports_nothing_heavy() -> None:
    code = (
        "import sys; from jobs import cli; rc = cli.main(['--help']); "
        "print('HEAVY:', *sorted(m for m in ('torch', 'transformers', 'pyarrow') "
        "if m in sys.modules)); sys.exit(rc)"
    )
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert all(c in r.stdout for c in ("submit", "status", "inspect"))
    assert r.stdout.strip().endswith("HEAVY:"), r.stdout


def test_unknown_command_is_one_error_and_exit_2() -> None:
    r = _run("-m", "jobs.cli", "sumbit")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == "rftpipe: error: unknown command 'sumbit'"


@pytest.mark.parametrize(
    ("sub", "module", "args"),
    [
        ("status", "jobs.status", ["--json"]),
        ("inspect", "rftpipe.inspect", ["summary", "--json"]),
        ("inspect", "tools.inspect", ["verify", "--json"]),
    ],
)
def test_subcommand_is_its_python_m_form(sub: str, module: str, args: list[str]) -> None:
    via_cli = _run("-m", "jobs.cli", sub, str(FIXTURE), *args)
    direct = _run("-m", module, str(FIXTURE), *args)
    assert via_cli.returncode == direct.returncode == 0, via_cli.stderr + direct.stderr
    assert json.loads(via_cli.stdout) == json.loads(direct.stdout)


@pytest.mark.slow
def test_wheel_installs_rftpipe_and_jobs_but_no_tools(tmp_path: Path) -> None:
    r = _run(
        "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("rftpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"rftpipe", "jobs"}, tops
    assert "rftpipe/inspect/cli.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rftpipe = jobs.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
