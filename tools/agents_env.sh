#!/usr/bin/env bash
# Builds the second interpreter of the agent adapter tests (tests/test_agent_adapters.py):
# verifiers 0.4.0 needs openai>=2.54,<3, the trainer's venv has openai 3 (the Agents SDK
# needs it), so verifiers' agents run under their own venv (`rollout.agent.python`).
#
#   bash tools/agents_env.sh          # .venv-agents/ in the repo root
#   bash tools/agents_env.sh DIR      # elsewhere (the tests: RFTPIPE_AGENTS_PYTHON=DIR/bin/python)
#
# Idempotent: a venv that already has the pinned versions is left as it is (a second run
# takes about a second). A fresh build takes about 2 minutes and 570 MB (transformers and
# tokenizers without torch, for verifiers' renderers; sympy for math-verify).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-.venv-agents}
VERIFIERS=0.4.0
OPENAI=">=2.54,<3"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# The pins, checked without pip (which would take seconds to resolve and may reach the index).
check() {
  "$DIR/bin/python" - "$VERIFIERS" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version

ok = version("verifiers") == sys.argv[1] and version("openai").split(".")[0] == "2"
sys.exit(0 if ok else 1)
EOF
}

if [ -x "$DIR/bin/python" ] && check; then
  echo "agents env ready: $DIR/bin/python"
  exit 0
fi
[ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet "verifiers==$VERIFIERS" "openai$OPENAI"
# What the agent processes import: verifiers' stack and the client rftpipe's worker builds.
"$DIR/bin/python" -c "import openai, verifiers.v1"
check || { echo "tools/agents_env.sh: $DIR lacks verifiers==$VERIFIERS or openai 2" >&2; exit 1; }
echo "agents env ready: $DIR/bin/python"
