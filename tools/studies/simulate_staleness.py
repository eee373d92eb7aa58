"""Step-time simulator of `rollout.staleness` k and the placements, calibrated on k = 0.

    python -m tools.studies.simulate_staleness --bench docs/bench_staleness_cpu_sim.json \
        [--out F.json]

Two parts:

1. **CPU check.** From a `tools.bench.staleness` record, only its synchronous runs are read
   for calibration: `k0` (every stage on both cores) and `k0-t1` (one core): their median
   stage seconds. The simulator then predicts the steady step of every other variant of
   the record (colocated overlap, separate rollout ranks, k = 1 and 2), which the record
   also measured, and prints both side by side.
2. **GPU scale.** The same schedules with stage times from a stated cost model of a 7B
   model on H100s (`GpuModel`): generation decodes in continuous batches on each rollout
   GPU until its longest response ends (a long tail of lengths), training costs FLOPs at
   a fixed MFU. It prints step times for k = 0, 1, 2, 4, colocated and with rollout:train
   GPU splits.

The schedules (`steady_step`):

- `sequential`: one set of ranks runs a step's stages one after another; with k >= 1 the
  advantage stage also recomputes the proximal logprobs (`recompute`);
- `overlap` (`rollout.overlap`): step s generates step s+k beside its advantage and train
  stages, and its sync waits for both (the driver's lock-step);
- `disaggregated` (`launch.rollout_ranks`): a free pipeline of two resources. Generation
  of step s starts when that of s-1 ended and the weights of train step s-1-k are handed
  over; training of step s starts when its generation and train step s-1 ended.

Assumptions (all of them): a stage's time is the same every step (its median); the two
roles of an overlap or a split machine do not slow each other beyond their share of it
(no memory-bandwidth contention); the proximal recomputation costs a third of a train
stage (a forward of the same rows, against a forward and a backward); a hand-over costs
`handoff_s`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step's stages on some share of the machine."""

    generation: float
    """Rollout and score."""
    advantage: float
    train: float
    sync: float

    @property
    def recompute(self) -> float:
        """The proximal logprobs' forward at k >= 1 (`train.old_logprobs=actor`)."""
        return self.train / 3

    def training(self, k: int) -> float:
        """Advantage and train stages (sync apart)."""
        return self.advantage + self.train + (self.recompute if k >= 1 else 0.0)


Schedule = Literal["sequential", "overlap", "disaggregated"]


def _sequential(k: int, gen: StepCost, train: StepCost, handoff_s: float) -> float:
    return gen.generation + train.training(k) + train.sync


def _overlap(k: int, gen: StepCost, train: StepCost, handoff_s: float) -> float:
    if k < 1:
        raise ValueError("overlap needs k >= 1")
    return max(gen.generation, train.training(k)) + train.sync


def _disaggregated(k: int, gen: StepCost, train: StepCost, handoff_s: float) -> float:
    return _steady(
        pipeline(k, gen.generation, train.training(k) + train.sync, handoff_s, 24 * (k + 1)), k
    )


SCHEDULES: dict[Schedule, Callable[[int, StepCost, StepCost, float], float]] = {
    "sequential": _sequential,
    "overlap": _overlap,
    "disaggregated": _disaggregated,
}
"""Each schedule's steady seconds per step from (k, generation's cost, training's cost,
the weights' hand-off seconds)."""


def steady_step(
    schedule: Schedule,
    k: int,
    gen: StepCost,
    train: StepCost | None = None,
    handoff_s: float = 0.0,
) -> float:
    """The steady seconds per step. `gen` is the cost on the generating share of the
    machine, `train` on the training share (default: the same share, `gen`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    return SCHEDULES[schedule](k, gen, train or gen, handoff_s)


def _steady(ends: list[float], k: int) -> float:
    """Seconds per step over the second half of `ends`, in whole periods (a pipeline with
    k steps of slack may repeat every k + 1 steps)."""
    span = (len(ends) // 2) // (k + 1) * (k + 1)
    return (ends[-1] - ends[-1 - span]) / span


def pipeline(
    k: int, generation: float, training: float, handoff_s: float, steps: int
) -> list[float]:
    """When each train step ends in the free pipeline of separate rollout ranks."""
    gen_end: list[float] = []
    train_end: list[float] = []
    for s in range(1, steps + 1):
        version = max(0, s - 1 - k)
        weights = train_end[version - 1] + handoff_s if version else 0.0
        start = max(gen_end[-1] if gen_end else 0.0, weights)
        gen_end.append(start + generation)
        train_end.append(max(train_end[-1] if train_end else 0.0, gen_end[-1]) + training)
    return train_end


# -- part 1: the CPU check ----------------------------------------------------------------

#: bench variant -> (schedule, k, share of each role: "both" or "one" core).
CPU_VARIANTS: dict[str, tuple[Schedule, int, str]] = {
    "k1": ("sequential", 1, "both"),
    "k2": ("sequential", 2, "both"),
    "k1-overlap": ("overlap", 1, "one"),
    "k2-overlap": ("overlap", 2, "one"),
    "k1-disagg": ("disaggregated", 1, "one"),
    "k2-disagg": ("disaggregated", 2, "one"),
}


def cost_of(result: dict) -> StepCost:
    """A bench variant's median stage seconds (steps 2..)."""
    s = result["stage_s"]
    return StepCost(s["rollout"] + s["score"], s["advantage"], s["train"], s["sync"])


def cpu_check(record: dict, handoff_s: float) -> list[dict]:
    results = record["results"]
    both, one = cost_of(results["k0"]), cost_of(results["k0-t1"])
    rows = []
    for name, (schedule, k, share) in CPU_VARIANTS.items():
        if name not in results:
            continue
        cost = both if share == "both" else one
        predicted = steady_step(schedule, k, cost, handoff_s=handoff_s)
        measured = results[name]["steady_step_s"]
        rows.append(
            {
                "variant": name,
                "predicted_step_s": round(predicted, 2),
                "measured_step_s": measured,
                "error": round(predicted / measured - 1, 3),
            }
        )
    return rows


# -- part 2: GPU scale ----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuModel:
    """A stated cost model: a dense 7B model on H100 SXM GPUs (bf16)."""

    params: float = 7.6e9
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one GPU."""
    hbm_bytes_s: float = 3.35e12
    train_mfu: float = 0.35
    decode_flops_efficiency: float = 0.5
    """Of peak, for the matmuls of a large decode batch."""
    kv_bytes_per_token: float = 28 * 2 * 4 * 128 * 2
    """Per token of context (28 layers, K and V, 4 KV heads of 128, bf16): Qwen2.5-7B."""
    prompts: int = 256
    samples: int = 8
    prompt_tokens: int = 512
    median_response: float = 1024
    sigma: float = 0.9
    """Log-normal spread of response lengths."""
    max_response: int = 8192
    sync_s: float = 3.0
    """Weights to the engines after each update (14 GB; NCCL broadcast or reload)."""

    def lengths(self) -> list[int]:
        """Response lengths of one step: log-normal quantiles, capped (the cap is the tail
        every step waits on)."""
        n = self.prompts * self.samples
        out = []
        for i in range(n):
            z = statistics.NormalDist().inv_cdf((i + 0.5) / n)
            out.append(
                min(self.max_response, round(self.median_response * math.exp(self.sigma * z)))
            )
        return out

    def generation_s(self, gpus: int) -> float:
        """Decoding the step's samples on `gpus` engines (TP 1, continuous batching, the
        samples dealt round-robin): each decode iteration reads the weights once, computes
        every active sequence's token and reads its KV cache; the slowest engine ends it."""
        lengths = sorted(self.lengths(), reverse=True)  # dealt longest first
        weights_s = 2 * self.params / self.hbm_bytes_s
        token_s = 2 * self.params / (self.peak_flops * self.decode_flops_efficiency)
        kv_s = self.kv_bytes_per_token / self.hbm_bytes_s
        worst = 0.0
        for g in range(gpus):
            mine = sorted(lengths[g::gpus])
            t = len(mine) * self.prompt_tokens * token_s  # prefill
            # Decode iterations in blocks between two sequences' ends: in (prev, end] the
            # sequences still active are those from this one on.
            prev = 0
            for i, end in enumerate(mine):
                active = len(mine) - i
                if end > prev:
                    ctx = active * (self.prompt_tokens + (prev + end) / 2)
                    t += (end - prev) * (weights_s + active * token_s + ctx * kv_s)
                    prev = end
            worst = max(worst, t)
        return worst

    def train_s(self, gpus: int) -> float:
        """Forward and backward of every token (6 x params FLOPs a token) and the forward
        of the old logprobs (2 x: a serving engine's own logprobs are not the trainer's, so
        they are recomputed at every k, as verl does), at `train_mfu`."""
        tokens = sum(self.lengths()) + self.prompts * self.samples * self.prompt_tokens
        return 8 * self.params * tokens / (gpus * self.peak_flops * self.train_mfu)


def gpu_table(model: GpuModel, gpus: int, ks: list[int], splits: list[int]) -> list[dict]:
    """Steady step seconds and samples/s per (placement, rollout GPUs, k)."""
    samples = model.prompts * model.samples
    rows = []
    # Colocated: every GPU generates, then every GPU trains, at any k (the engine shares
    # the devices with the trainer, so neither runs beside the other).
    base = model.generation_s(gpus) + model.train_s(gpus) + model.sync_s
    rows.append(_gpu_row("colocated", gpus, 0, 0, base, samples, base))
    for rollout_gpus in splits:
        gen = model.generation_s(rollout_gpus)
        for k in ks:
            training = model.train_s(gpus - rollout_gpus) + model.sync_s
            step = _steady(pipeline(k, gen, training, model.sync_s, 24 * (k + 1)), k)
            rows.append(
                _gpu_row("disaggregated", rollout_gpus, gpus - rollout_gpus, k, step, samples, base)
            )
    return rows


def _gpu_row(
    placement: str, rollout: int, train: int, k: int, step: float, samples: int, base: float
) -> dict:
    return {
        "placement": placement,
        "rollout_gpus": rollout,
        "train_gpus": train,
        "k": k,
        "step_s": round(step, 1),
        "samples_per_s": round(samples / step, 1),
        "vs_colocated_k0": round(base / step, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.studies.simulate_staleness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bench", type=Path, help="a tools.bench.staleness record with k0 and k0-t1")
    p.add_argument(
        "--handoff-s",
        type=float,
        default=0.5,
        help="seconds to hand a version of the weights to the rollout ranks (CPU)",
    )
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--splits", type=int, nargs="+", default=[16, 24, 32])
    p.add_argument(
        "--max-response",
        type=int,
        nargs="+",
        default=[8192, 2048],
        help="one GPU table per cap on the response length",
    )
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    out: dict = {"assumptions": __doc__.split("Assumptions")[1].strip()}
    if a.bench is not None:
        rows = cpu_check(json.loads(a.bench.read_text()), a.handoff_s)
        out["cpu_check"] = {"bench": str(a.bench), "handoff_s": a.handoff_s, "rows": rows}
        for r in rows:
            print(
                f"{r['variant']:12s} predicted {r['predicted_step_s']:6.2f} s  measured "
                f"{r['measured_step_s']:6.2f} s  error {r['error']:+.1%}"
            )
    out["gpu"] = []
    for cap in a.max_response:
        model = GpuModel(max_response=cap)
        rows = gpu_table(model, a.gpus, [0, 1, 2, 4], a.splits)
        gen = {g: round(model.generation_s(g), 1) for g in (a.gpus, *a.splits)}
        train = {g: round(model.train_s(g), 1) for g in (a.gpus, *(a.gpus - x for x in a.splits))}
        out["gpu"].append(
            {
                "model": dataclasses.asdict(model),
                "gpus": a.gpus,
                "generation_s": gen,
                "train_s": train,
                "rows": rows,
            }
        )
        print(f"max_response {cap}: generation s by GPUs {gen}; train s by GPUs {train}")
        for r in rows:
            print(
                f"{r['placement']:13s} rollout {r['rollout_gpus']:3d} train "
                f"{r['train_gpus']:3d} k={r['k']}  step {r['step_s']:7.1f} s  "
                f"{r['samples_per_s']:6.1f} samples/s  {r['vs_colocated_k0']:.2f}x"
            )
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
