"""One rank of the offload-between-stages test: the same train steps with and without
`train.offload_between_stages`, side by side in one process.

    python tests/offload_worker.py OUT_DIR CONFIG ...

Each CONFIG is comma-separated TrainConfig fields (`backend=deepspeed,zero_stage=3`); the
configs run one after another in the same processes (one start, one DeepSpeed import).

Engine `on` (offload on) and `off` take steps 1-3 on backend_worker's fixed rows. After
step 1, with `on` offloaded, one more explicit reload/offload round checks the movement
itself: every optimizer-state tensor gets a new storage each way, and the tensors replaced
by the offload are freed. After step 2, `on`'s `state_dict()` is read while offloaded and
loaded into a third engine that is itself offloaded (it trained step 1), which then takes
step 3. Rank 0 writes OUT_DIR/result.json: CONFIG -> the checks' outcomes.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from backend_worker import GROUPS, SAMPLES, _copy_into, _detached, _value, fixed_rows, full_weights
from helpers import exit_rank
from torch.distributed.tensor import DTensor

from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import TrainEngine
from rftpipe.stages import batching, train


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def optimizer_tensors(engine: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the per-parameter AdamW state tensors, replaced on each move; DeepSpeed's fp32 flat
    partitions, moved in place), read from the engines' internals independently of the
    offload code."""
    if hasattr(engine, "_inner"):  # DeepSpeed
        flats = engine._flat_partitions()
        return [v for st in engine._inner.state.values() for v in st.values()], flats
    return [v for st in engine.optimizer.state.values() for v in st.values()], []


def _ptrs(engine: Any) -> list[int]:
    """Each tensor's storage address, in a fixed order (compared position by position: a
    freed address may be reused by the next tensor's copy)."""
    state, flats = optimizer_tensors(engine)
    return [_local(t).untyped_storage().data_ptr() for t in (*state, *flats)]


def _all_new(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) > 0 and all(x != y for x, y in zip(a, b, strict=True))


def movement(engine: Any) -> dict[str, Any]:
    """One reload/offload round on an offloaded engine, observed from outside."""
    host = _ptrs(engine)
    engine.reload()
    device = _ptrs(engine)
    state, _ = optimizer_tensors(engine)
    refs = [weakref.ref(_local(t)) for t in state]
    values = [_local(t).clone() for t in state]
    del state
    engine.offload()
    back = _ptrs(engine)
    state, flats = optimizer_tensors(engine)
    return {
        "bytes": engine.offload_record.bytes,
        "expected_bytes": sum(
            _local(t).numel() * _local(t).element_size() for t in (*state, *flats)
        ),
        "tensors": len(host),
        "new_storage_on_reload": _all_new(host, device),
        "new_storage_on_offload": _all_new(device, back),
        "device_copies_freed": all(r() is None for r in refs),
        "values_equal": all(torch.equal(_local(a), b) for a, b in zip(state, values, strict=True)),
    }


def run(cfg: TrainConfig, dist: Dist) -> dict[str, Any]:
    table = fixed_rows()
    ids = list(range(GROUPS))
    mine = set(rank_slice(ids, dist.rank, dist.world))
    local = table.filter(pa.array([p in mine for p in table.column("prompt_id").to_pylist()]))
    samples = [(p, k) for p in ids for k in range(SAMPLES)]
    off_cfg = TrainConfig(**{**_fields(cfg), "offload_between_stages": False})

    def new_engine(c: TrainConfig) -> TrainEngine:
        model = load_causal_lm(prepare_tiny(), "float32")
        return TRAIN_ENGINES[c.backend](model, c, dist, total_updates=12)

    def step(engine: TrainEngine, c: TrainConfig, n: int) -> dict[str, float]:
        inp = batching.TrainInputs(
            step=n, run_seed=0, table=local, global_samples=samples, kl_coef=0.0, temperature=1.0
        )
        m = train.run(c, KLConfig(), engine, dist, inp)
        return {k: v for k, v in m.items() if k.startswith("train/")}

    on, off, loaded = new_engine(cfg), new_engine(off_cfg), new_engine(cfg)
    metrics = {"on": [step(on, cfg, 1)], "off": [step(off, off_cfg, 1)]}
    step(loaded, cfg, 1)  # now it has optimizer state, offloaded
    moved = movement(on)
    metrics["on"].append(step(on, cfg, 2))
    metrics["off"].append(step(off, off_cfg, 2))
    saved = _detached(on.state_dict())  # read from the host copy
    target = loaded.state_dict()
    _copy_into(target, saved)
    loaded.load_state_dict(target)  # into an offloaded engine
    metrics["on"].append(step(on, cfg, 3))
    metrics["off"].append(step(off, off_cfg, 3))
    metrics["loaded"] = [step(loaded, cfg, 3)]
    weights = {k: full_weights(e) for k, e in (("on", on), ("off", off), ("loaded", loaded))}
    return {
        "movement": moved,
        "metrics_equal": metrics["on"] == metrics["off"],
        "loaded_step_equal": metrics["loaded"][0] == metrics["on"][2],
        "weights_equal": all(
            torch.equal(weights["on"][k], weights["off"][k]) for k in weights["on"]
        ),
        "loaded_weights_equal": all(
            torch.equal(weights["on"][k], weights["loaded"][k]) for k in weights["on"]
        ),
        "moved_weights": any(
            not torch.equal(weights["on"][k], w)
            for k, w in _initial().items()
            if k in weights["on"]
        ),
    }


def _initial() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(prepare_tiny() / "model.safetensors")


def _fields(cfg: TrainConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def config(fields: dict[str, object]) -> TrainConfig:
    return TrainConfig(
        lr=1e-3, mini_batches=2, micro_batch_size=2, offload_between_stages=True, **fields
    )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    configs = {
        spec: config({k: _value(v) for k, v in (f.split("=", 1) for f in spec.split(","))})
        for spec in sys.argv[2:]
    }
    dist = init_from_env(require_group=any(c.backend != "single" for c in configs.values()))
    result = {spec: run(cfg, dist) for spec, cfg in configs.items()}
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_rank()
