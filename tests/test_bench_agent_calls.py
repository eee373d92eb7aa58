"""tools.bench agent_calls: agent episodes with kept KV caches against whole prefills, on
the tiny model (real agent processes against the endpoint)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_both_sides_run_the_same_calls_and_sample_alike() -> None:
    args = ["--episodes", "2", "--n", "1", "--calls", "3", "--max-new", "4"]
    args += ["--msg-tokens", "12", "--runs", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench", "agent_calls", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # 3 calls of 4 sampled tokens and the message's 12 tokens (and the template's) between.
    assert r["response_tokens"] > 3 * 4 + 2 * 12
    assert r["tokens_equal"] is True and r["logprob_abs_diff_max"] < 1e-5
    for side in ("kept", "reprefill"):
        assert len(r[side]["call_s"]) == 3 and r[side]["stage_s"] > 0
