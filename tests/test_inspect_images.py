"""Inspecting a run whose samples saw images (trajectory schema version 3): `samples` lists
each sample's images, `html` writes one self-contained page that a real headless browser
renders with every image decoded, and pandas/DuckDB read the `images` column.

The runs are written by hand, as the stages lay them out (a published trajectory shard,
the train stage's manifest, the image store filled by `ImageStore.put`): the inspector
reads only those files, and a real vision run would cost a model build and a step.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, png

from rftpipe.inspect.cli import main
from rftpipe.storage.images import ImageRef, ImageStore
from rftpipe.storage.layout import VISION_SCHEMA_VERSION, RunDir

XSS = '<script>document.body.dataset.pwned="1"</script><img src=x onerror="document.title=1">'
"""An untrusted response: the page must show it as text, never run it."""
MAGENTA = (255, 0, 255)


def image_bytes(fmt: str, size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


SCHEMA = pa.schema(
    [
        ("prompt_id", pa.int64()),
        ("sample_idx", pa.int32()),
        ("rank", pa.int32()),
        ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response", pa.string()),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_length", pa.int32()),
        ("finish_reason", pa.string()),
        ("logprobs", pa.list_(pa.float32())),
        ("reward_correct", pa.float64()),
        ("reward_status", pa.string()),
        ("reward_error", pa.string()),
        ("reward", pa.float64()),
        ("advantages", pa.list_(pa.float32())),
    ]
)
EPISODE_SCHEMA = [
    ("loss_mask", pa.list_(pa.int8())),
    ("turn_offsets", pa.list_(pa.int32())),
    ("turn_rewards", pa.list_(pa.float64())),
    ("turn_infos", pa.list_(pa.string())),
    ("num_turns", pa.int32()),
    ("env_reward", pa.float64()),
    ("episode_status", pa.string()),
    ("messages", pa.string()),
]


def write_run(root: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> Path:
    """A run of one committed step: the published shard and the train manifest (what
    `open_run` counts as committed)."""
    run = RunDir(root)
    shard = run.trajectories / "step=1" / "part-r0.parquet"
    shard.parent.mkdir(parents=True)
    meta = {"rftpipe.schema_version": VISION_SCHEMA_VERSION, "rftpipe.step": "1"}
    table = pa.Table.from_pylist(rows, schema=schema.with_metadata(meta))
    pq.write_table(table, shard)
    run.manifest_path(1, "train").parent.mkdir(parents=True)
    run.manifest_path(1, "train").write_text(json.dumps({"metrics": {}}))
    return root


def row(pid: int, k: int, prompt: str, response: str, reward: float, adv: list[float]) -> dict:
    n = len(adv)
    return {
        "prompt_id": pid,
        "sample_idx": k,
        "rank": 0,
        "prompt": prompt,
        "prompt_token_ids": [1, 2, 3],
        "response": response,
        "response_token_ids": list(range(n)),
        "response_length": n,
        "finish_reason": "stop",
        "logprobs": [-1.0] * n,
        "reward_correct": reward,
        "reward_status": "ok",
        "reward_error": None,
        "reward": reward,
        "advantages": adv,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A single-turn vision run (an image prompt of three images, a text prompt, a prompt
    whose image is missing from the store and one whose file was altered), the same rows
    as a text-only run, and a multi-turn vision run."""
    base = tmp_path_factory.mktemp("inspect-images")
    root = base / "vision"
    store = ImageStore(root)
    files = {
        "magenta": image_bytes("PNG", (120, 90), MAGENTA),
        "noise": png(3, width=56, height=42),
        "jpeg": image_bytes("JPEG", (64, 48), (0, 128, 0)),
    }
    refs = {k: store.put(v, "jpeg" if k == "jpeg" else "png").relpath for k, v in files.items()}
    missing = ImageRef(sha256="ab" * 32, ext="png").relpath
    altered = store.put(png(4), "png")
    store.path(altered).write_bytes(b"not an image any more")
    images = [
        [refs["magenta"], refs["noise"], refs["jpeg"]],
        [refs["magenta"], refs["noise"], refs["jpeg"]],
        [],
        [],
        [missing],
        [altered.relpath],
    ]
    rows = [
        row(0, 0, "What colour is <image> <image> <image>?", "magenta", 1.0, [0.5, 0.5]),
        row(0, 1, "What colour is <image> <image> <image>?", XSS, 0.0, [-0.5, -0.5, -0.5]),
        row(1, 0, "2+2=", "4", 1.0, [0.25, 0.75]),
        row(1, 1, "2+2=", "five\x03", 0.0, [-1.0]),
        row(2, 0, "Describe <image>.", "a cat", 0.5, [0.0]),
        row(3, 0, "Describe <image>.", "a dog", 0.5, [0.0]),
    ]
    rows[-1] |= {"reward_status": "error", "reward_error": "colour: ValueError: <no colour>"}
    vision_schema = SCHEMA.append(pa.field("images", pa.list_(pa.string())))
    write_run(
        root, [{**r, "images": im} for r, im in zip(rows, images, strict=True)], vision_schema
    )
    text = write_run(base / "text", rows, SCHEMA)

    # Its own run directory, so its own store.
    assert ImageStore(base / "episodes").put(files["noise"], "png").relpath == refs["noise"]
    episode_rows = []
    for k in range(2):
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Which shape?"}],
            },
            {"role": "assistant", "content": f"a circle {k}"},
            {"role": "user", "content": "No <b>look</b> again."},
            {"role": "assistant", "content": "a square"},
        ]
        episode_rows.append(
            {
                **row(7, k, "Which shape?", "a square", 1.0, [0.5, 0.5, 0.0, 0.0, -0.25]),
                "images": [refs["noise"]],
                "loss_mask": [1, 1, 0, 0, 1],
                "turn_offsets": [0, 4],
                "turn_rewards": [0.0, 1.0],
                "turn_infos": ["{}", '{"solved": true}'],
                "num_turns": 2,
                "env_reward": 1.0,
                "episode_status": "done",
                "messages": json.dumps(messages),
            }
        )
    episode_schema = vision_schema
    for name, t in EPISODE_SCHEMA:
        episode_schema = episode_schema.append(pa.field(name, t))
    episodes = write_run(base / "episodes", episode_rows, episode_schema)
    return {
        "vision": root,
        "text": text,
        "episodes": episodes,
        "files": files,
        "refs": refs,
        "images": images,
        "missing": missing,
        "altered": altered.relpath,
    }


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> str:
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_samples_lists_each_samples_images(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_main(capsys, runs["vision"], "samples", "--limit", "100")
    refs = runs["refs"]
    blocks = out.split("== step ")[1:]
    assert len(blocks) == 6
    shown = [
        [
            f"    {refs['magenta']}  120x90 PNG",
            f"    {refs['noise']}  56x42 PNG",
            f"    {refs['jpeg']}  64x48 JPEG",
        ]
    ] * 2
    shown += [[], []]
    shown += [[f"    {runs['missing']}  error: missing from the image store"]]
    shown += [[f"    {runs['altered']}  error: not a readable image (UnidentifiedImageError)"]]
    for block, want in zip(blocks, shown, strict=True):
        lines = block.splitlines()
        at = lines.index("  prompt:")
        if want:
            assert lines[at - 1 - len(want) : at] == [f"  images ({len(want)}):", *want]
        else:
            assert lines[at - 1] == "  images: none"

    # The same rows without the images column (a text-only run) print as they did before
    # the column existed: the vision run's output less its image lines.
    text = run_main(capsys, runs["text"], "samples", "--limit", "100")
    assert "  images" not in text
    without = [x for x in out.splitlines() if not re.match(r"  images|    images/", x)]
    assert text.splitlines() == without


def test_samples_prints_a_vision_episodes_image_parts(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_main(capsys, runs["episodes"], "samples")
    lines = out.splitlines()
    assert f"    {runs['refs']['noise']}  56x42 PNG" in lines
    assert "    [user] [image]Which shape?" in lines
    assert "  turn 2: reward 1, 1 model + 0 environment tokens, ends the episode: done" in lines


class Page(HTMLParser):
    """The page's <img> tags, error boxes, sample articles and turns, as parsed."""

    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []
        self.errors: list[str | None] = []
        self.samples: list[dict[str, str | None]] = []
        self.turns = 0
        self.scripts = 0
        self.body: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        elif tag == "script":
            self.scripts += 1
        elif tag == "body":
            self.body = a
        elif "img-error" in (a.get("class") or ""):
            self.errors.append(a.get("data-relpath"))
        elif tag == "article":
            self.samples.append(a)
        elif a.get("class") == "turn":
            self.turns += 1


def parse(doc: str) -> Page:
    p = Page()
    p.feed(doc)
    return p


def test_html_page_embeds_each_image_and_escapes_text(runs: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    assert main([str(runs["vision"]), "html", "--step", "1", "--out", str(out)]) == 0
    doc = out.read_text(encoding="utf-8")
    page = parse(doc)
    refs, files = runs["refs"], runs["files"]
    # The image prompt's group shows its three images once; both broken images are boxes.
    assert [i["data-relpath"] for i in page.imgs] == [refs["magenta"], refs["noise"], refs["jpeg"]]
    for img in page.imgs:
        kind = [k for k, v in refs.items() if v == img["data-relpath"]][0]
        mime, data = (img["src"] or "").split(",", 1)
        assert mime == f"data:image/{'jpeg' if kind == 'jpeg' else 'png'};base64"
        assert base64.b64decode(data) == files[kind]
    assert page.errors == [runs["missing"], runs["altered"]]
    assert "missing from the image store" in doc and "disagree with their sha256 name" in doc
    assert [(s["data-prompt-id"], s["data-sample"]) for s in page.samples] == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
        ("2", "0"),
        ("3", "0"),
    ]
    # Untrusted text is text: the response's markup is escaped, its control byte visible;
    # the page's one script is its own, and nothing is fetched from anywhere.
    assert page.scripts == 1 and "pwned" not in doc.split("<script>")[1].split("</script>")[0]
    assert "&lt;script&gt;document.body.dataset.pwned=&quot;1&quot;&lt;/script&gt;" in doc
    assert "five\\x03" in doc
    assert not re.search(r"(src|href)=\"(?!data:)", doc)
    # Rewards and advantages: a constant advantage once, a varying one as mean/min/max.
    assert "0.5 on each of 2 token(s)" in doc
    assert "mean 0.5, min 0.25, max 0.75 over 2 token(s)" in doc
    assert "error: colour: ValueError: &lt;no colour&gt;" in doc

    # A text-only run's page: the same samples, and no image section at all.
    assert main([str(runs["text"]), "html", "--out", str(out)]) == 0
    doc = out.read_text(encoding="utf-8")
    text = parse(doc)
    assert len(text.samples) == 6 and not text.imgs and not text.errors
    assert "no images" not in doc and "with images" not in doc


def test_html_page_of_a_multi_turn_vision_run(runs: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "episodes.html"
    assert main([str(runs["episodes"]), "html", "--out", str(out)]) == 0
    doc = out.read_text(encoding="utf-8")
    page = parse(doc)
    assert len(page.imgs) == 1 and len(page.samples) == 2 and page.turns == 4
    # The environment's tokens (loss_mask 0) carry no advantage: turn 1 is its two model
    # tokens, turn 2 its one.
    assert "advantage 0.5 on each of 2 token(s)" in doc
    assert "advantage -0.25 on each of 1 token(s)" in doc
    assert "[user] [image]Which shape?" in doc
    assert "No &lt;b&gt;look&lt;/b&gt; again." in doc
    assert "info {&quot;solved&quot;: true}" in doc


def test_pandas_and_duckdb_read_the_images_column(runs: dict[str, Any]) -> None:
    traj = runs["vision"] / "trajectories"
    df = pd.read_parquet(traj).sort_values(["prompt_id", "sample_idx"])
    assert [list(x) for x in df["images"]] == runs["images"]
    import duckdb

    glob = str(traj / "*" / "*.parquet")
    got = duckdb.sql(
        f"select prompt_id, sample_idx, images, len(images) from read_parquet('{glob}', "
        "hive_partitioning = true) order by prompt_id, sample_idx"
    ).fetchall()
    assert [g[2] for g in got] == runs["images"]
    assert [g[3] for g in got] == [len(x) for x in runs["images"]]
    # A store path per entry: the reader can open the file under the run directory.
    ((first,),) = duckdb.sql(f"select images[1] from read_parquet('{glob}') limit 1").fetchall()
    assert (runs["vision"] / first).is_file()


def browser() -> str:
    """Debian's headless Chromium (`.ci/run` installs it); the test fails without it
    under CI, skips elsewhere."""
    for name in ("chromium-headless-shell", "chromium"):
        if found := shutil.which(name):
            return found
    if os.environ.get("CI"):
        pytest.fail("CI is set and no chromium-headless-shell on PATH (apt-get install it)")
    pytest.skip("no chromium-headless-shell (apt-get install -y chromium-headless-shell)")


def chromium(*args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_the_page_renders_in_headless_chromium(runs: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    r = subprocess.run(
        [sys.executable, "-m", "rftpipe.inspect", str(runs["vision"]), "html", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    url = out.resolve().as_uri()
    # --virtual-time-budget lets the page load and its load handler run before the dump.
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = parse(dom.stdout)
    assert page.body.get("data-images-total") == page.body.get("data-images-loaded") == "3"
    assert "data-pwned" not in dom.stdout  # the response's script never ran
    sizes = {runs["refs"][k]: s for k, s in (("magenta", "120x90"), ("noise", "56x42"))}
    sizes[runs["refs"]["jpeg"]] = "64x48"
    for img in page.imgs:
        assert img["data-loaded"] == "yes", img["data-relpath"]
        assert img["data-natural-size"] == sizes[str(img["data-relpath"])]
    assert len(page.errors) == 2

    # And it is painted: the magenta picture covers its 120x90 pixels of the screenshot.
    shot = tmp_path / "page.png"
    r = chromium("--window-size=1000,1200", "--hide-scrollbars", f"--screenshot={shot}", url)
    assert r.returncode == 0, r.stderr[-2000:]
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    magenta = np.all(np.abs(pixels - np.array(MAGENTA)) <= 8, axis=-1)
    ys, xs = np.nonzero(magenta)
    assert magenta.sum() == 120 * 90, magenta.sum()
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (90, 120)

    # Defence in depth: had the response's markup escaped the escaping, the page's
    # Content-Security-Policy (only its own script, by hash) would still not run it.
    raw = tmp_path / "unescaped.html"
    escaped = "&lt;script&gt;document.body.dataset.pwned=&quot;1&quot;&lt;/script&gt;"
    doc = out.read_text(encoding="utf-8")
    assert escaped in doc
    raw.write_text(doc.replace(escaped, '<script>document.body.dataset.pwned="1"</script>'))
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", raw.resolve().as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<script>document.body.dataset.pwned="1"</script>' in dom.stdout
    assert "data-pwned" not in dom.stdout
    assert parse(dom.stdout).body.get("data-images-loaded") == "3"  # the page's own did run


def test_an_entry_naming_a_file_outside_the_store_is_an_error(runs: dict[str, Any]) -> None:
    from rftpipe.inspect import images

    root = runs["vision"]
    sha = runs["refs"]["noise"].split("/")[2].partition(".")[0]
    (root / "secret.png").write_bytes(runs["files"]["noise"])
    # ImageRef.parse alone takes these: an extension with a path in it, a non-hex name.
    for bad in (f"images/{sha[:2]}/{sha}.png/../../../secret.png", f"images/zz/{'z' * 64}.png"):
        for got in (images.header(root, bad), images.load(root, bad)):
            assert got.error == f"not an image store path: {bad!r}" and got.data_uri is None
