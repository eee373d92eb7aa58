"""Each stage's host memory over the post-load baseline, as the run itself records it.

The executor resets the process's high-water mark before every stage and records the
stage's peak over the resident set after loading (`rftpipe.observe.memory`). On a model
where the logits matter (hidden size 64, SmolLM2's 49,152-token vocabulary: a 16-row
micro-batch's response logits are 100 MB a copy, the whole model 13 MB), the train stage's
increment must be set by the micro-batch, not by the step's batch, and stay put over the
run; the rollout's by its generation call (`rollout.groups_per_call` groups). The canary
(the micro-batch set to the whole step) shows that the measurement sees the logits.

Each run is a fresh process (its own resident set); the three run side by side. The
last tests check the run's peak (`perf/run_mem_peak_gib`), which the stage resets must not
lose and which counts the rank's child processes.

The fixed-micro-batch runs use the defaults: chunked logprobs (`train.logprob_chunk_size`)
and the retained heap (`launch.retain_host_memory`, blocks under 16 MiB). Measured on
2026-11-25: train +0.375 / +0.387 GiB at 2 / 4 prompts, +0.404 to +0.448 at steps 2-3;
the canary +1.05. Before (full logits, every block retained): +0.437 / +0.766 GiB at
step 1, growing to +0.719 / +0.908 by step 3 (the logits blocks fragmented a heap that
never unmapped them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TESTS_ON_PATH, TINY, events, submit

from rftpipe.observe import memory

VOCAB = 49152
"""SmolLM2's vocabulary size."""
N = 8
TOKENS = 32
MICRO_BATCH = 16
"""Rows per micro-batch: the whole step at 2 prompts x 8 samples."""


def build_wide_vocab_model(dest: Path, vocab_size: int = VOCAB) -> Path:
    """builtin:tiny's shape (2 layers, hidden 64) with a `vocab_size`-token tokenizer: the
    256 bytes, the 3 specials, then byte pairs that encoding never produces (no merges) but
    that decode, so any token the random model samples is text."""
    import torch
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from rftpipe.engines import models

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<|im_start|>", "<|im_end|>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    pairs = (a + b for a in alphabet for b in alphabet)
    while len(vocab) < vocab_size:
        vocab[next(pairs)] = len(vocab)
    tk = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
    )
    tok.chat_template = models.CHAT_TEMPLATE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(models._tiny_llama_config(tok))
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def _command(run: Path, model: Path, prompts: int, micro_batch: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.submit",
        "--cluster",
        "local",
        "--run-dir",
        str(run),
        "--config",
        str(TINY),
        f"model.path={model}",
        "total_steps=3",
        f"data.prompts_per_step={prompts}",
        f"rollout.n={N}",
        "rollout.groups_per_call=1",
        f"rollout.max_new_tokens={TOKENS}",
        f"rollout.min_new_tokens={TOKENS}",
        "train.mini_batches=1",
        f"train.micro_batch_size={micro_batch}",
        "checkpoint.interval=4",  # only the last step's
        *extra,
    ]


def _increments(run: Path) -> dict[tuple[int, str], float]:
    """(step, stage) -> the stage's peak over the post-load baseline, GiB."""
    return {
        (e["step"], e["stage"]): e[f"perf/{e['stage']}_mem_increment_gib"]
        for e in events(run)
        if e["event"] == "stage_memory"
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Setting -> its finished run directory."""
    root = tmp_path_factory.mktemp("stage_memory")
    model = build_wide_vocab_model(root / "model")
    settings = {
        # The defaults: chunked logprobs, the retained heap.
        "2 prompts": (2, MICRO_BATCH),
        "4 prompts": (4, MICRO_BATCH),
        # The canary: the whole step as one micro-batch, its full logits materialised.
        "4 prompts, one micro-batch": (4, 4 * N, "train.logprob_chunk_size=0"),
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {
        name: subprocess.Popen(
            _command(root / f"run{i}", model, *s),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, (name, s) in enumerate(settings.items())
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    return {name: root / f"run{i}" for i, name in enumerate(settings)}


@pytest.fixture(scope="module")
def increments(runs: dict[str, Path]) -> dict[str, dict[tuple[int, str], float]]:
    return {name: _increments(run) for name, run in runs.items()}


def _close(a: float, b: float, rel: float = 0.20) -> bool:
    # Two runs of one setting differ by up to 8 % at a step (idle, 2026-11-29: step 2's
    # train +0.361 to +0.391 GiB over three runs), so two settings that should agree were
    # 11.3 % and 12.8 % apart at times, against the 10 % this bound was first: the test
    # failed about one run in four with nothing wrong. The canary, which must fail it, is
    # 63-66 % apart (+0.35 against +0.96 to +1.04).
    return abs(a - b) <= rel * max(a, b)


@pytest.mark.slow
def test_train_increment_is_set_by_the_micro_batch(increments: dict[str, dict]) -> None:
    small, large = increments["2 prompts"], increments["4 prompts"]
    canary = increments["4 prompts, one micro-batch"]
    for step in (1, 2, 3):
        a, b, c = small[step, "train"], large[step, "train"], canary[step, "train"]
        # The logits of a 16-row micro-batch alone are 0.1 GiB a copy: the stage is seen.
        assert a > 0.3, a
        assert _close(a, b), f"step {step}: twice the prompts, train +{a:.3f} -> +{b:.3f} GiB"
        # The same doubling with the micro-batch as the whole step fails the same bound.
        assert not _close(a, c), f"step {step}: canary +{a:.3f} -> +{c:.3f} GiB"
        assert c > a, (a, c)


@pytest.mark.slow
def test_no_stage_grows_over_the_run(increments: dict[str, dict]) -> None:
    for name in ("2 prompts", "4 prompts"):  # a fixed micro-batch
        inc = increments[name]
        # From step 2 on: step 1's train stage creates AdamW's state (2 x 13 MB) at its end.
        second = max(v for (s, _), v in inc.items() if s == 2)
        for (step, stage), v in inc.items():
            if step >= 2:
                assert v <= second * 1.10, f"{name}: step {step} {stage} +{v:.3f} GiB"


@pytest.mark.slow
def test_rollout_increment_is_set_by_the_generation_call(increments: dict[str, dict]) -> None:
    a = increments["2 prompts"][1, "rollout"]
    b = increments["4 prompts"][1, "rollout"]
    # Step 1's rollout runs before any train stage: its own increment, one group (8 rows)
    # per call, a few MiB of KV cache here, below the first-use allocations of the
    # libraries (~0.1 GiB, which vary by tens of MiB between processes). Twice the prompts
    # are twice the calls, not a larger one.
    assert a < 0.2 and b < 0.2 and abs(a - b) < 0.1, (a, b)


@pytest.mark.slow
def test_memory_reaches_the_metrics(runs: dict[str, Path]) -> None:
    line = json.loads((runs["2 prompts"] / "metrics.jsonl").read_text().splitlines()[-1])
    for stage in ("rollout", "train", "sync"):
        assert line[f"perf/{stage}_mem_peak_gib"] >= line[f"perf/{stage}_mem_increment_gib"] > 0


def test_peak_resets_to_the_current_resident_set() -> None:
    import mmap

    memory.reset_peak()
    before = memory.peak_gib()
    # 64 MiB mapped afresh and touched: not from the allocator, whose heap may already
    # hold that much freed by an earlier test in this process (retained blocks).
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\1" * len(block))
    grown = memory.peak_gib()
    block.close()
    memory.reset_peak()
    after = memory.peak_gib()
    assert before is not None and grown is not None and after is not None
    assert grown - before > 0.055, (before, grown)
    # The high-water mark restarts at what is resident now, whatever the allocator kept.
    rss = memory.rss_gib()
    assert rss is not None and abs(after - rss) < 0.01, (after, rss)


RUN_PEAK_SNIPPET = """
import json, resource
from rftpipe.observe import memory
memory.reset_peak()
before = memory.rss_gib()
block = b"\\x01" * (256 * 2**20)  # 256 MiB, written: resident until freed (unmapped)
del block
memory.reset_peak()  # the next stage's reset
print(json.dumps({
    "before": before,
    "stage_peak": memory.peak_gib(),
    "run_peak": memory.run_peak_gib(),
    "ru_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
"""


def test_run_peak_keeps_what_a_stage_reset_clears() -> None:
    """256 MiB allocated and freed inside one stage: the next stage's reset clears the
    process's high-water mark (and with it the kernel's ru_maxrss, on the kernels measured),
    but the run's peak keeps it. A fresh process, so no earlier peak can stand in for it."""
    out = subprocess.run(
        [sys.executable, "-c", RUN_PEAK_SNIPPET],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["run_peak"] - got["before"] >= 0.24, got
    # The stage figure after the reset no longer has it: the reason for a run figure.
    assert got["stage_peak"] - got["before"] < 0.05, got


@pytest.mark.slow
def test_run_peak_sees_a_child_allocation_inside_one_stage(tmp_path: Path) -> None:
    """A reward function in its worker process (a child of the rank process) allocates
    256 MiB in step 2's score stage, holds it 1 s and frees it. The rank process's own
    stage peaks cannot see it; `perf/run_mem_peak_gib`, the process tree's peak so far,
    rises by it in step 2 and keeps it."""
    run = tmp_path / "run"
    out = submit(
        run,
        "total_steps=3",
        "reward.workers=1",
        "reward.functions=[dense_even_tokens, {path: reward_fns:hold_256mib_once}]",
        "checkpoint.interval=10",
        env=TESTS_ON_PATH,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    peak = [m["perf/run_mem_peak_gib"] for m in lines]
    assert peak[1] - peak[0] >= 0.2, peak
    assert peak[2] >= peak[1], peak  # the peak so far
    score = [m["perf/score_mem_peak_gib"] for m in lines]
    assert score[1] - score[0] < 0.1, score  # not the rank process's own memory
    (done,) = [e for e in events(run) if e["event"] == "run_memory"]
    assert done["perf/run_mem_peak_gib"] >= peak[2] and done["samples"] > 0, done
