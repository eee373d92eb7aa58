#!/usr/bin/env bash
# Fetches, on this machine, the wheels the GPU machine lacks (it has no package index).
#
#   bash tools/cluster/device_wheels.sh [DIR]  # default DIR: .device_wheels (git-ignored)
#   PYVER=3.11 bash tools/cluster/device_wheels.sh /tmp/w311  # the same set for another Python
#
# The GPU image has Python 3.12 with torch, transformers, accelerate, pyarrow, numpy,
# PyYAML, safetensors, xxhash and their dependencies. rftpipe's pipeline also needs, for
# its tests, pytest and pytest-timeout, and for train.backend=deepspeed, DeepSpeed (built
# here as a wheel without compiled ops: DS_BUILD_OPS=0) and its dependencies. The set is
# closed under dependencies (minus torch's and numpy); tools/cluster/device_setup.sh
# installs the ones the machine lacks. The pipeline runs without reasoning-gym (data.source=file),
# tensorboard (logging.tensorboard=false), wandb (off) and submitit (--cluster local).
# About 8 MiB; the run tool carries it with carry=[".device_wheels"].
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.device_wheels}
PYVER=${PYVER:-3.12}
# DeepSpeed's setup.py imports torch, so its wheel is built by a Python that has torch.
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DIR"

# The versions this repository's CI runs with.
REQS=(
  pytest==9.2.0 pytest-timeout==2.4.0
  hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2
  pydantic==2.14.4 psutil==7.2.2 tqdm==4.70.1 packaging
)
"$PY" -m pip download --quiet --dest "$DIR" --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${REQS[@]}"

if ! ls "$DIR"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation \
    --wheel-dir "$DIR" deepspeed==0.19.8
fi
du -sh "$DIR"
ls "$DIR"
