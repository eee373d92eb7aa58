"""What a train step ran on: the parts of the machine and software that decide its rounding.

A replayed train step equals its committed one bitwise only on the same hardware, library
versions and thread count: ATen picks its CPU kernels by the CPU's instruction set (AVX-512,
AVX2 or scalar, `ATEN_CPU_CAPABILITY` overrides it), a GPU model or a library version has
its own kernels, and the thread count splits reductions differently. The train stage
records `identity()` in its manifest, and a replay compares it with its own
(`rftpipe.stages.train`), so that a resume on another node says why its replay differs.

    from rftpipe.observe import machine
    machine.identity(world=2)  # {"cpu": "AMD EPYC", "aten_cpu_capability": "AVX2", ...}
    machine.changed(recorded, machine.identity(world=2))  # {"aten_cpu_capability": [...]}
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import torch


def identity(world: int) -> dict[str, Any]:
    """This process's identity as far as a train step's rounding goes (JSON-ready)."""
    return {
        "cpu": _cpu_model(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "threads": torch.get_num_threads(),
        "world_size": world,
    }


def changed(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, list[Any]]:
    """Key -> [recorded, now] for every part that differs (a key only one side has counts)."""
    return {
        k: [recorded.get(k), now.get(k)]
        for k in sorted(recorded.keys() | now.keys())
        if recorded.get(k) != now.get(k)
    }


def _cpu_model() -> str | None:
    # /proc/cpuinfo names the model on Linux x86 ("model name") and some ARM kernels
    # ("Model"); elsewhere the identity has no CPU model and the capability still tells.
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model") and value.strip():
            return value.strip()
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
