"""One rank of the sequence-parallel tests: FSDP2 at `train.sp_size` on builtin:tiny.

    python tests/sp_worker.py OUT_DIR [tokens=N] VARIANT ...

Each VARIANT is comma-separated TrainConfig fields (`sp_size=4,gradient_checkpointing=true`),
an FSDP2 engine of its own, whose results go to OUT_DIR/vI (I its position). For each,
each world rank takes its share of the fixed rows of tests/backend_worker.py and rank 0
writes, in the global row order: the no-grad `compute_logprobs` of every row
(logprobs.json); the full gradients of a token-mean loss of logprobs and entropies over
all rows, each rank holding its SP group's rows as the train stage does (grads.safetensors);
then the metrics (metrics.json) and full weights (weights.safetensors) after one train
stage step.

With tokens=N, every rank then runs (first variant only) one forward+backward of a single row of N tokens (a
16-token prompt, the rest response) and writes memory-RANK.json: its peak resident memory
above the resident memory just before (the high-water mark reset through
/proc/self/clear_refs) and the seconds it took. It sets glibc's mmap threshold to 64 KiB
first (what MALLOC_MMAP_THRESHOLD_=65536 sets in a new process, here also in one forked
from the test suite's warm interpreter), so that large blocks go back to the system when
freed and the resident set follows what is live rather than glibc's heap.
"""

from __future__ import annotations

import ctypes
import json
import random
import sys
import time
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as tdist
from backend_worker import GROUPS, SAMPLES, _value, fixed_rows, full_weights
from helpers import exit_rank
from safetensors.torch import save_file

from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.ulysses import data_view
from rftpipe.stages import batching, train


def _gather(dist: Dist, obj: object) -> list:
    out: list = [None] * dist.world
    tdist.all_gather_object(out, obj)
    return out


def _full_grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[name] = full.detach().float().clone().contiguous()
    return out


def equal(out: Path, cfg: TrainConfig, dist: Dist, engine: TrainEngine) -> None:
    table = fixed_rows()
    mine = set(rank_slice(list(range(GROUPS)), dist.rank, dist.world))
    local = table.filter(pa.array([p in mine for p in table.column("prompt_id").to_pylist()]))
    rows = local.to_pylist()
    keys = [(r["prompt_id"], r["sample_idx"]) for r in rows]
    # Different rows on the ranks of one SP group: the advantage stage's case.
    lp = engine.compute_logprobs(
        [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows], 0.9
    )
    logprobs = dict(kv for part in _gather(dist, list(zip(keys, lp, strict=True))) for kv in part)

    # The train stage's case: every rank of an SP group holds the group's rows.
    view, group_table = data_view(dist, cfg.sp_size, local)
    group = group_table.to_pylist()
    adv, mask = batching.pad_ragged([r["advantages"] for r in group], torch.float32)
    tokens = view.all_reduce_sum(mask.sum().double().reshape(1))
    with engine.train_mode():
        lp_t, ent = engine.forward(
            [r["prompt_token_ids"] for r in group],
            [r["response_token_ids"] for r in group],
            0.9,
            with_entropy=True,
        )
        assert ent is not None
        loss = (torch.where(mask, lp_t * adv + 0.1 * ent, 0.0)).sum() / float(tokens[0])
        engine.backward(loss)
    grads = _full_grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)

    samples = [(p, k) for p in range(GROUPS) for k in range(SAMPLES)]
    inp = batching.TrainInputs(
        step=1, run_seed=0, table=group_table, global_samples=samples, kl_coef=0.0, temperature=1.0
    )
    metrics = train.run(cfg, KLConfig(), engine, view, inp)
    weights = full_weights(engine)
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        ordered = [logprobs[s] for s in samples]
        (out / "logprobs.json").write_text(json.dumps(ordered))
        (out / "metrics.json").write_text(
            json.dumps({k: v for k, v in metrics.items() if k.startswith("train/")})
        )
        save_file(grads, out / "grads.safetensors")
        save_file(weights, out / "weights.safetensors")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory(out: Path, tokens: int, dist: Dist, engine: TrainEngine) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(5, 200) for _ in range(16)]
    response = [rng.randrange(5, 200) for _ in range(tokens - 16)]
    tdist.barrier()
    # Reset the high-water mark to the current resident set (Linux: "5" clears VmHWM).
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    with engine.train_mode():
        lp, _ = engine.forward([prompt], [response], 1.0, with_entropy=False)
        engine.backward(-lp.sum() / len(response))
    seconds = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory-{dist.rank}.json").write_text(
        json.dumps({"peak_above_start_mib": (peak - before) / 1024, "seconds": seconds})
    )


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    tokens = int(args.pop(0).removeprefix("tokens=")) if args[0].startswith("tokens=") else 0
    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    for i, variant in enumerate(args):
        fields = {k: _value(v) for k, v in (a.split("=", 1) for a in variant.split(","))}
        cfg = TrainConfig(
            backend="fsdp2",
            lr=1e-3,
            mini_batches=2,
            micro_batch_size=2,
            entropy_coef=0.01,
            packing=False,  # sp_size=1 too: the padded rows SP slices are its reference
            **fields,  # type: ignore[arg-type]
        )
        model = load_causal_lm(prepare_tiny(), "float32")
        engine = TRAIN_ENGINES["fsdp2"](model, cfg, dist, total_updates=4)
        equal(out / f"v{i}", cfg, dist, engine)
        if tokens and i == 0:
            memory(out / f"v{i}", tokens, dist, engine)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    # M_MMAP_THRESHOLD (malloc.h): fixed, which also stops glibc from raising it on frees.
    ctypes.CDLL(None).mallopt(-3, 65536)
    main()
    exit_rank()
