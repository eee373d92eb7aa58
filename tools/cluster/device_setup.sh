#!/usr/bin/env bash
# Installs the wheels of tools/cluster/device_wheels.sh on the GPU machine, without an index.
#
#   bash tools/cluster/device_setup.sh         # into .device_site (git-ignored), then:
#   export PYTHONPATH=$PWD/.device_site:$PWD
#
# A wheel is installed when the machine's Python lacks its distribution or has an older
# version (pydantic, for one, needs a recent typing_extensions), with --no-deps: the set is
# closed over what the image lacks. They go into a --target folder that PYTHONPATH puts
# first, so the image's own packages (torch above all) stay as they are, and the
# subprocesses that jobs.submit starts inherit it. (A venv made with --system-site-packages
# would see the base interpreter's packages, not those of an image that is itself a venv.)
# Without pip, wheels are unpacked as the zip files they are.
#
# Environment: PYTHON (default python3), WHEELS (.device_wheels), SITE (.device_site).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.device_wheels}
SITE=${SITE:-.device_site}
mkdir -p "$SITE"
SITE=$(cd "$SITE" && pwd)
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

mapfile -t NEED < <("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md
import pathlib
import sys

from packaging.version import Version

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
        continue
    if Version(have) < Version(version):
        print(wheel)
EOF
)

if [ ${#NEED[@]} -eq 0 ]; then
  echo "device_setup: nothing to install"
else
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "${NEED[@]}"
  else
    for w in "${NEED[@]}"; do "$PY" -m zipfile -e "$w" "$SITE"; done
  fi
  printf 'device_setup: installed %s\n' "${NEED[@]##*/}"
fi

"$PY" - <<'EOF'
import importlib.util

import torch

import jobs.submit  # noqa: F401
import rftpipe.run.worker  # noqa: F401
from rftpipe.observe import perf  # noqa: F401
from rftpipe.run import loop  # noqa: F401

cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA: {cuda}", end="")
if cuda:
    print(f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", end="")
print(f", deepspeed: {importlib.util.find_spec('deepspeed') is not None}")
EOF
