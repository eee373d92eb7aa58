"""Shared helpers: run the real entry point on the tiny model in a subprocess."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.testing import zygote
from tools.testing.runner import GATE

ROOT = Path(__file__).resolve().parent.parent
_ZYGOTE = os.environ.get("RFTPIPE_TEST_ZYGOTE", "")
#: Whether this pytest process forks its run workers from a warm interpreter
#: (`worker_zygote`); `tools.test` turns it off (RFTPIPE_TEST_ZYGOTE=0) for the Slurm lane
#: and the serial phase.
FORKS = _ZYGOTE != "0"
#: The `tools.testing.zygote.EXTRAS` the warm interpreter imports besides its `PRELOAD`
#: (RFTPIPE_TEST_ZYGOTE=vllm: `tools.test`'s vLLM lane, whose runs start vLLM engines).
EXTRAS = tuple(m for m in _ZYGOTE.split(",") if m not in ("", "0", "1"))
#: The longest the first test waits for the server (its launches start new interpreters
#: after that, or once it has died).
ZYGOTE_WAIT_S = 120.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (seconds from tests/durations.json, which
    `python -m tools.test --record` rewrites; a new file counts as short), each file's tests
    in their own order. pytest-xdist hands files to its workers in this order, so the
    parallel phase does not end with one long file running alone."""
    path = ROOT / "tests" / "durations.json"
    seconds = json.loads(path.read_text()) if path.exists() else {}

    def weight(item: pytest.Item) -> float:
        return -seconds.get(Path(item.path).relative_to(ROOT).as_posix(), 0.0)

    items.sort(key=weight)  # stable: within a file, the collection order stays


def pytest_runtestloop(session: pytest.Session) -> None:
    """`tools.test` starts its serial phase with the others so that it collects while they
    run; with RFTPIPE_TEST_GATE set, its tests wait here until that file exists."""
    gate = os.environ.get(GATE)
    if gate and session.items:
        Path(f"{gate}.waiting").touch()  # collected: what tests/test_test_tools.py waits for
        while not Path(gate).exists():
            time.sleep(0.2)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache per test session; the tiny model is built into it once.

    Under pytest-xdist every worker runs this fixture: they share one cache beside their
    base temporary directories (`tools.test`'s phases share RFTPIPE_TEST_CACHE). One at a
    time under `build_lock`, the first builds a model and publishes it by an atomic rename
    (`rftpipe.engines.models._publish_dir`); the others find it built."""
    shared = os.environ.get("RFTPIPE_TEST_CACHE")
    if not shared and os.environ.get("PYTEST_XDIST_WORKER"):
        shared = str(tmp_path_factory.getbasetemp().parent / "cache")
    cache = Path(shared) if shared else tmp_path_factory.mktemp("cache")
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["RFTPIPE_CACHE"] = str(cache)
    with build_lock(cache):
        subprocess.run(
            [sys.executable, "-m", "rftpipe.engines.models", "prepare-tiny"],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
    return cache


@pytest.fixture(scope="session", autouse=True)
def worker_zygote(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A warm interpreter per pytest process that forks the run workers `jobs.submit
    --cluster local` starts (tools/testing/zygote.py): each would otherwise spend most of a short
    run importing torch and transformers. A launch whose environment differs from this
    process's (but for per-launch variables) starts a new interpreter. The first test
    waits until the server has imported (at most `ZYGOTE_WAIT_S`): the longest files come
    first and launch runs at once, and each launch before the server is up would be a new
    interpreter importing the same packages beside it. RFTPIPE_TEST_ZYGOTE=0 turns it off
    (`tools.test` does for its Slurm lane), =vllm imports vLLM in it too; a test sets
    RFTPIPE_WORKER_VIA="" for new interpreters."""
    if not FORKS:
        yield
        return
    sock = tmp_path_factory.getbasetemp() / "zygote.sock"
    os.environ["RFTPIPE_ZYGOTE"] = str(sock)
    os.environ["RFTPIPE_WORKER_VIA"] = "tools.testing.zygote"
    with open(f"{sock}.err", "wb") as err:
        server = zygote.start_server(
            str(sock), EXTRAS, wait_s=ZYGOTE_WAIT_S, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        yield
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.fixture(scope="session", autouse=True)
def one_thread_a_worker() -> None:
    """Under pytest-xdist (`tools.test`'s shared phase: a worker a core, the lanes beside
    them), a test computes in its own process on one thread. Torch's default, a thread a
    core, finds no idle core there: the second thread waits for one, spinning on a core
    another process needs (OpenMP's wait policy), and the tests took more CPU in all.
    The runs they start set their own (`launch.threads`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def module_environ() -> Iterator[None]:
    """With the warm forks on: os.environ as it was before each test module, after it.

    An in-process import can set variables for good (`import vllm` sets LD_PRELOAD and a
    dozen VLLM_ ones; `import deepspeed` PYTORCH_NVML_BASED_CUDA_CHECK), and every later
    subprocess of this pytest process inherited them: runs started after such a module
    got another environment than runs started before it, and no longer matched the
    server's (at 045f3d7 about half the shared phase's launches fell back to new
    interpreters for this). Autouse and module-scoped, it is set up before a module's
    other fixtures and torn down after them (a fixture's own variables, such as
    test_slurm.py's SLURM_CONF, stay for its module). Off without the forks and in the
    vLLM lane: its modules share one imported vLLM, whose variables its engines read
    later (and its server imported vLLM too, so what the import set is no difference)."""
    if not FORKS or "vllm" in EXTRAS:
        yield
        return
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@contextlib.contextmanager
def build_lock(cache: Path) -> Iterator[None]:
    """Held while a model is built into the shared cache: the phases and workers that
    start together would each build it at once (the rename keeps the cache whole
    either way); under the lock the first builds and the others find it built."""
    with open(cache / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_vl(model_cache: Path) -> Iterator[Path]:
    """`builtin:tiny-vl`, built once a session into the session's cache with the hub off."""
    from rftpipe.engines.models import prepare_tiny_vl

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        with build_lock(model_cache):
            path = prepare_tiny_vl()
        yield path


@pytest.fixture(scope="module")
def vl_encoder(tiny_vl: Path) -> Any:  # -> rftpipe.engines.vision.VisionEncoder
    """`builtin:tiny-vl`'s prompt encoding (tokenizer and image processor)."""
    from rftpipe.engines.vision import VisionEncoder

    return VisionEncoder.load(tiny_vl)


@pytest.fixture(scope="module")
def vl_prompts(tmp_path_factory: pytest.TempPathFactory, vl_encoder: Any) -> list:
    """A 1-image, a 2-image and a text prompt of unequal lengths, encoded for
    `builtin:tiny-vl` (`EncodedPrompt`s): a batch of them pads and mixes image and text."""
    from helpers import png

    from rftpipe.data.images import vision_prompt

    d = tmp_path_factory.mktemp("images")
    paths = []
    for i, (w, h) in enumerate([(56, 56), (80, 60), (40, 90)]):
        paths.append(d / f"im{i}.png")
        paths[-1].write_bytes(png(i, w, h))
    return [
        vl_encoder.encode(vision_prompt("<image>What is it?", str(paths[0]), row="row 0")),
        vl_encoder.encode(
            vision_prompt("<image> or <image>: taller?", [str(paths[1]), str(paths[2])], row="r1")
        ),
        vl_encoder.encode(vision_prompt("no picture here, only some text", row="row 2")),
    ]
