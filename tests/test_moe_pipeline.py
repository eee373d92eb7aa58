"""Mixture-of-Experts runs end to end (`builtin:tiny-moe`: the tiny Llama upcycled to a
Mixtral of 4 experts, top 2, 2 layers): routing replay on 1 and 2 ranks, SIGKILLs under R3
and R2 resumed bitwise, the bad inputs routes bring, and LoRA on an MoE policy.

The runs use 8 prompts, 4 a step, so step 2 ends the sampler's first epoch and step 3
begins its second: three steps reach every kill point, the epoch boundary included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    NEEDS_VLLM,
    ROOT,
    TESTS_ON_PATH,
    committed_hash,
    events,
    final_weights,
    submit,
    trajectories,
    weights_rel_diff,
)
from safetensors.torch import load_file

from rftpipe.atomic import checksum_file
from rftpipe.engines.models import resolve_model_path
from rftpipe.inspect import cli
from rftpipe.storage.routes import fed_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MOE = ("model.path=builtin:tiny-moe", "data.reasoning_gym.size=8", "total_steps=3")
# The same model (`builtin:tiny-moe` is this upcycling), named by its settings.
UPCYCLED = ("model.path=builtin:tiny", "model.upcycle.experts=4", "model.upcycle.top_k=2")
MODES = {
    "r3": ("train.router_replay=r3",),
    "r2": ("train.router_replay=r2", "train.old_logprobs=actor"),
}
BACKENDS = {  # backend: (overrides, ranks)
    "single": ((), 1),
    "fsdp2": (("train.backend=fsdp2",), 2),
    "deepspeed": (("train.backend=deepspeed",), 2),
    # ZeRO-3 partitions the routers' weights too (an empty local tensor on each rank).
    "zero3": (("train.backend=deepspeed", "train.zero_stage=3"), 2),
    # Ulysses: each rank of the pair runs half of every sequence through the MoE layers.
    "fsdp2_sp": (("train.backend=fsdp2", "train.sp_size=2", "train.packing=false"), 2),
}
# What a trajectory row is, whatever the world size: the rollout's tokens and routes, the
# reward and the advantages (the rank that made a row, and float error, may differ).
ROW = [
    "step",
    "prompt_id",
    "sample_idx",
    "prompt_token_ids",
    "response_token_ids",
    "routes",
    "reward",
    "advantages",
]


def _ok(out) -> None:  # out: subprocess.CompletedProcess
    assert out.returncode == 0, out.stderr[-3000:]


def _initial_weights() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(resolve_model_path("builtin:tiny-moe").glob("*.safetensors")):
        out |= load_file(f)
    return out


def _args(mode: str, backend: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(overrides, launcher flags) of a run of `mode` on `backend`."""
    over, ranks = BACKENDS[backend]
    return (*MOE, *MODES[mode], *over), ("--tasks-per-node", str(ranks))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """The uninterrupted 3-step run of (replay mode, backend), made once: the world-size
    tests and the SIGKILL sweep compare with the same runs."""
    made: dict[tuple[str, str], Path] = {}

    def get(mode: str, backend: str) -> Path:
        if (mode, backend) not in made:
            run = tmp_path_factory.mktemp(f"ref-{mode}-{backend}") / "run"
            overrides, extra = _args(mode, backend)
            _ok(submit(run, *overrides, extra=extra))
            made[mode, backend] = run
        return made[mode, backend]

    return get


# -- 1. one rank and two ------------------------------------------------------------------


@pytest.mark.tier1
def test_routes_are_committed_and_the_policy_moves(reference: Callable[[str, str], Path]) -> None:
    """R3 on one rank: every row carries its rollout's routes, (P + R - 1, layers, top_k)
    uint8 with the shape in the shard's metadata, and the run learns (advantages, weights
    and the MoE metrics)."""
    run = reference("r3", "single")
    table = trajectories(run)
    assert table.num_rows == 3 * 4 * 4
    meta = pq.read_schema(run / "stages" / "step=1" / "rollout" / "part-r0.parquet").metadata
    shape = json.loads(meta[b"rftpipe.routes"])
    assert shape == {
        "dtype": "uint8",
        "layout": "(T, layers, top_k) C-order",
        "layers": 2,
        "experts": 4,
        "top_k": 2,
    }
    for row in table.select(["prompt_token_ids", "response_token_ids", "routes"]).to_pylist():
        fed = len(row["prompt_token_ids"]) + len(row["response_token_ids"]) - 1
        assert len(row["routes"]) == fed * 2 * 2
        assert max(row["routes"]) < 4
    assert any(a != 0 for adv in table.column("advantages").to_pylist() for a in adv)
    assert weights_rel_diff(_initial_weights(), final_weights(run)) > 1e-3
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert 0 < m["moe/agreement"] <= 1, m["moe/agreement"]
        assert m["moe/load_imbalance"] >= 1 and m["train/moe_aux_loss"] > 0


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed", "zero3"])
def test_two_ranks_end_like_one(backend: str, reference: Callable[[str, str], Path]) -> None:
    """R3 on two ranks of a sharded backend gives the one-rank run's rows (tokens, routes,
    rewards, advantages: bitwise) and its final weights (within float error: 1e-5 of the
    weights' norm, as tests/test_distributed.py bounds the sharded reductions)."""
    one, two = reference("r3", "single"), reference("r3", backend)
    assert trajectories(two).select(ROW).equals(trajectories(one).select(ROW))
    assert set(trajectories(two).column("rank").to_pylist()) == {0, 1}
    assert weights_rel_diff(final_weights(one), final_weights(two)) < 1e-5


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_sequence_parallel_slices_replay_their_rows_routes(
    mode: str, reference: Callable[[str, str], Path]
) -> None:
    """Under `train.sp_size=2` each rank replays the routes of its half of every sequence
    (R2: each records its half, and the halves are put together): the run's rows are the
    one-rank run's, its weights within float error, and (R2) the recorded selection the
    one-rank run's but where a near-tie router flips on float error."""
    one, sp = reference(mode, "single"), reference(mode, "fsdp2_sp")
    cols = [c for c in ROW if c != "routes"] + (["routes"] if mode == "r3" else [])
    a, b = trajectories(one), trajectories(sp)
    assert a.select(cols).equals(b.select(cols))
    bound = 1e-5
    if mode == "r2":
        # Step 1 records from the same weights; steps 2 and 3 from weights that differ by
        # float error, the sliced attention's rounding being larger than FSDP's alone, and
        # the upcycled tiny model's routers are near ties for many tokens. On 2026-12-02's
        # samples 17 of 8,384 entries flipped (one expert of one token each, steps 2-3),
        # the flipped tokens trained other experts, and the weights moved 4.7e-3 apart
        # (two ranks without SP: no flip, 1e-7). A slice recorded at other positions, or
        # halves put together wrongly, would agree about as often as random picks of 2 of 4.
        steps = np.array(a.column("step").to_pylist())
        x, y = ([bytes(r) for r in t.column("actor_routes").to_pylist()] for t in (a, b))
        assert all(u == v for u, v, s in zip(x, y, steps, strict=True) if s == 1)
        ex, ey = (np.frombuffer(b"".join(r), np.uint8) for r in (x, y))
        assert ex.shape == ey.shape and (ex == ey).mean() > 0.99, (ex == ey).mean()
        bound = 1e-5 if x == y else 2e-2
    assert weights_rel_diff(final_weights(one), final_weights(sp)) < bound
    # The slices replayed (the agreement is logged only over replayed positions) the
    # routes of their own positions: at step 1 (from the same initial weights) the live
    # router agrees with them as often as on two ranks without SP (the same right-padded
    # layout; one rank's prefix forest counts a group's prompt once). A slice that replayed
    # other positions' routes would agree about as often as random picks of 2 of 4 (1/6).
    # Later steps start from weights that differ by float error, and the upcycled tiny
    # model's routers are near ties for many tokens: their agreement moves by a few %. At
    # step 1 the two forwards round differently too: 4 of 518 positions (0.008) on
    # 2026-12-02's samples, none on earlier ones.
    if mode == "r3":
        rows = reference(mode, "fsdp2")
        a1, a2 = _metrics(rows)[0]["moe/agreement"], _metrics(sp)[0]["moe/agreement"]
        assert abs(a1 - a2) < 0.02 and a2 > 0.5, (a1, a2)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# -- 2. SIGKILLs, resumed bitwise -----------------------------------------------------------


def _last_commit(run: Path) -> tuple[int, str]:
    last = [e for e in events(run) if e["event"] == "commit"][-1]
    return last["step"], last["stage"]


# (fault point, hits to let pass, the last commit before the kill). Each kill is a new
# process resuming where the one before died:
KILLS = [
    # mid-rollout: step 2's rollout has generated (and recorded its routes) but its shard
    # is not in place; step 1's rollout, score, advantage and sync shards came before.
    ("shard_before_rename", 4, (1, "sync")),
    # mid-train: step 2's first of two updates done. The restart first replays step 1's
    # train (two updates: no checkpoint before step 2), then regenerates step 2.
    ("train_mid_step", 2, (2, "advantage")),
    # the epoch boundary: right after step 2's last commit (its sync), the end of the first
    # epoch; the restart (from step 2's checkpoint, or replaying steps 1-2 if the checkpoint
    # was still being written) samples epoch 2.
    ("stage_after_commit", 1, (2, "sync")),
]


@pytest.mark.parametrize("backend", ["single", "fsdp2"])
@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_sigkill_resumes_bitwise(
    mode: str, backend: str, reference: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """Killed mid-rollout, mid-train and at the epoch boundary, one kill after the other,
    the run ends as the uninterrupted one: every committed row (routes and actor_routes
    included) and the final weights, bitwise."""
    ref = reference(mode, backend)
    overrides, extra = _args(mode, backend)
    run = tmp_path / "run"
    for point, skip, last in KILLS:
        env = {"RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(skip)}
        out = submit(run, *overrides, extra=extra, env=env)
        assert out.returncode != 0, f"{point} was never reached: {out.stderr[-2000:]}"
        faults = [e["point"] for e in events(run) if e["event"] == "fault"]
        assert faults[-1] == point, faults
        assert _last_commit(run) == last, (point, _last_commit(run))
    _ok(submit(run, *overrides, extra=extra))
    replays = [e["step"] for e in events(run) if e["event"] == "replay"]
    assert 1 in replays, replays  # train steps replayed from their committed routes

    a, b = trajectories(ref), trajectories(run)
    column = "routes" if mode == "r3" else "actor_routes"
    assert column in a.column_names and a.num_rows == 3 * 4 * 4
    assert a.equals(b), "trajectories differ from the uninterrupted run"
    for step in (1, 2, 3):  # the stage the replays read: advantage rows with their routes
        shard = Path("stages") / f"step={step}" / "advantage"
        assert _rows(ref / shard).equals(_rows(run / shard)), step
    wa, wb = final_weights(ref), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # Epoch 1 is prompts 0-7 over steps 1-2, each once; step 3 starts epoch 2.
    ids = b.filter(pc.less_equal(b.column("step"), 2)).column("prompt_id").to_pylist()
    assert sorted(set(ids)) == list(range(8))


def _rows(stage_dir: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(stage_dir.glob("part-r*.parquet")))


# -- 3. bad input -----------------------------------------------------------------------------


def _one_line(out, *needles: str) -> str:  # out: subprocess.CompletedProcess
    """The one stderr line of an exit-2 refusal, with every needle in it."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ("model.path=builtin:tiny", "train.router_replay=r3"),
            ("train.router_replay=r3", "builtin:tiny", "dense"),
        ),
        (
            ("model.path=builtin:tiny-moe", "train.router_replay=r2", "train.old_logprobs=rollout"),
            ("train.router_replay=r2", "train.old_logprobs=actor"),
        ),
        pytest.param(
            ("model.path=builtin:tiny-moe", "train.router_replay=r3", "rollout.engine=vllm"),
            ("train.router_replay=r3", "rollout.engine=vllm", "route capture"),
            marks=NEEDS_VLLM,
        ),
    ],
    ids=["r3_on_a_dense_model", "r2_without_actor_logprobs", "r3_on_vllm"],
)
def test_bad_fresh_input(overrides: tuple[str, ...], needles: tuple[str, ...], tmp_path) -> None:
    """Refused before a stage runs (no engine started): nothing but the run's config."""
    run = tmp_path / "new"
    _one_line(submit(run, *overrides, "total_steps=1"), *needles)
    assert not [e for e in events(run) if e["event"] in ("stage_begin", "commit")]
    assert not (run / "stages").exists() or not any((run / "stages").iterdir())


@pytest.fixture(scope="module")
def before_train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An R3 run of the upcycled tiny model (4 experts, top 2) killed right after step 1's
    rollout commit: its routes are committed, no train stage has read them yet."""
    run = tmp_path_factory.mktemp("before-train") / "run"
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "0"}
    over = (*UPCYCLED, "data.reasoning_gym.size=8", "total_steps=1")
    assert submit(run, *over, env=env).returncode != 0
    assert _last_commit(run) == (1, "rollout")
    return run


def _committed(run: Path) -> dict[str, str]:
    """Each committed stage file, trajectory and checkpoint file and the run's own files
    by content (tests/test_bad_input.py's `committed_files`)."""
    out = {}
    for sub in ("stages", "trajectories", "checkpoints"):
        for p in sorted((run / sub).rglob("*")) if (run / sub).exists() else []:
            if p.is_file():
                out[str(p.relative_to(run))] = checksum_file(p)
    for name in ("config.yaml", "run.json"):
        if (run / name).exists():
            out[name] = checksum_file(run / name)
    return out


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (("train.router_replay=none",), ("train.router_replay", "--allow-fingerprint-mismatch")),
        (("model.upcycle.experts=2",), ("model.upcycle.experts", "--allow-fingerprint-mismatch")),
    ],
    ids=["replay_off", "other_expert_count"],
)
def test_resume_with_other_routing_is_refused(
    overrides: tuple[str, ...], needles: tuple[str, ...], before_train: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(before_train, run)
    before = committed_hash(run)
    _one_line(submit(run, *overrides, config=None), *needles)
    assert committed_hash(run) == before


def test_other_expert_count_allowed_still_cannot_replay(before_train: Path, tmp_path) -> None:
    """Past the fingerprint check (--allow-fingerprint-mismatch), routes recorded over 4
    experts cannot drive a 2-expert model: refused by the shape the step's rollout manifest
    recorded, before any row is read, and nothing committed before changes but the run's
    config and fingerprints."""
    run = tmp_path / "run"
    shutil.copytree(before_train, run)
    before = _committed(run)
    extra = ("--allow-fingerprint-mismatch",)
    out = submit(run, "model.upcycle.experts=2", config=None, extra=extra)
    _one_line(out, "step 1's committed routes", "top 2 of 4 experts", "top 2 of 2")
    after = _committed(run)
    # Accepted past the fingerprints: the run's config and model fingerprint are the resume's.
    for name in ("config.yaml", "run.json"):
        assert after.pop(name) != before.pop(name), name
    assert {k: after.get(k) for k in before} == before


def _edit_routes(run: Path, row: int) -> dict:
    """Cut one token's route off row `row`'s cell of step 1's committed rollout shard, and
    record the shard anew in its manifest (an edit, not damage the checksum would catch).
    Returns the row's step, prompt_id and sample_idx."""
    d = run / "stages" / "step=1" / "rollout"
    shard = d / "part-r0.parquet"
    table = pq.read_table(shard)  # with its metadata (rftpipe.routes)
    cells = table.column("routes").to_pylist()
    cells[row] = cells[row][: -2 * 2]  # one token: 2 layers x top-2
    i = table.column_names.index("routes")
    table = table.set_column(i, table.schema.field(i), pa.array(cells, pa.binary()))
    pq.write_table(table, shard, compression="zstd")
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["shards"][0].update(bytes=shard.stat().st_size, xxh3_128=checksum_file(shard))
    (d / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return table.select(["step", "prompt_id", "sample_idx"]).slice(row, 1).to_pylist()[0]


def test_routes_that_do_not_match_their_tokens(before_train: Path, tmp_path: Path) -> None:
    """A routes cell one token short: the audit names the row, and the resume refuses it
    with one line naming the row; nothing committed before changes."""
    run = tmp_path / "run"
    shutil.copytree(before_train, run)
    row = _edit_routes(run, 3)
    where = (f"step {row['step']}", f"prompt_id {row['prompt_id']}", f"sample {row['sample_idx']}")
    verify = subprocess.run(  # the audit, as a user runs it
        [sys.executable, "-m", "rftpipe.inspect", str(run), "verify"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "column routes" in verify.stdout and all(w in verify.stdout for w in where[1:])
    before = _committed(run)
    _one_line(submit(run, config=None), "column routes", *where, "bytes")
    after = _committed(run)
    assert {k: after.get(k) for k in before} == before


# -- 4. LoRA on an MoE policy -------------------------------------------------------------------


def test_lora_with_default_targets_trains_attention_only(tmp_path: Path) -> None:
    """`model.lora` as it comes on the tiny MoE: its fused experts have no gate/up/down
    projections, so the adapters go on attention alone, and the router and the experts
    keep their weights (the merged export equals the initial model but for attention)."""
    run = tmp_path / "run"
    _ok(submit(run, *MOE, "model.lora.r=8", "model.lora.export_merged=true", "total_steps=2"))
    adapters = load_file(run / "export" / "adapter_model.safetensors")
    assert adapters and all(".self_attn." in k for k in adapters), sorted(adapters)
    initial = _initial_weights()
    merged = load_file(run / "export_merged" / "model.safetensors")
    assert merged.keys() == initial.keys()
    moved = {k for k in merged if not torch.equal(merged[k], initial[k])}
    assert moved and all(".self_attn." in k for k in moved), sorted(moved)
    assert any(".block_sparse_moe.gate." in k for k in merged)  # the router, unchanged


# -- 5. multi-turn episodes -------------------------------------------------------------------

EPISODES = (
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    "reward.functions=[]",  # the environment's reward is the whole return
)


def test_a_multi_turn_run_records_routes_and_a_kill_between_turns_resumes_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Episodes of two turns under `auto` (r3 on the HF loop): every row's routes cover its
    tokens up to its last sampled one, and a run killed before a turn's commit after an
    earlier turn committed (its routes forced again when that turn is replayed onto empty
    caches) ends as the uninterrupted one, bitwise."""
    ref = tmp_path / "ref"
    _ok(submit(ref, *MOE, *EPISODES, env=TESTS_ON_PATH))
    table = trajectories(ref)
    assert "routes" in table.column_names and max(table.column("num_turns").to_pylist()) == 2
    names = ["prompt_token_ids", "response_token_ids", "loss_mask", "routes"]
    for row in table.select(names).to_pylist():
        fed = fed_tokens(
            len(row["prompt_token_ids"]), len(row["response_token_ids"]), row["loss_mask"]
        )
        assert len(row["routes"]) == fed * 2 * 2
    # The inspector reads them: `verify` passes, the page titles every token.
    capsys.readouterr()
    assert cli.main([str(ref), "verify"]) == 0, capsys.readouterr()
    assert cli.main([str(ref), "html", "--out", str(tmp_path / "p.html")]) == 0
    doc = (tmp_path / "p.html").read_text()
    assert '<details class="routes">' in doc and '<div class="img-error"' not in doc
    run = tmp_path / "killed"
    # Killed after step 2's second turn, before its commit: the first turn is committed,
    # with its routes, and the second is generated again on the replayed caches.
    env = {
        **TESTS_ON_PATH,
        "RFTPIPE_FAULT": "episode_before_turn_commit",
        "RFTPIPE_FAULT_SKIP": "3",
    }
    assert submit(run, *MOE, *EPISODES, env=env).returncode != 0
    _ok(submit(run, *MOE, *EPISODES, env=TESTS_ON_PATH))
    resumed = [(e["step"], e["turns"]) for e in events(run) if e["event"] == "resume_turns"]
    assert resumed == [(2, 1)], resumed
    assert trajectories(run).equals(table)
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
