"""The real pipeline on GPUs: `python -m jobs.submit --cluster local` with every backend.

Runs on a machine with CUDA only (skipped elsewhere); on the GPU machine, after
tools/cluster/device_setup.sh: ``PYTHONPATH=$PWD/.device_site:$PWD python3 -m pytest -q -m gpu
tests/test_gpu.py``. Prompts come from a file (the GPU image has no reasoning-gym) and the
reward is the tiny config's dense synthetic one.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, events, final_weights, submit, trajectories
from safetensors.torch import load_file

from rftpipe.checkpoint import writer
from rftpipe.config.schema import RolloutConfig
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.stages import ORDER

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device"),
]

_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not importable"
)
_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")

STEPS = 4


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(5) for b in (1, 2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("overrides", "ranks"),
    [
        pytest.param(("train.backend=single",), 1, id="single"),
        pytest.param(("train.backend=fsdp2",), 1, id="fsdp2"),
        pytest.param(("train.backend=fsdp2",), 2, id="fsdp2-2ranks", marks=_two_gpus),
        pytest.param(
            ("train.backend=deepspeed", "train.zero_stage=2"), 1, id="zero2", marks=_deepspeed
        ),
        pytest.param(
            ("train.backend=deepspeed", "train.zero_stage=3"), 1, id="zero3", marks=_deepspeed
        ),
        pytest.param(
            ("train.backend=deepspeed", "train.zero_stage=3"),
            2,
            id="zero3-2ranks",
            marks=[_deepspeed, _two_gpus],
        ),
    ],
)
def test_pipeline_on_gpu(
    overrides: tuple[str, ...], ranks: int, prompts: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    out = submit(
        run,
        *overrides,
        f"total_steps={STEPS}",
        "data.source=file",
        f"data.file.path={prompts}",
        "train.param_dtype=bfloat16",
        # A KL term puts the reference model on the device too.
        "kl.mode=loss",
        "kl.coef=0.01",
        "logging.tensorboard=false",
        config=TINY,
        extra=("--tasks-per-node", str(ranks)),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    commits = {(e["step"], e["stage"]) for e in events(run) if e["event"] == "commit"}
    assert commits >= {(s, st) for s in range(1, STEPS + 1) for st in ORDER}
    assert writer.list_committed(run / "checkpoints")[-1].step == STEPS
    # Every step had a learning signal (rewards differing within groups) and the weights
    # moved (weight decay is off, so only by gradients).
    t = trajectories(run).to_pandas()
    assert sorted(t["step"].unique()) == list(range(1, STEPS + 1))
    for step, rows in t.groupby("step"):
        assert max(abs(a) for adv in rows["advantages"] for a in adv) > 0.1, step
    w0, w = load_file(prepare_tiny() / "model.safetensors"), final_weights(run)
    moved = sum(float((w[k].float() - w0[k]).norm()) for k in w0) / sum(
        float(w0[k].norm()) for k in w0
    )
    assert moved > 1e-3, moved
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        assert m["perf/train_tokens_per_s"] > 0 and m["perf/train_tflops"] > 0, m
        assert 0 < m["perf/mfu"] < 1, m  # the GPU's peak was found in rftpipe.observe.perf's table


@pytest.mark.tier1
def test_greedy_eval_runs_on_the_models_device() -> None:
    """Held-out evaluation decodes greedily on the rollout model's device (the pipeline
    test cannot reach it: it needs reasoning-gym prompts)."""
    path = prepare_tiny()
    tok = load_tokenizer(path)
    prompts = [[5, 6, 7, 8], [9, 10]]
    engines = {
        dev: HFGenerateEngine(
            load_causal_lm(path, "float32").to(dev),
            RolloutConfig(),
            tok.eos_token_id,
            tok.pad_token_id,
        )
        for dev in ("cpu", "cuda")
    }
    cpu, gpu = (engines[d].greedy(prompts, max_new_tokens=6) for d in ("cpu", "cuda"))
    assert [len(x) for x in gpu] == [len(x) for x in cpu]
    assert [x[:1] for x in gpu] == [x[:1] for x in cpu]


@pytest.mark.parametrize(
    "estimator",
    [
        pytest.param(("advantage.estimator=grpo",), id="grpo"),
        pytest.param(("advantage.estimator=gae", "critic.lr=1e-4"), id="gae-critic"),
    ],
)
def test_multi_turn_episodes_on_gpu(
    estimator: tuple[str, ...], prompts: Path, tmp_path: Path
) -> None:
    """Multi-turn episodes with the HF loop on the device: 2-turn episodes of the tests'
    dense synthetic environment, trained in bf16 on the model's tokens only."""
    run = tmp_path / "run"
    out = submit(
        run,
        *estimator,
        "data.source=file",
        f"data.file.path={prompts}",
        "rollout.env.path=envs_toy:EvenChars",
        "rollout.env.max_turns=2",
        "rollout.env.max_total_tokens=96",
        "reward.functions=[]",
        "total_steps=3",
        "train.param_dtype=bfloat16",
        "logging.tensorboard=false",
        env={"PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    t = trajectories(run).to_pandas()
    assert (t["num_turns"] == 2).any()
    for _, r in t.iterrows():
        assert all(a == 0.0 for a, m in zip(r["advantages"], r["loss_mask"], strict=True) if not m)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["episode/turns_mean"] >= 1 and 0 < m["perf/mfu"] < 1, m
