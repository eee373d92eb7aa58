"""`rftpipe inspect` on an MoE run's routes (issue 49): `verify` checks them, the `routes`
view counts them, the `html` page titles each token with them, the `plot` adds a router
panel; a dense run reads as before. One real MoE run (router noise, so agreement < 1) and
one dense run; the routes are read back independently with the training side's decoder."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, submit, trajectories

from rftpipe.atomic import checksum_file
from rftpipe.engines.moe import decode
from rftpipe.errors import UserError
from rftpipe.inspect import cli, page
from rftpipe.storage.routes import RouteShape

pytestmark = pytest.mark.slow

SHAPE = RouteShape(layers=2, experts=4, top_k=2)
"""`builtin:tiny-moe`'s: 2 MoE layers of 4 experts, top 2."""


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("inspect-moe") / "run"
    env = {"RFTPIPE_ROUTER_NOISE": "0.5"}  # the trainer's router disagrees with the rollout's
    r = submit(run, "model.path=builtin:tiny-moe", "total_steps=2", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("inspect-dense") / "run"
    r = submit(run, "total_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def inspect(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """`rftpipe inspect ARGS` in this process (the imports are warm): (exit code, stdout,
    stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def step_rows(run: Path, step: int) -> list[dict[str, Any]]:
    t = trajectories(run)
    return [r for r in t.to_pylist() if r["step"] == step]


def decoded(row: dict[str, Any]) -> np.ndarray:
    """A row's routes as training reads them: (P + R - 1, layers, top_k)."""
    fed = len(row["prompt_token_ids"]) + len(row["response_token_ids"]) - 1
    return decode(row["routes"], fed, SHAPE, "test").numpy()


def step_metrics(run: Path, step: int) -> dict[str, Any]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("step") == step][-1]


def rewrite_shard(run: Path, step: int, stage: str, edit: Callable[[pa.Table], pa.Table]) -> Path:
    """A committed shard rewritten through `edit`, its manifest entry recording the new file:
    a writer's bug, not a disk's, so that only the routes check can find it."""
    d = run / "stages" / f"step={step}" / stage
    path = d / "part-r0.parquet"
    pq.write_table(edit(pq.ParquetFile(path).read()), path)
    record = {"bytes": path.stat().st_size, "xxh3_128": checksum_file(path)}
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["shards"][0].update(record)
    (d / "MANIFEST.json").write_text(json.dumps(manifest))
    side = json.loads((d / "part-r0.json").read_text())
    (d / "part-r0.json").write_text(json.dumps(side | record))
    return path


def with_cells(table: pa.Table, cells: list[bytes | None]) -> pa.Table:
    i = table.column_names.index("routes")
    return table.set_column(i, table.schema.field(i), pa.array(cells, pa.binary()))


@pytest.mark.tier1
def test_verify_names_each_bad_row(
    moe_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = inspect(capsys, moe_run, "verify")
    assert rc == 0, out
    # rollout, score, advantage and sync of each step carry the column.
    assert "(8 shards with routes)" in out and "0 corrupt file(s)" in out, out

    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy, ignore=shutil.ignore_patterns("checkpoints", "export"))
    rows = pq.read_table(copy / "stages" / "step=2" / "rollout" / "part-r0.parquet").to_pylist()
    cells = [r["routes"] for r in rows]
    short, wild, missing = 1, 6, 11
    cells[short] = cells[short][:-1]  # one byte short
    cells[wild] = bytes([SHAPE.experts]) + cells[wild][1:]  # expert 4 of 0..3
    cells[missing] = None  # a trained row without routes
    shard = rewrite_shard(copy, 2, "rollout", lambda t: with_cells(t, cells))
    # And a shard that lost its shape: the file is otherwise whole.
    bare = rewrite_shard(copy, 1, "score", lambda t: t.replace_schema_metadata({}))

    rc, out, _ = inspect(capsys, copy, "verify")
    assert rc == 1, out
    lines = [line for line in out.splitlines() if line.startswith("corrupt:")]
    assert len(lines) == 4, out

    def named(i: int) -> str:
        return (
            f"corrupt: {shard} (column routes of step 2 rollout part-r0.parquet prompt_id "
            f"{rows[i]['prompt_id']} sample {rows[i]['sample_idx']}: "
        )

    fed = len(rows[short]["prompt_token_ids"]) + len(rows[short]["response_token_ids"]) - 1
    want = fed * SHAPE.per_token
    no_shape = "column routes of step 1 score part-r0.parquet: no rftpipe.routes metadata"
    assert lines[0] == f"corrupt: {bare} ({no_shape})"
    assert lines[1] == named(short) + (
        f"its routes hold {want - 1} bytes, not {want} ({fed} fed tokens x 2 layers x top-2))"
    )
    assert lines[2] == named(wild) + "its routes name expert 4 of 4)"
    assert lines[3] == named(missing) + "no routes for a trained row)"
    # The training side refuses the same cells.
    for cell, tokens in [(cells[short], fed), (cells[wild], len(cells[wild]) // SHAPE.per_token)]:
        with pytest.raises(UserError, match="the shard is corrupt or was edited"):
            decode(cell, tokens, SHAPE, "row")

    rc, out, _ = inspect(capsys, copy, "verify", "--json")
    audit = json.loads(out)
    assert rc == 1 and audit["checked"]["route_shards"] == 8
    assert [c["path"] for c in audit["corrupt"]] == [str(bare), *[str(shard)] * 3]


def test_routes_view_counts_the_committed_routes(
    moe_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = step_rows(moe_run, 1)
    routes = np.concatenate([decoded(r) for r in rows])
    want = np.stack([np.bincount(routes[:, i].ravel(), minlength=4) for i in range(2)])
    metrics = step_metrics(moe_run, 1)

    rc, out, err = inspect(capsys, moe_run, "routes", "--step", "1", "--json")
    assert rc == 0, err
    (rep,) = json.loads(out)
    assert (rep["step"], rep["column"], rep["rows"]) == (1, "routes", len(rows))
    assert rep["tokens"] == routes.shape[0]
    assert (rep["layers"], rep["experts"], rep["top_k"]) == (2, 4, 2)
    assert [layer["counts"] for layer in rep["per_layer"]] == want.tolist()
    imbalance = want.max(axis=1) / want.mean(axis=1)
    np.testing.assert_allclose([layer["imbalance"] for layer in rep["per_layer"]], imbalance)
    # What the trainer measured that step, as metrics.jsonl logged it; the noise makes the
    # replayed selections differ from the trainer's own.
    agreement = [layer["agreement"] for layer in rep["per_layer"]]
    assert agreement == [metrics[f"moe/agreement/l{i}"] for i in range(2)]
    assert rep["agreement"] == metrics["moe/agreement"] and 0 < rep["agreement"] < 1
    assert rep["aux_loss"] == metrics["train/moe_aux_loss"]

    rc, out, _ = inspect(capsys, moe_run, "routes")  # the newest step
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("step 2, column routes (the rollout's, replayed by R3): ")
    assert lines[2].split() == [
        "layer",
        "selections",
        "imbalance",
        "train_imb",
        "agreement",
        "busiest",
        "idle",
    ]
    assert [line.split()[0] for line in lines[3:5]] == ["0", "1"]
    assert lines[6].split() == ["layer", "e0", "e1", "e2", "e3"]

    rc, _, err = inspect(capsys, moe_run, "routes", "--step", "9")
    assert rc == 2 and err == "inspect: error: step 9 is not committed (committed: 1..2)\n"


def token_titles(doc: str) -> dict[tuple[int, int], list[tuple[str, int]]]:
    """(prompt_id, sample) -> each token's (title, id) in the sample's routes strip."""
    out = {}
    for article in re.findall(r'<article class="sample".*?</article>', doc, re.S):
        pid = int(re.search(r'data-prompt-id="(\d+)"', article)[1])
        sample = int(re.search(r'data-sample="(\d+)"', article)[1])
        toks = re.findall(r'<i title="([^"]*)">(\d+)</i>', article)
        out[(pid, sample)] = [(t, int(i)) for t, i in toks]
    return out


def test_html_titles_each_response_token_with_its_routes(
    moe_run: Path, dense_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "moe.html"
    rc, _, err = inspect(capsys, moe_run, "html", "--step", "2", "--out", out)
    assert rc == 0, err
    doc = out.read_text()
    got = token_titles(doc)
    rows = step_rows(moe_run, 2)
    assert set(got) == {(r["prompt_id"], r["sample_idx"]) for r in rows}
    for r in rows:
        routes, prompt = decoded(r), len(r["prompt_token_ids"])
        # Route j is the token fed at j: response token t's is prompt + t; the last token
        # was never fed.
        want = [
            " · ".join(f"L{i}: {','.join(map(str, routes[prompt + t, i]))}" for i in range(2))
            for t in range(len(r["response_token_ids"]) - 1)
        ]
        want.append("never fed: no route")
        assert got[(r["prompt_id"], r["sample_idx"])] == list(
            zip(want, r["response_token_ids"], strict=True)
        )
    # About 40 bytes a token here: the strips add less than the rest of the page.
    tokens = sum(len(r["response_token_ids"]) for r in rows)
    strips = sum(len(m) for m in re.findall(r'<div class="toks">.*?</div>', doc))
    assert strips < 50 * tokens

    # A page's budget spent: the samples past it say so instead.
    markup = page.RouteMarkup("routes", SHAPE, 600)
    parts = [markup.html(r) for r in rows[:3]]
    assert '<div class="toks">' in parts[0] and "routes not shown" in parts[-1]

    rc, _, err = inspect(capsys, dense_run, "html", "--out", tmp_path / "dense.html")
    assert rc == 0, err
    doc = (tmp_path / "dense.html").read_text()
    assert '<details class="routes">' not in doc and "with routes" not in doc


def test_plot_adds_a_router_panel(
    moe_run: Path, dense_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib.image as mpimg

    heights = {}
    for name, run in (("moe", moe_run), ("dense", dense_run)):
        png, data = tmp_path / f"{name}.png", tmp_path / f"{name}.csv"
        rc, _, err = inspect(capsys, run, "plot", "--out", png, "--data-out", data)
        assert rc == 0, err
        heights[name] = mpimg.imread(png).shape[0]
        header = data.read_text().splitlines()[0].split(",")
        assert ("moe/agreement" in header) == (name == "moe"), header
    assert (heights["dense"], heights["moe"]) == (700, 1000)
    series = [line.split(",") for line in (tmp_path / "moe.csv").read_text().splitlines()]
    col = series[0].index("moe/agreement")
    assert [float(s[col]) for s in series[1:]] == [
        step_metrics(moe_run, s)["moe/agreement"] for s in (1, 2)
    ]


def test_a_dense_run_reads_as_before(dense_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = inspect(capsys, dense_run, "verify")
    assert rc == 0 and "routes" not in out, out
    assert (
        "route_shards"
        not in json.loads(inspect(capsys, dense_run, "verify", "--json")[1])["checked"]
    )
    rc, out, err = inspect(capsys, dense_run, "routes")
    assert (rc, out) == (2, "")
    assert err == (
        f"inspect: error: step 1 of {dense_run} has no routes: a dense policy, or an MoE one "
        "that records none (train.router_replay=none)\n"
    )


def test_the_inspector_stays_torch_free(moe_run: Path, tmp_path: Path) -> None:
    """The routes are read with numpy: torch takes seconds to import on a login node."""
    code = (
        "import sys; from rftpipe.inspect.cli import main; "
        f"codes = [main([{str(moe_run)!r}, *a.split()]) for a in sys.argv[1:]]; "
        "print(codes, 'torch' in sys.modules)"
    )
    views = ["verify", "routes", f"html --out {tmp_path / 'p.html'}", "summary"]
    r = subprocess.run(
        [sys.executable, "-c", code, *views], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.stdout.splitlines()[-1] == "[0, 0, 0, 0] False", r.stdout + r.stderr


def test_the_shape_reads_back_from_its_metadata_and_refuses_a_partial_one() -> None:
    assert RouteShape.from_meta(SHAPE.to_meta()) == SHAPE
    with pytest.raises(ValueError, match="lacks 'top_k'"):
        RouteShape.from_meta({"layers": 2, "experts": 4})
