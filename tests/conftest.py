"""Shared helpers: run the real entry point on the tiny model in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache per test session; the tiny model is built into it once."""
    cache = Path(os.environ.get("RFTPIPE_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["RFTPIPE_CACHE"] = str(cache)
    subprocess.run(
        [sys.executable, "-m", "rftpipe.engines.models", "prepare-tiny"],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return cache


@pytest.fixture(scope="session")
def tiny_vl(model_cache: Path) -> Iterator[Path]:
    """`builtin:tiny-vl`, built once a session into the session's cache with the hub off."""
    from rftpipe.engines.models import prepare_tiny_vl

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield prepare_tiny_vl()
