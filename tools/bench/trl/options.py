"""The TRL comparison's settings: its flags, the config overrides of rftpipe's runs, and
the names of its sides."""

from __future__ import annotations

import argparse
import sys

from tools.bench.harness import ROOT, parser

CONFIG = ROOT / "configs" / "grpo_smollm2_addition.yaml"

ENGINES = {"hf": ("hf",), "vllm": ("vllm",), "both": ("hf", "vllm")}
"""`--engine` and `--trl` choices: the rollout engines each side is measured with."""

SHARED = (
    "model",
    "steps",
    "floor_steps",
    "floor_naive",
    "prompts",
    "n",
    "tokens",
    "threads",
    "lr",
    "seed",
    "ckpt_every",
    "ckpt_interval",
    "micro_batch",
)
"""Flags a child measurement (TRL, floor) is given as its parent was."""

SETTINGS = (*SHARED, "engine", "trl", "trl_pairs", "pairs")
"""The flags bench.json records (`summary.settings`)."""

SIDE_ORDER = ("rftpipe", "rftpipe-vllm", "trl", "trl-vllm")
LABELS = {
    "rftpipe": "rftpipe + HF loop",
    "rftpipe-vllm": "rftpipe + vLLM",
    "trl": "TRL GRPOTrainer",
    "trl-vllm": "TRL + vLLM colocate",
}


def side_name(kind: str, engine: str) -> str:
    """Results key of a side: `rftpipe`, `trl`, `floor` for the HF loop (the keys of
    bench.json files from before `--engine`), `rftpipe-vllm` etc. for vLLM."""
    return kind if engine == "hf" else f"{kind}-{engine}"


def overrides(a: argparse.Namespace, steps: int, engine: str = "hf") -> list[str]:
    """rftpipe's config overrides for a run of `steps` steps on rollout engine `engine`, set
    as TRL's side is (the children read the same config for their prompts and reward)."""
    # --model swaps the policy on both sides (the smoke test runs `builtin:tiny`).
    model = [f"model.path={a.model}"] if a.model else []
    return [
        *model,
        f"total_steps={steps}",
        f"rollout.engine={engine}",
        f"data.prompts_per_step={a.prompts}",
        f"rollout.n={a.n}",
        # All groups of a step in one generate call, as TRL batches its step.
        f"rollout.groups_per_call={a.prompts}",
        f"rollout.max_new_tokens={a.tokens}",
        f"rollout.min_new_tokens={a.tokens}",
        "rollout.temperature=1.0",
        "kl.mode=none",
        # Fixed-length responses end on the length limit; let them still earn accuracy.
        "reward.require_stop=false",
        f"train.lr={a.lr}",
        # Constant, as TRL's side is configured, and because the restart measurement
        # resumes the run with one step more (a decaying schedule refuses that).
        "train.lr_schedule=constant",
        "train.ppo_epochs=1",
        "train.mini_batches=1",
        # 0: the whole step in one micro-batch, as TRL's batch; its logits and activations
        # then set the train stage's peak (18.5-20.9 GiB at 8 x 8 x 64, docs/benchmarks.md).
        f"train.micro_batch_size={a.micro_batch or a.prompts * a.n}",
        "eval.size=0",
        "logging.wandb=off",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"launch.threads={a.threads}",
        # Measured runs checkpoint on a fixed short interval so two checkpoints fall inside
        # them; the cost is then amortised over the interval the default config would use.
        # --ckpt-every 0: none but the last step's, after the last measured step.
        "checkpoint.policy=fixed",
        f"checkpoint.interval={a.ckpt_every or steps + 1}",
    ]


def settings(a: argparse.Namespace) -> dict[str, object]:
    return {k: getattr(a, k, None) for k in SETTINGS}


def parse(argv: list[str] | None, doc: str | None = None) -> argparse.Namespace:
    """The flags of `argv` (default: this process's); `doc` is `--help`'s description."""
    p = parser("trl", doc)
    _measurement_flags(p)
    _comparison_flags(p)
    p.add_argument("--child", choices=("trl", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--child-engine", choices=("hf", "vllm"), default="hf", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(sys.argv[1:] if argv is None else argv)


def _measurement_flags(p: argparse.ArgumentParser) -> None:
    """What each side runs: model, batch shape, threads, steps, optimizer and seed."""
    p.add_argument("--steps", type=int, default=11, help="steps per run (the first is excluded)")
    p.add_argument(
        "--floor-steps", type=int, default=4, help="steps of the bare floor run (0: no floor)"
    )
    p.add_argument(
        "--floor-naive",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: the HF floor also times the naive full-sequence forward/backward",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model.path of both sides (default: the config's SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per completion (fixed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)


def _comparison_flags(p: argparse.ArgumentParser) -> None:
    """Which sides run how often, how rftpipe checkpoints, and where the results go."""
    p.add_argument("--pairs", type=int, default=5, help="alternating rftpipe/TRL/floor rounds")
    p.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="hf",
        help="rftpipe's rollout engine(s): rollout.engine=hf, =vllm, or both alternately",
    )
    p.add_argument(
        "--trl",
        choices=(*ENGINES, "none"),
        default="hf",
        help="TRL's generation: model.generate (hf), vLLM colocate (vllm), both, or no TRL",
    )
    p.add_argument(
        "--trl-pairs",
        type=int,
        default=None,
        help="TRL runs in the first this many pairs only (default: every pair); its ratios "
        "are then taken over those pairs",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=5,
        help="checkpoint interval of the measured runs (0: none inside them, no restart "
        "measured, no durability report)",
    )
    p.add_argument(
        "--ckpt-interval",
        type=int,
        default=None,
        help="interval the measured checkpoint cost is amortised over (default: config's)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="rftpipe's rows per forward/backward (0: the whole step, as TRL trains it)",
    )
    p.add_argument("--out", default="bench-out", help="where bench.json goes")
    p.add_argument(
        "--summarize",
        metavar="BENCH_JSON",
        help="recompute the summary of an earlier run's bench.json (in place) and report it",
    )


# ------------------------------------------------------------ the default config's checkpoints


def config_interval(
    a: argparse.Namespace, ckpt_cost_s: float, step_s: float, train_s: float
) -> int:
    """The checkpoint interval the default config runs with on this machine: its fixed
    `checkpoint.interval`, or, with `checkpoint.policy=young_daly`, what the policy picks for
    these measured figures (`--ckpt-interval` overrides both)."""
    from rftpipe.checkpoint.policy import HOUR_S, young_daly_interval
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig

    if a.ckpt_interval:
        return a.ckpt_interval
    c = load_config(RunConfig, CONFIG).checkpoint
    if c.policy == "fixed":
        return c.interval
    return young_daly_interval(
        ckpt_cost_s,
        step_s,
        c.mtbf_hours * HOUR_S,
        replay_step_s=train_s,
        min_interval=c.min_interval,
        max_interval=c.max_interval,
    )


def checkpoint_policy(a: argparse.Namespace) -> str:
    """How the interval the report amortises over was chosen, in words."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig

    c = load_config(RunConfig, CONFIG).checkpoint
    if a.ckpt_interval:
        return f"fixed {a.ckpt_interval} (--ckpt-interval)"
    return c.policy if c.policy == "fixed" else f"young_daly (MTBF prior {c.mtbf_hours} h)"
