"""Memory features of the train engines on the tiny model: token-budget micro-batches,
activation checkpointing, bf16 autocast (single), FSDP2 CPU offload, per-group packing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ROOT, count_calls, script_command, table_samples
from safetensors.torch import load_file

from jobs.submit import local_rank_env
from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.forward import (
    build_micro_batch,
    grouped_logprobs,
    prefix_forest,
    response_logprobs,
    split_micro_batches,
)
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.stages import batching, train

PROMPT_LENGTHS = (6, 11, 4, 9)
RESPONSE_LENGTHS = ((9, 2, 5, 1), (3, 7, 7, 4), (8, 1, 6, 2), (5, 5, 3, 9))


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    """4 prompts of different lengths x 4 responses of 1-9 tokens, in group order."""
    gen = torch.Generator().manual_seed(3)
    prompts, responses = [], []
    for n_prompt, lengths in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True):
        prompt = torch.randint(5, 200, (n_prompt,), generator=gen).tolist()
        for n in lengths:
            prompts.append(prompt)
            responses.append(torch.randint(5, 200, (n,), generator=gen).tolist())
    return prompts, responses


def _advantage_table() -> pa.Table:
    """Committed advantage rows: behaviour logprobs near the initial model's (so ratios
    move off 1 and some clip) and advantages of both signs."""
    prompts, responses = _rows()
    engine = SingleDeviceEngine(
        load_causal_lm(prepare_tiny(), "float32"), TrainConfig(), Dist(), role="reference"
    )
    logprobs = engine.compute_logprobs(prompts, responses, 1.0)
    gen = torch.Generator().manual_seed(4)
    old = [[x + 0.3 * float(torch.randn((), generator=gen)) for x in lp] for lp in logprobs]
    adv = [[float(torch.randn((), generator=gen))] * len(r) for r in responses]
    return pa.table(
        {
            "prompt_id": [i // 4 for i in range(len(prompts))],
            "sample_idx": [i % 4 for i in range(len(prompts))],
            "prompt_token_ids": prompts,
            "response_token_ids": responses,
            "logprobs": pa.array(old, pa.list_(pa.float32())),
            "advantages": pa.array(adv, pa.list_(pa.float32())),
            "response_length": [len(r) for r in responses],
        }
    )


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return _advantage_table()


def _train_step(cfg: TrainConfig, table: pa.Table) -> tuple[dict, dict, int]:
    """One train stage on a fresh tiny model: metrics, weights, decoder forward count."""
    engine = SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), cfg, Dist())
    calls = count_calls(engine.model.get_decoder())
    samples = table_samples(table)
    inp = batching.TrainInputs(
        step=1, run_seed=0, table=table, global_samples=samples, kl_coef=0.0, temperature=1.0
    )
    metrics = train.run(cfg, KLConfig(), engine, Dist(), inp)
    weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return _train_metrics(metrics), weights, calls[0]


def _train_metrics(metrics: dict) -> dict:
    """The stage's results, without timings that differ run to run."""
    return {k: v for k, v in metrics.items() if k.startswith("train/")}


# ---------------------------------------------------------------- token-budget micro-batches


def test_split_micro_batches_by_rows_and_by_token_budget() -> None:
    prompts, responses = [[1] * 4] * 5, [[2] * 3, [2], [2] * 20, [2] * 2, [2] * 2]
    by_rows = split_micro_batches(TrainConfig(micro_batch_size=2), prompts, responses)
    assert by_rows == [range(0, 2), range(2, 4), range(4, 5)]
    # 7 + 5 fit 12; 24 is over the budget and runs alone; 6 + 6 fit.
    by_tokens = split_micro_batches(TrainConfig(max_tokens_per_micro_batch=12), prompts, responses)
    assert by_tokens == [range(0, 2), range(2, 3), range(3, 5)]
    assert split_micro_batches(TrainConfig(max_tokens_per_micro_batch=12), [], []) == []


@pytest.mark.kernels
def test_token_budget_micro_batches_train_like_row_micro_batches(table: pa.Table) -> None:
    """Losses are normalised by global token counts, so only the float summation order of
    the gradient accumulation changes: metrics (the grad norm too) agree to 1e-6 relative,
    the two AdamW updates (weights minus initial weights) to 2e-4 relative in L2 norm
    (3.5e-5 measured). Not elementwise: AdamW's first steps divide each gradient by its own
    magnitude, which amplifies rounding on the few gradients near zero."""
    rows_cfg = TrainConfig(lr=1e-3, mini_batches=2, micro_batch_size=4, entropy_coef=0.01)
    tokens_cfg = dataclasses.replace(rows_cfg, max_tokens_per_micro_batch=30)
    by_rows, w_rows, calls_rows = _train_step(rows_cfg, table)
    by_tokens, w_tokens, calls_tokens = _train_step(tokens_cfg, table)

    # The budget really re-splits each mini-batch: more, unevenly sized micro-batches.
    rows = table.to_pylist()
    inp = batching.TrainInputs(
        step=1,
        run_seed=0,
        table=table,
        global_samples=[(r["prompt_id"], r["sample_idx"]) for r in rows],
        kl_coef=0.0,
        temperature=1.0,
    )
    sizes = []
    for mb in batching.minibatch_plan(inp, 0, 2):
        p = [rows[i]["prompt_token_ids"] for i in mb]
        r = [rows[i]["response_token_ids"] for i in mb]
        assert [len(s) for s in split_micro_batches(rows_cfg, p, r)] == [4, 4]
        splits = split_micro_batches(tokens_cfg, p, r)
        assert all(sum(len(p[i]) + len(r[i]) for i in s) <= 30 for s in splits if len(s) > 1)
        sizes += [len(s) for s in splits]
    assert calls_rows == 4 and calls_tokens == len(sizes) > 4, sizes
    assert len(set(sizes)) > 1, sizes

    for key, value in by_rows.items():
        assert by_tokens[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert by_rows["train/clip_frac"] > 0  # the clipped branch is part of the comparison
    assert _update_diff(_initial(), w_rows, w_tokens) < 2e-4


def _update_diff(initial: dict, a: dict, b: dict) -> float:
    """||b - a|| / ||a - initial|| over all tensors: how far two updates of the same initial
    weights differ, relative to the update's size (which must be real)."""
    num = sum(float((b[k] - a[k]).pow(2).sum()) for k in initial) ** 0.5
    den = sum(float((a[k] - initial[k]).pow(2).sum()) for k in initial) ** 0.5
    assert den > 0.1, den  # the update really moved the weights
    return num / den


def _initial() -> dict[str, torch.Tensor]:
    return load_causal_lm(prepare_tiny(), "float32").state_dict()


@pytest.mark.kernels
def test_compute_logprobs_under_a_token_budget(table: pa.Table) -> None:
    rows = table.to_pylist()
    prompts = [r["prompt_token_ids"] for r in rows]
    responses = [r["response_token_ids"] for r in rows]
    model = load_causal_lm(prepare_tiny(), "float32")
    engines = {
        name: SingleDeviceEngine(model, cfg, Dist(), role="reference")
        for name, cfg in {
            "rows": TrainConfig(micro_batch_size=4),
            "tokens": TrainConfig(max_tokens_per_micro_batch=25),
        }.items()
    }
    calls = count_calls(model.get_decoder())
    got = {name: e.compute_logprobs(prompts, responses, 0.8) for name, e in engines.items()}
    n_tokens_split = len(split_micro_batches(engines["tokens"].cfg, prompts, responses))
    assert calls[0] == 4 + n_tokens_split and n_tokens_split > 4
    assert [len(x) for x in got["tokens"]] == [len(r) for r in responses]
    for a, b in zip(got["rows"], got["tokens"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


# --------------------------------------------------------------------- activation checkpoints


def _grads_and_activations(cfg: TrainConfig) -> tuple[dict, int, int]:
    """Gradients of one forward/backward, the first layer's MLP forward count, and the bytes
    autograd saved for the backward outside checkpointed regions."""
    engine = SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), cfg, Dist())
    mlp_calls = count_calls(engine.model.get_decoder().layers[0].mlp)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    prompts, responses = _rows()
    with engine.train_mode():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, _ = engine.forward(prompts, responses, 1.0, with_entropy=False)
        engine.backward(-lp.sum())
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    return grads, mlp_calls[0], saved[0]


@pytest.mark.kernels
def test_gradient_checkpointing_recomputes_layers_and_keeps_gradients() -> None:
    plain, plain_calls, plain_saved = _grads_and_activations(TrainConfig())
    ckpt, ckpt_calls, ckpt_saved = _grads_and_activations(TrainConfig(gradient_checkpointing=True))
    assert plain_calls == 1 and ckpt_calls == 2  # the backward ran each layer again
    # What stays saved is each layer's input plus the embedding and head's own.
    assert ckpt_saved < 0.5 * plain_saved, (ckpt_saved, plain_saved)
    for n, g in plain.items():
        assert torch.allclose(ckpt[n], g, rtol=1e-6, atol=1e-8), n


def test_gradient_checkpointing_only_in_training() -> None:
    """Scoring (no grad) runs each layer once: the rollout shares the single engine's module."""
    engine = SingleDeviceEngine(
        load_causal_lm(prepare_tiny(), "float32"), TrainConfig(gradient_checkpointing=True), Dist()
    )
    mlp_calls = count_calls(engine.model.get_decoder().layers[0].mlp)
    prompts, responses = _rows()
    engine.compute_logprobs(prompts, responses, 1.0)
    assert mlp_calls[0] == len(split_micro_batches(engine.cfg, prompts, responses))


# ---------------------------------------------------------------------------- bf16 autocast


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.kernels
def test_bf16_single_engine_autocasts_and_keeps_fp32_master_weights(device: str) -> None:
    prompts, responses = _rows()
    mask = build_micro_batch(prompts, responses, pad_id=0).response_mask.to(device)
    seen: dict[str, set] = {}
    out = {}
    engines = {}
    for dtype in ("float32", "bfloat16"):
        engine = SingleDeviceEngine(
            load_causal_lm(prepare_tiny(), "float32").to(device),
            TrainConfig(lr=1e-3, param_dtype=dtype),
            Dist(),
            total_updates=1,
        )
        q_proj = engine.model.get_decoder().layers[0].self_attn.q_proj
        seen[dtype] = set()
        q_proj.register_forward_hook(lambda m, i, o, s=seen[dtype]: s.add(o.dtype))
        with engine.train_mode():
            lp, _ = engine.forward(prompts, responses, 1.0, with_entropy=False)
            engine.backward(-(lp * mask).sum() / mask.sum())
            assert engine.optimizer_step() > 0
        out[dtype] = lp.detach()
        engines[dtype] = engine
    # Autocast casts inside the matmul: the hook sees the product's dtype.
    assert seen == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}
    # bf16 rounding (8 mantissa bits) is visible in the logprobs, and nothing worse.
    diff = float((out["bfloat16"] - out["float32"]).abs()[mask].max())
    assert 1e-4 < diff < 5e-2, diff
    assert out["bfloat16"].dtype == torch.float32
    bf16 = engines["bfloat16"]
    initial = _initial()
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    states = list(bf16.optimizer.state.values())
    assert states and all(s["exp_avg_sq"].dtype == torch.float32 for s in states)
    w = bf16.model.state_dict()
    assert max(float((w[k].cpu() - initial[k]).abs().max()) for k in initial) > 5e-4


# ------------------------------------------------------------------------- per-group packing


def test_prefix_forest_one_padded_row_per_group() -> None:
    prompts, responses = _rows()
    forest = prefix_forest(prompts, responses, t_max=9)
    sizes = [
        n + sum(r - 1 for r in lengths)
        for n, lengths in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
    ]
    assert forest.input_ids.shape == (4, max(sizes))
    assert forest.attention_mask.shape == (4, 1, max(sizes), max(sizes))
    real = forest.attention_mask[:, 0].any(dim=1)  # keys that any query sees
    for g, size in enumerate(sizes):
        # Every real token is seen; padding keys only by padding queries.
        assert bool(real[g, :size].all())
        pad_sees = forest.attention_mask[g, 0, size:, :].sum(dim=1)
        assert bool((pad_sees > 0).all())
        assert not bool(forest.attention_mask[g, 0, :size, size:].any())


def test_prefix_forest_splits_a_prompt_met_in_two_groups() -> None:
    """A problem repeated in two groups of a step makes two trees, not one twice as wide
    that every other tree is padded to (the 8x8x64 benchmark's fourth-step jump)."""
    prompts, responses = _rows()
    n = len(RESPONSE_LENGTHS[1])
    # The widest group's prompt again, with its response lengths: one tree of both would
    # be 45 positions wide, and 4 x 45 > 5 x 28.
    prompts += prompts[n : 2 * n]
    responses += [r[::-1] for r in responses[n : 2 * n]]
    forest = prefix_forest(prompts, responses, t_max=9)
    whole = [
        n + sum(r - 1 for r in lengths)
        for n, lengths in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
    ]
    assert forest.input_ids.shape == (5, max(whole))
    # Each row's first response token is predicted by its own tree's last prompt position.
    trees = forest.gather[:, 0] // max(whole)
    assert trees[n : 2 * n].unique().numel() == 1 and trees[-n:].unique().numel() == 1
    assert int(trees[n]) != int(trees[-1])


@pytest.mark.kernels
def test_grouped_rows_equal_per_row_full_forwards() -> None:
    """Unequal groups (padding) and rows out of group order, against one full forward per row."""
    model = load_causal_lm(prepare_tiny(), "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.2)
    prompts, responses = _rows()
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(2)).tolist()
    prompts, responses = [prompts[i] for i in order], [responses[i] for i in order]
    mb = build_micro_batch(prompts, responses, pad_id=0)
    m = mb.response_mask
    model.zero_grad()
    full, full_ent = response_logprobs(model, mb, 0.7, with_entropy=True)
    ((full + full_ent) * m).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, got_ent = grouped_logprobs(model, prompts, responses, 0.7, with_entropy=True)
    ((got + got_ent) * m).sum().backward()
    assert float((full - got).detach().abs()[m].max()) < 1e-5
    assert float((full_ent - got_ent).detach().abs()[m].max()) < 1e-5
    for n, p in model.named_parameters():
        rel = (p.grad - want[n]).norm() / want[n].norm().clamp_min(1e-12)
        assert rel < 1e-5, (n, float(rel))


# ------------------------------------------------------------------ FSDP2, 2 ranks over gloo


def _run_fsdp(table_path: Path, out: Path, variants: list[str], world: int = 2) -> None:
    worker = ROOT / "tests" / "fsdp_memory_worker.py"
    with local_rank_env(world) as env:
        env["PYTHONPATH"] = str(ROOT)
        procs = [
            subprocess.Popen(
                script_command(worker, str(table_path), str(out), *variants),
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(world)
        ]
        assert [p.wait(timeout=400) for p in procs] == [0] * world


@pytest.fixture(scope="module")
def fsdp_runs(table: pa.Table, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    pq.write_table(table, out / "advantage.parquet")
    _run_fsdp(out / "advantage.parquet", out, ["base", "offload", "checkpointing", "token_budget"])
    return out


def _variant(out: Path, name: str, world: int = 2) -> dict:
    return {
        "metrics": json.loads((out / f"{name}-metrics.json").read_text()),
        "weights": load_file(out / f"{name}-weights.safetensors"),
        "info": [json.loads((out / f"{name}-info-r{r}.json").read_text()) for r in range(world)],
    }


def _assert_same_training(a: dict, b: dict, update_rtol: float) -> None:
    """Same metrics and scoring, and updates equal to `update_rtol` (0: bitwise weights)."""
    for key, value in _train_metrics(a["metrics"]).items():
        assert b["metrics"][key] == pytest.approx(value, rel=max(update_rtol, 1e-7), abs=1e-9), key
    if update_rtol:
        assert _update_diff(_initial(), a["weights"], b["weights"]) < update_rtol
    else:
        assert all(torch.equal(w, b["weights"][k]) for k, w in a["weights"].items())
    for ra, rb in zip(a["info"], b["info"], strict=True):
        for x, y in zip(ra["logprobs"], rb["logprobs"], strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_cpu_offload_applies_the_policy_and_trains_alike(fsdp_runs: Path) -> None:
    """On CPU the offload moves nothing (the shards already live in host memory), so what
    can be checked here is that every FSDP unit runs with CPUOffloadPolicy (unpinned: pinning
    needs CUDA) and trains bitwise like the plain run. Only a GPU shows what the policy is
    for: shards, gradients and AdamW state in host memory while compute runs on the device
    (device memory down to the unsharded layer in flight), pinned host buffers, and the
    host-device copies' cost."""
    base, offload = _variant(fsdp_runs, "base"), _variant(fsdp_runs, "offload")
    _assert_same_training(base, offload, update_rtol=0)
    n_units = 3  # two decoder layers and the root
    for rank in offload["info"]:
        assert [u["policy"] for u in rank["policies"]] == ["CPUOffloadPolicy"] * n_units
        assert all(u["pin_memory"] is False and all(u["offload_to_cpu"]) for u in rank["policies"])
        assert all(u["shard_devices"] == ["cpu"] for u in rank["policies"])
    for rank in base["info"]:
        assert [u["policy"] for u in rank["policies"]] == ["OffloadPolicy"] * n_units
        assert not any(any(u["offload_to_cpu"]) for u in rank["policies"])


@pytest.mark.slow
def test_fsdp2_gradient_checkpointing_recomputes_and_trains_alike(fsdp_runs: Path) -> None:
    """The recompute runs the same kernels on the same inputs: bitwise the same update."""
    base, ckpt = _variant(fsdp_runs, "base"), _variant(fsdp_runs, "checkpointing")
    _assert_same_training(base, ckpt, update_rtol=0)
    for b, c in zip(base["info"], ckpt["info"], strict=True):
        calls = b["train_calls"]["decoder"]
        assert b["train_calls"]["mlp"] == calls  # forward only
        assert c["train_calls"] == {"decoder": calls, "mlp": 2 * calls}  # and the recompute


@pytest.mark.slow
def test_fsdp2_token_budget_pads_ranks_to_the_same_micro_batch_count(
    fsdp_runs: Path, table: pa.Table
) -> None:
    """Updates agree to 2e-4 relative (see the single-device test for why not bitwise)."""
    from fsdp_memory_worker import BASE, VARIANTS

    from rftpipe.data.sampler import rank_slice

    cfg = dataclasses.replace(BASE, **VARIANTS["token_budget"])
    base, budget = _variant(fsdp_runs, "base"), _variant(fsdp_runs, "token_budget")
    _assert_same_training(base, budget, update_rtol=2e-4)
    # Each rank's own split of each mini-batch: the counts differ, so one rank pads.
    rows = table.to_pylist()
    samples = [(r["prompt_id"], r["sample_idx"]) for r in rows]
    local_counts = []
    for rank in (0, 1):
        mine = set(rank_slice(sorted({r["prompt_id"] for r in rows}), rank, 2))
        local = table.filter(pa.array([r["prompt_id"] in mine for r in rows]))
        inp = batching.TrainInputs(
            step=1, run_seed=0, table=local, global_samples=samples, kl_coef=0.0, temperature=1.0
        )
        lr = local.to_pylist()
        local_counts.append(
            [
                len(
                    split_micro_batches(
                        cfg,
                        [lr[i]["prompt_token_ids"] for i in mb],
                        [lr[i]["response_token_ids"] for i in mb],
                    )
                )
                for mb in batching.minibatch_plan(inp, 0, cfg.mini_batches)
            ]
        )
    assert local_counts[0] != local_counts[1], local_counts
    padded = sum(max(a, b) for a, b in zip(*local_counts, strict=True))
    assert [r["train_calls"]["decoder"] for r in budget["info"]] == [padded, padded]
    assert padded != base["info"][0]["train_calls"]["decoder"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp2_cpu_offload_on_gpu_keeps_state_in_pinned_host_memory(
    table: pa.Table, tmp_path: Path
) -> None:
    """What the CPU test cannot see: with the policy, weights, gradients and AdamW state stay
    in pinned host memory between steps while the forward and backward run on the GPU."""
    pq.write_table(table, tmp_path / "advantage.parquet")
    variants = ["base", "offload", "checkpointing"]
    _run_fsdp(tmp_path / "advantage.parquet", tmp_path, variants, world=1)
    base, offload = _variant(tmp_path, "base", 1), _variant(tmp_path, "offload", 1)
    ckpt = _variant(tmp_path, "checkpointing", 1)
    [units] = [r["policies"] for r in offload["info"]]
    assert all(u["policy"] == "CPUOffloadPolicy" and u["pin_memory"] for u in units)
    assert all(u["shard_devices"] == ["cpu"] for u in units)
    assert all(u["shard_devices"] == ["cuda"] for u in base["info"][0]["policies"])
    # Between steps the base run keeps the weights and both AdamW moments on the GPU (12
    # bytes a parameter; the gradients are freed), the offloaded run none of them. Both hold
    # the same workspaces besides (cuBLAS's is allocated through PyTorch's allocator).
    n_params = sum(w.numel() for k, w in base["weights"].items() if k != "lm_head.weight")
    held = base["info"][0]["cuda_resident"], offload["info"][0]["cuda_resident"]
    assert held[0] - held[1] >= 12 * n_params, (held, n_params)
    # CPU and CUDA AdamW kernels round differently: equal updates to 1e-4 relative.
    _assert_same_training(base, offload, update_rtol=1e-4)
    _assert_same_training(base, ckpt, update_rtol=1e-4)
    assert ckpt["info"][0]["train_calls"]["mlp"] == 2 * ckpt["info"][0]["train_calls"]["decoder"]
