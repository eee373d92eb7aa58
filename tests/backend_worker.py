"""One rank of the backend-equivalence test: the train stage alone on fixed rows.

    python tests/backend_worker.py OUT_DIR key=value ...   (TrainConfig fields; `lora=R`
                                                            puts rank-R adapters on the model)

Trains the tiny model for two steps on a fixed, seeded advantage table (4 prompt groups of
4 samples; this rank takes its share of the groups), then checks the checkpoint state
round trip: a fresh engine that loads `state_dict()` (model first, optimizer later, as a
restart does) holds the same weights and takes a third step bitwise like the original.
Rank 0 writes metrics.json, weights.safetensors and roundtrip.json to OUT_DIR.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import torch
from helpers import exit_rank
from safetensors.torch import save_file

from rftpipe.config.schema import KLConfig, LoraConfig, TrainConfig
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import init_from_env
from rftpipe.engines.lora import apply_lora
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import TrainEngine
from rftpipe.stages import batching, train

GROUPS, SAMPLES = 4, 4


def fixed_rows() -> pa.Table:
    rng = random.Random(0)
    rows = []
    for p in range(GROUPS):
        prompt = [rng.randrange(5, 200) for _ in range(6 + p)]
        for k in range(SAMPLES):
            n = rng.randrange(2, 9)
            rows.append(
                {
                    "prompt_id": p,
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "response_token_ids": [rng.randrange(5, 200) for _ in range(n)],
                    "logprobs": [-3.0 - 0.1 * i for i in range(n)],
                    "advantages": [rng.uniform(-1, 1)] * n,
                    "ref_logprobs": [-3.0] * n,
                    "response_length": n,
                }
            )
    return pa.Table.from_pylist(rows)


def _value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def full_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    w = engine.rollout_weights()
    w = w.state_dict() if isinstance(w, torch.nn.Module) else w
    return {k: v.detach().float().clone().contiguous() for k, v in w.items()}


def _train_metrics(m: dict[str, float]) -> dict[str, float]:
    """The update's metrics (perf/* are timings)."""
    return {k: v for k, v in m.items() if k.startswith("train/")}


def _detached(state: object) -> object:
    """A deep copy of a state dict's tensors (the live ones change with the next step)."""
    if isinstance(state, dict):
        return {k: _detached(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_detached(v) for v in state]
    return state.detach().clone() if isinstance(state, torch.Tensor) else state


def _copy_into(target: dict, source: dict) -> None:
    for k, v in source.items():
        if isinstance(v, dict):
            _copy_into(target[k], v)
        elif isinstance(v, torch.Tensor):
            target[k].copy_(v)
        else:
            target[k] = v


def saved_activations(engine: TrainEngine, table: pa.Table) -> int:
    """Elements the autograd graph keeps for the backward of one training forward of the
    same 4 rows on every rank (gradient checkpointing keeps only each layer's input)."""
    rows = table.slice(0, 4).to_pylist()
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += t.numel()
        return t

    with engine.train_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward(
            [r["prompt_token_ids"] for r in rows],
            [r["response_token_ids"] for r in rows],
            1.0,
            with_entropy=False,
        )
    return count[0]


def main() -> None:
    out = Path(sys.argv[1])
    fields = {k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])}
    rank = fields.pop("lora", None)
    lora = None if rank is None else LoraConfig(r=int(str(rank)), alpha=8)
    torch.set_num_threads(1)
    cfg = TrainConfig(lr=1e-3, mini_batches=2, micro_batch_size=2, ppo_epochs=2, **fields)
    dist = init_from_env(require_group=cfg.backend != "single")
    table = fixed_rows()
    ids = list(range(GROUPS))
    mine = set(rank_slice(ids, dist.rank, dist.world))
    local = table.filter(pa.array([p in mine for p in table.column("prompt_id").to_pylist()]))
    samples = [(p, k) for p in ids for k in range(SAMPLES)]

    def new_engine() -> TrainEngine:
        model = load_causal_lm(prepare_tiny(), "float32")
        if lora is not None:
            model = apply_lora(model, lora, run_seed=0, role="actor")
        return TRAIN_ENGINES[cfg.backend](model, cfg, dist, total_updates=12)

    def step(engine: TrainEngine, n: int) -> dict[str, float]:
        inp = batching.TrainInputs(
            step=n, run_seed=0, table=local, global_samples=samples, kl_coef=0.0, temperature=1.0
        )
        return train.run(cfg, KLConfig(), engine, dist, inp)

    engine = new_engine()
    metrics = [step(engine, n) for n in (1, 2)]
    weights = full_weights(engine)
    state = engine.state_dict()
    # What a checkpoint holds of the model: with LoRA the adapters alone.
    roundtrip_keys = sorted(state["model"])
    saved = _detached(state)
    fresh = new_engine()
    target = fresh.state_dict()
    _copy_into(target, saved)
    fresh.load_state_dict({"model": target["model"], "scheduler": target["scheduler"]})
    fresh.load_state_dict({"optim": target["optim"]})
    loaded = full_weights(fresh)
    third = [step(e, 3) for e in (engine, fresh)]
    after = [full_weights(e) for e in (engine, fresh)]
    roundtrip = {
        "loaded_equal": all(torch.equal(weights[k], loaded[k]) for k in weights),
        "third_step_metrics_equal": _train_metrics(third[0]) == _train_metrics(third[1]),
        "third_step_weights_equal": all(torch.equal(after[0][k], after[1][k]) for k in weights),
        "lr_equal": engine.current_lr() == fresh.current_lr(),
    }
    saved = saved_activations(engine, table)
    metrics = [_train_metrics(m) for m in metrics]
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics))
        (out / "roundtrip.json").write_text(json.dumps(roundtrip))
        (out / "saved_activations.json").write_text(json.dumps(saved))
        (out / "state_keys.json").write_text(json.dumps(roundtrip_keys))
        save_file(weights, out / "weights.safetensors")


if __name__ == "__main__":
    main()
    exit_rank()
