"""tools/testing/zygote.py: the warm interpreter that forks the shared phase's run workers.

A forked worker must be the process a new interpreter would have been: the same run,
bitwise, the same exit (code or signal) for its launcher, dead when its stand-in dies,
and a launch the server cannot reproduce (another environment, a PYTHONPATH that shadows
what it imported) must start a new interpreter instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    TINY,
    alive,
    backend_workers,
    events,
    final_weights,
    starts_vllm,
    trajectories,
)

from tools.testing import zygote


def _request(env: dict[str, str], cwd: str = str(ROOT), module: str = "rftpipe.run.worker"):
    return {"module": module, "args": ["RUN"], "env": env, "cwd": cwd}


def test_refusals_name_what_differs(tmp_path: Path) -> None:
    env = {"PATH": "/bin", "PYTHONPATH": str(ROOT)}
    added = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    cwd = str(ROOT)
    ok = {**env, "RANK": "1", "RFTPIPE_FAULT": "train_mid_step", "PYTEST_CURRENT_TEST": "t"}
    assert zygote._refusal(_request(ok), env, added, cwd) is None
    # rftpipe's own variables, and a proxy list read when a request is made.
    ok = {**env, "RFTPIPE_REWARD_TOKEN": "t", "NO_PROXY": "127.0.0.1"}
    assert zygote._refusal(_request(ok), env, added, cwd) is None
    # A variable the server's imports set: the same value, or absent, is what it would be.
    assert zygote._refusal(_request({**env, **added}), env, added, cwd) is None
    why = zygote._refusal(_request({**env, "TORCHINDUCTOR_CACHE_DIR": "/o"}), env, added, cwd)
    assert why and "TORCHINDUCTOR_CACHE_DIR" in why
    why = zygote._refusal(_request({**env, "MKL_NUM_THREADS": "1"}), env, added, cwd)
    assert why and "MKL_NUM_THREADS" in why
    assert "working directory" in str(zygote._refusal(_request(env, cwd="/tmp"), env, added, cwd))
    assert "module" in str(
        zygote._refusal(_request(env, module="rftpipe.inspect"), env, added, cwd)
    )
    script = {**_request(env), "script": str(ROOT / "tests" / "backend_worker.py")}
    assert zygote._refusal(script, env, added, cwd) is None
    elsewhere = {**script, "script": str(tmp_path / "x_worker.py")}
    assert "not a rank script" in str(zygote._refusal(elsewhere, env, added, cwd))
    # A thread count the server did not start with is set in the fork; another is not.
    threads = {**env, "OMP_NUM_THREADS": "1"}
    assert zygote._refusal(_request(threads), env, added, cwd) is None
    why = zygote._refusal(_request({**env, "OMP_NUM_THREADS": "2"}), threads, added, cwd)
    assert why and "OMP_NUM_THREADS" in why
    # A PYTHONPATH entry of the test's own is taken; one that shadows an imported module not.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "reward_mod.py").write_text("")
    extra = {**env, "PYTHONPATH": f"{mine}:{ROOT}"}
    assert zygote._refusal(_request(extra), env, added, cwd) is None
    (mine / "json").mkdir()  # `json` is imported here, as by the server
    why = zygote._refusal(_request(extra), env, added, cwd)
    assert why and "json" in why and "shadows" in why


def test_vllms_variables_differ_only_where_the_server_has_not_imported_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"PATH": "/bin"}
    req = _request({**env, "VLLM_LOGGING_LEVEL": "DEBUG"})
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert zygote._refusal(req, env, {}, str(ROOT)) is None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    assert "VLLM_LOGGING_LEVEL" in str(zygote._refusal(req, env, {}, str(ROOT)))


def test_rftpipe_reads_no_variable_a_fork_may_change_at_import() -> None:
    """The server imports `PRELOAD_OWN` once, then forks launches whose RFTPIPE_* and
    `PER_LAUNCH` variables differ from its own: right only if importing them reads none
    of those (a module-level `os.environ.get("RFTPIPE_...")` would keep the server's)."""
    code = """
import importlib, os, sys
from tools.testing import zygote
for name in zygote.PRELOAD:
    importlib.import_module(name)
read = set()
get = os._Environ.__getitem__
def spy(self, key):
    read.add(key)
    return get(self, key)
os._Environ.__getitem__ = spy
for name in zygote.PRELOAD_OWN:
    importlib.import_module(name)
os.environ.get("RFTPIPE_PROBE")  # the spy sees a read
print("read:", *sorted(read))
"""
    env = {**os.environ, "RFTPIPE_PROBE": "1", "NO_PROXY": "127.0.0.1"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # The last line: DeepSpeed's import logs to stdout.
    read = set(out.stdout.splitlines()[-1].split()[1:])
    assert "RFTPIPE_PROBE" in read, read
    free = {k for k in read - {"RFTPIPE_PROBE"} if k.startswith(zygote.OWN_PREFIX)}
    assert not free | (read & zygote.PER_LAUNCH), read


def test_worker_env_is_what_the_worker_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sets, before its imports, exactly the variables the worker sets before
    it imports transformers; a forked worker would otherwise miss what they do at import
    (HF_HUB_OFFLINE is read once, when huggingface_hub is imported)."""
    from rftpipe.run.worker import setup_logging

    for key in zygote.WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("INFO", 1)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert added == zygote.WORKER_ENV


@contextlib.contextmanager
def _serving(root: Path, *preload: str) -> Iterator[tuple[dict[str, str], Path]]:
    """A server of this module's own (the session's may be off, or import other modules),
    and the environment launches must have for it to fork them."""
    sock = root / "z.sock"
    env = {**os.environ, zygote.ENV: str(sock), "RFTPIPE_WORKER_VIA": "tools.testing.zygote"}
    proc = zygote.start_server(str(sock), preload, wait_s=300, env=env)
    assert sock.exists(), "the server did not start"
    try:
        yield env, Path(f"{sock}.log")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Path]]:
    with _serving(tmp_path_factory.mktemp("zygote")) as served:
        yield served


def _submit(
    env: dict[str, str], run: Path, *overrides: str, via: str = "", **kw
) -> subprocess.Popen:
    """`python -m jobs.submit` on `run` (through the stand-in module `via`, if any)."""
    cmd = [sys.executable, "-m", *([via] if via else []), "jobs.submit", "--cluster", "local"]
    cmd += ["--run-dir", str(run)]
    cmd += ["--config", str(TINY), *overrides]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def _forked(log: Path, run: Path) -> set[int]:
    """The run's worker processes that the server forked (their pids are in the events)."""
    pids = {e["pid"] for e in events(run) if e["event"] == "start"}
    forked = {int(line.split()[1]) for line in log.read_text().splitlines() if "forked" in line}
    return pids & forked


@pytest.mark.slow
@pytest.mark.tier1
def test_a_forked_run_equals_a_new_interpreters_and_is_killed_like_one(
    server: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, log = server
    steps = ("total_steps=4",)
    cold = tmp_path / "cold"
    out = _submit({**env, "RFTPIPE_WORKER_VIA": ""}, cold, *steps).communicate(timeout=300)
    assert not _forked(log, cold), out

    # Killed by a fault point inside the forked worker: its launcher sees the SIGKILL.
    warm = tmp_path / "warm"
    proc = _submit({**env, "RFTPIPE_FAULT": "stage_after_commit"}, warm, *steps)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err
    assert any(e["event"] == "fault" for e in events(warm))
    # ...its stand-in killed with the launcher's process group: the worker dies too.
    starts = sum(e["event"] == "start" for e in events(warm))
    proc = _submit({**env, "RFTPIPE_SLOW": "train=30"}, warm, *steps, start_new_session=True)
    deadline = time.time() + 120
    while sum(e["event"] == "start" for e in events(warm)) == starts:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    pid = [e for e in events(warm) if e["event"] == "start"][-1]["pid"]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while alive(pid):
        assert time.time() < deadline, f"worker {pid} outlived its stand-in"
        time.sleep(0.05)
    out = _submit(env, warm, *steps).communicate(timeout=300)
    assert len(_forked(log, warm)) == 3, (out, log.read_text())

    assert trajectories(cold).equals(trajectories(warm))
    wa, wb = final_weights(cold), final_weights(warm)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_forked_launcher_answers_bad_input_as_a_new_one_does(
    server: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """`tests/helpers.submit` forks the launcher too: its exit code, stdout and stderr are a
    new interpreter's (here a config error: exit 2, one line naming the value)."""
    env, log = server
    out = {}
    for via in ("", "tools.testing.zygote"):
        forks = log.read_text().count("forked")
        proc = _submit(env, tmp_path / f"run{via}", "train.lr=-1", via=via)
        stdout, stderr = proc.communicate(timeout=120)
        out[via] = (proc.returncode, stdout, stderr)
        assert log.read_text().count("forked") == forks + bool(via), log.read_text()
    cold, warm = out[""], out["tools.testing.zygote"]
    assert cold[0] == warm[0] == 2, (cold, warm)
    assert "lr must be > 0" in cold[2] and len(cold[2].strip().splitlines()) == 1, cold
    assert warm[1:] == cold[1:]


@pytest.mark.slow
def test_a_forked_rank_script_equals_a_new_interpreters(
    server: tuple[dict[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`launch_ranks` runs its rank scripts with OMP_NUM_THREADS=1, which the server did
    not start with: the fork sets it, and trains as a new interpreter does, bitwise."""
    env, log = server
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RFTPIPE_WORKER_VIA", "")
    cold = backend_workers(tmp_path / "cold", 1, "backend=single")
    forks = log.read_text().count("forked")
    monkeypatch.setenv("RFTPIPE_WORKER_VIA", "tools.testing.zygote")
    warm = backend_workers(tmp_path / "warm", 1, "backend=single")
    assert log.read_text().count("forked") == forks + 1, log.read_text()
    assert warm["metrics"] == cold["metrics"]
    wa, wb = cold["weights"], warm["weights"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@starts_vllm
def test_a_run_forked_from_an_interpreter_that_imported_vllm_equals_a_new_ones(
    tmp_path: Path,
) -> None:
    """The vLLM lane's server imports vLLM before it forks (`serve SOCKET vllm`): a vLLM
    run forked from it samples and trains what a new interpreter's does, bitwise."""
    steps = ("rollout.engine=vllm", "total_steps=2")
    with _serving(tmp_path, "vllm") as (env, log):
        cold, warm = tmp_path / "cold", tmp_path / "warm"
        for run, via in ((cold, ""), (warm, "tools.testing.zygote")):
            proc = _submit({**env, "RFTPIPE_WORKER_VIA": via}, run, *steps)
            out = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
        assert not _forked(log, cold)
        assert len(_forked(log, warm)) == 1, (out, log.read_text())
    assert trajectories(cold).equals(trajectories(warm))
    wa, wb = final_weights(cold), final_weights(warm)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
