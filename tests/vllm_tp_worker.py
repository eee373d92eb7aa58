"""One rank of the vLLM tensor-parallel test (`test_vllm_tp.py`), run as real processes.

    python tests/vllm_tp_worker.py MODEL_DIR OUT_DIR TENSOR_PARALLEL_SIZE

Two "asking ranks" ask the rollout engine different things (different prompts, counts and
seeds; one of them nothing at all in one call). Run as 2 processes (RANK/WORLD_SIZE/...
set), each rank asks its own; run as one process (no RANK in the environment), a single
TP=1 engine asks for both in turn, which is the reference. Each asking rank r writes what
it got back to OUT_DIR/r{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from helpers import vllm_spec

from rftpipe.config.schema import InferenceConfig, RolloutConfig
from rftpipe.data.prompts import Prompt
from rftpipe.dist import init_from_env
from rftpipe.engines.models import load_causal_lm, load_tokenizer
from rftpipe.engines.rollout.vllm import VLLMEngine
from rftpipe.stages import rollout

N = 4
#: (prompts, group seeds) per asking rank: uneven counts and lengths.
ASKS = {
    0: ([[5, 6, 7, 8, 9, 10], [40, 41, 42], [70, 71]], [1, 2, 3]),
    1: ([[11, 12, 13, 14], [90, 91, 92, 93, 94, 95, 96]], [4, 5]),
}
#: Greedy evaluation: every rank asks the same prompts ...
SAME = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [70, 71], [100, 101, 102, 103]]
#: ... and, for the engine's sake, also different ones.
OWN = {0: [[20, 21, 22]], 1: [[30, 31], [60, 61, 62, 63, 64]]}
#: The timed batch, split between the asking ranks.
BENCH = [[(7 * i + j) % 200 + 3 for j in range(8 + i % 5)] for i in range(32)]


def moved_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Other weights than the model's, the same in every process."""
    model = load_causal_lm(model_dir, "float32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return dict(model.state_dict())


def main() -> None:
    model_dir, out, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist = init_from_env()
    asking = [dist.rank] if dist.world > 1 else list(ASKS)
    tok = load_tokenizer(model_dir)
    cfg = RolloutConfig(
        engine="vllm",
        n=N,
        max_new_tokens=8,
        temperature=0.9,
        inference=InferenceConfig(tensor_parallel_size=tp, cpu_kv_cache_gib=1),
    )
    engine = VLLMEngine(cfg, vllm_spec(model_dir), dist)
    res: dict[int, dict] = {r: {} for r in asking}

    for r in asking:
        prompts, seeds = ASKS[r]
        res[r]["before"] = [asdict(g) for g in engine.generate_groups(prompts, N, seeds)]
    # Through the rollout stage, where asking rank 1 has no prompts this step.
    for r in asking:
        mine = [
            Prompt(prompt_id=i, text="", token_ids=tuple(p), answer=None, metadata={})
            for i, p in enumerate(ASKS[0][0])
        ]
        inp = rollout.RolloutInputs(step=1, rank=r, run_seed=0, prompts=mine if r == 0 else [])
        table = rollout.run(cfg, engine, tok, inp)
        res[r]["stage"] = table.column("response_token_ids").to_pylist()
    for r in asking:
        res[r]["greedy_same"] = engine.greedy(SAME, 8)
    for r in asking:
        res[r]["greedy_own"] = engine.greedy(OWN[r], 8)
    engine.update_weights(moved_weights(model_dir), version=1)
    for r in asking:
        prompts, seeds = ASKS[r]
        res[r]["after"] = [asdict(g) for g in engine.generate_groups(prompts, N, seeds)]
    # The same batch timed: one TP=1 engine generates all of it; with TP=2 each rank asks
    # for half and the group generates the whole. Best of 5 after a warm-up call.
    half = len(BENCH) // 2
    bench = {0: BENCH[:half], 1: BENCH[half:]}
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        if dist.world > 1:
            engine.generate_groups(bench[dist.rank], N, list(range(len(bench[dist.rank]))))
        else:
            engine.generate_groups(BENCH, N, list(range(half)) * 2)
        times.append(time.perf_counter() - t0)
    seconds = min(times[1:])
    out.mkdir(parents=True, exist_ok=True)
    for r in asking:
        res[r]["bench_s"] = seconds
        res[r]["pid"] = os.getpid()
        (out / f"r{r}.json").write_text(json.dumps(res[r]))


if __name__ == "__main__":
    main()
