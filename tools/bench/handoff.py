"""Weights from a trainer to a rollout rank: through a directory against a gloo broadcast.

    python -m tools.bench handoff [--model smollm2-135m | tiny] [--reps 5]
                                  [--dir DIR] [--out FILE.json]

Two processes on this machine, a trainer (rank 0) and a rollout rank (rank 1), each holding
the same architecture (a random-init Llama of SmolLM2-135M-Instruct's shape, float32 as the
trainer keeps its weights on CPU, or `tiny` for a test). Each repetition hands the
trainer's new weights to the rollout rank's model both ways, one after the other:

- `directory`: what `rftpipe.run.handoff` does today (`launch.rollout_ranks`): the trainer
  writes one safetensors file under a temporary name (`rftpipe.stages.sync.write_weights`)
  and renames it; the rollout rank then reads it and loads it into its model. Seconds from
  the trainer's first byte to the rollout rank's loaded model (write, then read: the reader
  waits for the rename).
- `broadcast`: `torch.distributed.broadcast` over gloo, from the trainer's tensors straight
  into the rollout model's parameters, one call per tensor in the state dict's order.

Both sides agree at a barrier before each timed hand-over. The figures are medians over
`--reps`; `equal` says whether the rollout model ended every repetition with the trainer's
weights bitwise.
On one machine the file is read back from the page cache; across nodes it goes through the
cluster's shared filesystem (`--dir` there measures that).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.bench import Benchmark
from tools.bench.harness import parser, write_json

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's configuration (the default task's model): 134.5M parameters.
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "tie_word_embeddings": True,
    },
}


def build(shape: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).eval()


def _directory(rank: int, model: torch.nn.Module, root: Path, rep: int) -> float:
    from rftpipe.engines.rollout.hf import load_weights_dir
    from rftpipe.stages.sync import write_weights

    target = root / f"v{rep}"
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        tmp = root / f".v{rep}.tmp"
        tmp.mkdir()
        write_weights(model, tmp)
        tmp.rename(target)
    # The reader starts once the rename is done, as a rollout rank polling for it would.
    dist.barrier()
    if rank == 1:
        load_weights_dir(model, target)  # the rollout ranks' own read (the HF loop's)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        shutil.rmtree(target)
    return seconds


def _broadcast(model: torch.nn.Module) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    dist.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, shape: str, reps: int, root: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    # One core each, as `launch.rollout_ranks=1` gives each role on this 2-core machine.
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"directory": [], "broadcast": []}
    equal = {"directory": True, "broadcast": True}  # every repetition's, not the last one's
    # The ways alternate here, not through `harness.alternate`: both ranks run each way in
    # lockstep inside one process group, and each repetition starts from new weights.
    for rep in range(reps):
        # Each repetition, the trainer's weights are new: the rollout rank's are stale.
        trainer = build(shape, seed=rep + 1)
        model = trainer if rank == 0 else build(shape, seed=0)
        times["directory"].append(_directory(rank, model, Path(root), rep))
        equal["directory"] &= _same(model, trainer)
        if rank == 1:
            model = build(shape, seed=0)
        times["broadcast"].append(_broadcast(model))
        equal["broadcast"] &= _same(model, trainer)
    if rank == 1:
        numel = sum(t.numel() for t in model.state_dict().values())
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        Path(out).write_text(
            json.dumps(
                {"numel": numel, "bytes": nbytes, "seconds": times, "equal": equal}, indent=1
            )
        )
    dist.destroy_process_group()


def _same(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    a, b = model.state_dict(), reference.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(shape: str, reps: int, root: Path) -> dict[str, Any]:
    """Both hand-overs `reps` times between two spawned processes; the figures."""
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        out = Path(tmp) / "result.json"
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_rank, args=(shape, reps, str(root), init, str(out)), nprocs=2, join=True)
        raw = json.loads(out.read_text())
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": shape,
        "parameters": raw["numel"],
        "megabytes": round(raw["bytes"] / 2**20, 1),
        "reps": reps,
    }
    for way, seconds in raw["seconds"].items():
        median = statistics.median(seconds)
        result[way] = {
            "seconds": [round(s, 3) for s in seconds],
            "median_s": round(median, 3),
            "mb_per_s": round(raw["bytes"] / 2**20 / median, 1),
            "equal": raw["equal"][way],
        }
    result["broadcast_vs_directory"] = round(
        result["directory"]["median_s"] / result["broadcast"]["median_s"], 2
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = parser("handoff", __doc__)
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where the directory way writes")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="handoff-", dir=a.dir) as root:
        result = run(a.model, a.reps, Path(root))
    for way in ("directory", "broadcast"):
        r = result[way]
        print(f"{way:10s} median {r['median_s']:.3f} s  {r['mb_per_s']:8.1f} MB/s  {r['seconds']}")
    print(
        f"{result['megabytes']} MB ({result['parameters']} parameters): the broadcast takes "
        f"1/{result['broadcast_vs_directory']} of the directory's time"
    )
    if a.out:
        write_json(a.out, result)
    return 0


BENCHMARK = Benchmark(
    name="handoff",
    runs="a trainer and a rollout rank (two gloo processes) handing the trainer's new "
    "weights over, through a safetensors file in a directory and by a gloo broadcast",
    measures="median seconds and MB/s of each way, the broadcast's share of the directory's "
    "time, and whether the rollout rank ends with the trainer's weights bitwise",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
