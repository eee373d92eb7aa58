"""One rank of the FSDP2 memory-feature test (run as N real processes).

    python tests/fsdp_memory_worker.py ADVANTAGE_PARQUET OUT_DIR VARIANT [VARIANT ...]

For each variant (a key of `VARIANTS`: TrainConfig overrides), trains a fresh tiny model
with FSDP2 for one step on fixed committed rows, this rank taking its share of the prompt
groups, then scores this rank's rows with the trained engine. Writes per variant
VARIANT-info-rRANK.json (the offload policy each FSDP unit runs with, the forward counts of
the decoder and of the first layer's MLP, the logprobs, and on a GPU the device memory held
after the step and at its peak) and, on rank 0, VARIANT-metrics.json
and VARIANT-weights.safetensors (full weights).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from helpers import count_calls, exit_rank
from safetensors.torch import save_file

from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.fsdp2 import FSDP2Engine
from rftpipe.stages import batching, train

BASE = TrainConfig(backend="fsdp2", lr=1e-3, mini_batches=2, micro_batch_size=2, entropy_coef=0.01)
VARIANTS: dict[str, dict] = {
    "base": {},
    "offload": {"cpu_offload": "all"},
    "checkpointing": {"gradient_checkpointing": True},
    # About two rows a micro-batch, but by tokens: ranks whose rows differ in length run
    # different numbers of micro-batches, so the padding path runs too.
    "token_budget": {"max_tokens_per_micro_batch": 24},
}


def _policies(model: torch.nn.Module) -> list[dict]:
    """The offload policy and parameter placement of every FSDP unit (FSDP2's own state)."""
    out = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state else None
        if group is None:
            continue
        out.append(
            {
                "policy": type(group.offload_policy).__name__,
                "pin_memory": getattr(group.offload_policy, "pin_memory", None),
                "offload_to_cpu": [p.offload_to_cpu for p in group.fsdp_params],
                "shard_devices": sorted(
                    {p.sharded_param.to_local().device.type for p in group.fsdp_params}
                ),
            }
        )
    return out


def run_variant(name: str, dist: Dist, local: pa.Table, samples: list, out: Path) -> None:
    """Train and score one variant; everything it placed on a device is freed on return."""
    cfg = dataclasses.replace(BASE, **VARIANTS[name])
    model = load_causal_lm(prepare_tiny(), "float32")
    if torch.cuda.is_available():  # the GPU test: compute on this rank's device
        model.to(f"cuda:{dist.local_rank}")
        torch.cuda.reset_peak_memory_stats()
    engine = FSDP2Engine(model, cfg, dist, total_updates=1)
    decoder_calls = count_calls(engine.model.get_decoder())
    mlp_calls = count_calls(engine.model.get_decoder().layers[0].mlp)
    inp = batching.TrainInputs(
        step=1, run_seed=0, table=local, global_samples=samples, kl_coef=0.0, temperature=1.0
    )
    metrics = train.run(cfg, KLConfig(), engine, dist, inp)
    calls = {"decoder": decoder_calls[0], "mlp": mlp_calls[0]}
    cuda = torch.cuda.is_available()
    # Device bytes held after the step (weights, gradients, AdamW state) and at its peak.
    memory = {
        "cuda_resident": torch.cuda.memory_allocated() if cuda else 0,
        "cuda_peak": torch.cuda.max_memory_allocated() if cuda else 0,
    }
    rows = local.to_pylist()
    logprobs = engine.compute_logprobs(
        [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows], 1.0
    )
    info = {
        "train_calls": calls,
        "policies": _policies(engine.model),
        "logprobs": logprobs,
        **memory,
    }
    (out / f"{name}-info-r{dist.rank}.json").write_text(json.dumps(info))
    weights = engine.rollout_weights()
    if dist.rank == 0:
        (out / f"{name}-metrics.json").write_text(json.dumps(metrics))
        tensors = {k: v.detach().cpu().clone() for k, v in weights.items()}
        save_file(tensors, out / f"{name}-weights.safetensors")


def main() -> None:
    table_path, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    table = pq.read_table(table_path)
    ids = sorted(set(table.column("prompt_id").to_pylist()))
    mine = set(rank_slice(ids, dist.rank, dist.world))
    local = table.filter(pa.array([p in mine for p in table.column("prompt_id").to_pylist()]))
    prompt_ids = table.column("prompt_id").to_pylist()
    samples = list(zip(prompt_ids, table.column("sample_idx").to_pylist(), strict=True))
    out.mkdir(parents=True, exist_ok=True)
    for name in variants:
        run_variant(name, dist, local, samples, out)
        gc.collect()


if __name__ == "__main__":
    main()
    exit_rank()
