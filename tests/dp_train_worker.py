"""One rank of the train-stage-alone data-parallel test (run as N real processes).

    python tests/dp_train_worker.py ADVANTAGE_PARQUET OUT_DIR [nan_rank]

Trains the tiny model with FSDP2 on fixed committed rows; this rank takes its share of the
prompt groups. Rank 0 writes the metrics and full weights to OUT_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from helpers import exit_rank
from safetensors.torch import save_file

from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import init_from_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.fsdp2 import FSDP2Engine
from rftpipe.stages import batching, train


def main() -> None:
    table_path, out, nan_rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    table = pq.read_table(table_path)
    ids = sorted(set(table.column("prompt_id").to_pylist()))
    mine = set(rank_slice(ids, dist.rank, dist.world))
    local = table.filter(pa.array([p in mine for p in table.column("prompt_id").to_pylist()]))
    if dist.rank == nan_rank:
        adv = [[float("nan")] * len(a) for a in local.column("advantages").to_pylist()]
        local = local.set_column(
            local.schema.get_field_index("advantages"),
            "advantages",
            pa.array(adv, pa.list_(pa.float32())),
        )
    cfg = TrainConfig(lr=1e-3, mini_batches=2, micro_batch_size=2, ppo_epochs=2)
    engine = FSDP2Engine(load_causal_lm(prepare_tiny(), "float32"), cfg, dist, total_updates=4)
    samples = [(p, k) for p in ids for k in range(4)]
    metrics = []
    for step in (1, 2):
        inp = batching.TrainInputs(
            step=step, run_seed=0, table=local, global_samples=samples, kl_coef=0.0, temperature=1.0
        )
        metrics.append(train.run(cfg, KLConfig(), engine, dist, inp))
    weights = engine.rollout_weights()
    # Reference role: uneven row counts per rank (1 vs 3 micro-batches) must not deadlock.
    reference = FSDP2Engine(load_causal_lm(prepare_tiny(), "float32"), cfg, dist, role="reference")
    rows = table.slice(0, 2 + 3 * dist.rank).to_pylist()
    ref = reference.compute_logprobs(
        [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows], 0.7
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ref-r{dist.rank}.json").write_text(json.dumps(ref))
    if dist.rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics))
        save_file({k: v.clone() for k, v in weights.items()}, out / "weights.safetensors")


if __name__ == "__main__":
    main()
    exit_rank()
