"""Vision-language runs through the whole pipeline on `builtin:tiny-vl`: image prompts
mixed with text ones, the image store and the rows' references, SIGKILLs at the fault
points and at random instants (bitwise equal to an uninterrupted run), corrupt images and
--repair, bad image input, and a learning test whose reward depends on the image alone."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import vision_task
from helpers import (
    ROOT,
    TESTS_ON_PATH,
    committed_hash,
    each_fault_stops_then_resumes,
    eval_rows,
    events,
    final_weights,
    kill_mid_turn_and_resume,
    stage_history,
    starts_vllm,
    submit,
    trajectories,
)

from rftpipe.stages import ORDER
from rftpipe.storage.images import IMAGES_DIR, ImageRef, stored_images
from tools.studies.vision_learning import FRESH, FRESH_IN_CI, parse_spec, write

pytestmark = pytest.mark.slow
IMAGE_PAD = 261  # builtin:tiny-vl's <|image_pad|> id (asserted in tests/test_vision.py)


vl_run = vision_task.vision_run


# A KL term and a critic put the reference's and the value model's forwards with images
# through the pipeline too; a checkpoint every 2 steps leaves train steps to replay after
# a kill. (1 and 2 ranks: tests/test_vision_dist.py.)
BASE = (
    "total_steps=4",
    "data.prompts_per_step=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "kl.mode=loss",
    "kl.coef=0.1",
    "train.micro_batch_size=4",
)
RUN = (*BASE, "advantage.estimator=gae", "advantage.estimator.lam=0.95", "critic.lr=1e-3")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vision_task.write_mixed_dataset(tmp_path_factory.mktemp("mixed"), 12, 3)


@pytest.fixture(scope="module")
def reference(mixed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    out = submit(run, *vl_run(mixed, *RUN), env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_rows_reference_each_image_once_in_the_store(reference: Path, mixed: Path) -> None:
    rows = trajectories(reference)
    assert rows.schema.metadata[b"rftpipe.schema_version"] == b"3"
    assert "values" in rows.column_names  # the critic scored the image rows
    data = [json.loads(x) for x in mixed.read_text().splitlines()]
    refs = set()
    for r in rows.to_pylist():
        want = data[r["prompt_id"]]["images"]
        assert len(r["images"]) == len(want)
        # One image token per 28x28 pixels: a 56x56 picture is 4 tokens.
        assert r["prompt_token_ids"].count(IMAGE_PAD) == 4 * len(want)
        for rel, name in zip(r["images"], want, strict=True):
            ref = ImageRef.parse(rel)
            assert (reference / rel).read_bytes() == (mixed.parent / name).read_bytes()
            refs.add(ref)
    # Every image once, however many samples and steps showed it; nothing else stored.
    assert {p.name for p in stored_images(reference)} == {f"{r.sha256}.{r.ext}" for r in refs}
    # Text and image rows shared the steps (and so the micro-batches of 4 rows).
    steps = {r["step"]: set() for r in rows.to_pylist()}
    for r in rows.to_pylist():
        steps[r["step"]].add(bool(r["images"]))
    assert any(kinds == {True, False} for kinds in steps.values())
    # pandas and DuckDB read the published Parquet, the images column included.
    import duckdb

    frame = rows.to_pandas()
    assert frame["images"].map(len).sum() == sum(len(x) for x in rows.column("images").to_pylist())
    got = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{reference}/trajectories/*/*.parquet') "
        "WHERE len(images) = 2"
    ).fetchall()
    assert got[0][0] == sum(len(x) == 2 for x in frame["images"]) > 0


def _kill_at_random_instant(run: Path, overrides: tuple[str, ...], rng: random.Random) -> None:
    """Start a resume, wait for its worker's start event, SIGKILL it after a random delay."""
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(ROOT / "configs" / "tiny_dense.yaml"), *overrides]
    seen = sum(e["event"] == "start" for e in events(run))
    with (run.parent / f"kill-{seen}.log").open("wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **TESTS_ON_PATH},
        )
    deadline = time.time() + 120
    while sum(e["event"] == "start" for e in events(run)) == seen and proc.poll() is None:
        assert time.time() < deadline, "the worker never started"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 2.0))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() in (0, -signal.SIGKILL)


# (fault point, hits to let pass first): a kill after a rollout shard is written (its
# images stored, the stage not committed), one mid train step, one mid checkpoint (whose
# resume replays the train steps since the previous checkpoint).
SCHEDULE = [
    ("shard_after_rename", 4),
    ("train_mid_step", 1),
    ("ckpt_mid_write", 0),
]


def test_a_killed_vision_run_resumes_bitwise(reference: Path, mixed: Path, tmp_path: Path) -> None:
    overrides = vl_run(mixed, *RUN)
    run = tmp_path / "chaos"
    for point, skip in SCHEDULE:
        env = {**TESTS_ON_PATH, "RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(skip)}
        assert submit(run, *overrides, env=env).returncode != 0, point
    _kill_at_random_instant(run, overrides, random.Random(25))
    out = submit(run, *overrides, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]

    assert {e["point"] for e in events(run) if e["event"] == "fault"} == {p for p, _ in SCHEDULE}
    assert any(e["event"] == "replay" for e in events(run)), "no train step was replayed"
    for key, seq in stage_history(run).items():
        assert seq.count("commit") == 1, (key, seq)
        assert "begin" not in seq[seq.index("commit") + 1 :], (key, seq)
    assert set(stage_history(run)) == {(s, st) for s in range(1, 5) for st in ORDER}
    a, b = trajectories(reference), trajectories(run)
    assert a.num_rows == b.num_rows == 4 * 4 * 2
    assert a.equals(b), "trajectories differ from the uninterrupted run"
    wa, wb = final_weights(reference), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [p.name for p in stored_images(run)] == [p.name for p in stored_images(reference)]


def _image_of_step(run: Path, step: int) -> Path:
    """A stored image that the rows of `step` show."""
    rows = trajectories(run).to_pylist()
    return run / next(r["images"][0] for r in rows if r["step"] == step and r["images"])


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_corrupt_or_missing_image_is_refused_then_repaired_from_the_dataset(
    reference: Path, mixed: Path, tmp_path: Path, damage: str
) -> None:
    """Without its step-4 checkpoint the restart replays steps 3 and 4 from their rows,
    whose images it reads: the damage is found before, named in one line."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(reference), str(run)], check=True)
    subprocess.run(["rm", "-r", str(run / "checkpoints" / "step=4")], check=True)
    victim = _image_of_step(run, 3)
    good = victim.read_bytes()
    if damage == "corrupt":
        victim.write_bytes(good[:-7] + b"garbage")
    else:
        victim.unlink()
    before = committed_hash(run)
    more = vl_run(mixed, *RUN[1:], "total_steps=5")
    out = submit(run, *more, config=None, env=TESTS_ON_PATH)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert victim.name in lines[0] and damage in lines[0] and "--repair" in lines[0], lines
    assert committed_hash(run) == before, "a refused resume touched the run"
    out = submit(run, *more, config=None, env=TESTS_ON_PATH, extra=("--repair",))
    assert out.returncode == 0, out.stderr[-3000:]
    assert victim.read_bytes() == good
    assert any(e["event"] == "repair_images" for e in events(run))
    assert (run / "stages" / "step=5" / "train" / "MANIFEST.json").exists()


def test_verify_reports_an_image_gone_from_the_store(reference: Path, tmp_path: Path) -> None:
    """`rftpipe inspect RUN verify` reads every committed row's `images` and names each
    missing file with the first step and stage found referencing it."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(reference), str(run)], check=True)
    rel = trajectories(run).column("images").to_pylist()[0][0]
    first = min(r["step"] for r in trajectories(run).to_pylist() if rel in r["images"])
    (run / rel).unlink()
    cmd = [sys.executable, "-m", "rftpipe.inspect", str(run), "verify"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = [x for x in out.stdout.splitlines() if rel in x]
    assert line.startswith("missing image:") and f"step {first} " in line, line
    assert line.split()[-1].rstrip(")") in ORDER, line
    assert "0 corrupt file(s), 1 missing image(s)" in out.stdout
    js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, cwd=ROOT, check=False)
    (gone,) = json.loads(js.stdout)["missing_images"]
    assert js.returncode == 1 and gone["path"] == str(run / rel) and gone["step"] == first


def test_a_dataset_image_gone_on_resume_exits_2_and_touches_nothing(tmp_path: Path) -> None:
    data = vision_task.write_mixed_dataset(tmp_path / "data", 6, 5)
    run = tmp_path / "run"
    steps = (*BASE[1:], "total_steps=1")
    # First a start refused at load (image rows for a text-only model): it committed
    # nothing, so the corrected command starts the directory afresh rather than being
    # refused as a resume with a different config.
    out = submit(run, *vl_run(data, *steps, "model.path=builtin:tiny"), env=TESTS_ON_PATH)
    assert out.returncode == 2 and "text-only" in out.stderr, out.stderr[-3000:]
    out = submit(run, *vl_run(data, *steps), env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "builtin:tiny-vl" in (run / "config.yaml").read_text()
    assert [e["event"] for e in events(run)].count("start") == 1
    before = committed_hash(run)
    first = json.loads(data.read_text().splitlines()[0])["images"][0]
    (data.parent / first).unlink()
    out = submit(run, *vl_run(data, *steps[:-1], "total_steps=2"), config=None, env=TESTS_ON_PATH)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "row 0" in line and "'images'[0]" in line and "cannot read" in line, line
    assert committed_hash(run) == before


def _load(rows: list[dict], folder: Path, model: str = "builtin:tiny-vl", **data: Any) -> Any:
    """`load_prompts` of a JSON-lines dataset of `rows` in `folder`, as a run loads it
    (`data`: more `DataConfig` fields)."""
    from rftpipe.config.schema import DataConfig, DatasetSourceConfig
    from rftpipe.data.prompts import load_prompts
    from rftpipe.engines.models import is_vision_model, load_tokenizer, resolve_model_path
    from rftpipe.engines.vision import VisionEncoder

    path = folder / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(source="datasets", datasets=(DatasetSourceConfig(path=str(path)),), **data)
    model_dir = resolve_model_path(model)
    encoder = VisionEncoder.load(model_dir) if is_vision_model(model_dir) else None
    return load_prompts(cfg, load_tokenizer(model_dir), encoder)


@pytest.mark.parametrize(
    ("row", "field", "why"),
    [
        ({"prompt": "<image>Answer.", "images": ["missing.png"]}, "'images'[0]", "cannot read"),
        ({"prompt": "<image>Answer.", "images": ["a.png", "a.png"]}, "'prompt'", "2 images"),
        ({"prompt": "<image><image>Answer.", "images": ["a.png"]}, "'prompt'", "1 images"),
        ({"prompt": "<image>Answer.", "images": ["broken.png"]}, "'images'[0]", "decode"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "video"}]}], "images": []},
            "'prompt' message 0 part 0",
            "videos are not supported",
        ),
        ({"prompt": "<video>Answer.", "videos": ["a.mp4"]}, "'videos'", "not supported"),
    ],
    ids=["missing", "more-images", "fewer-images", "unreadable", "video-part", "video-column"],
)
def test_bad_image_input_is_one_line_naming_the_row(
    tiny_vl: Path, tmp_path: Path, row: dict, field: str, why: str
) -> None:
    from rftpipe.errors import UserError

    (tmp_path / "a.png").write_bytes(vision_task.picture("red", 1))
    (tmp_path / "broken.png").write_bytes(vision_task.picture("red", 1)[:60])
    good: dict = {"prompt": "Answer.", "answer": "x", "images": []}
    if isinstance(row["prompt"], list):  # a JSON-lines column holds one type
        good["prompt"] = [{"role": "user", "content": [{"type": "text", "text": "Answer."}]}]
    with pytest.raises(UserError) as err:
        _load([good, good, {"answer": "x", **row}], tmp_path)
    line = str(err.value)
    assert "\n" not in line and "row 2" in line and field in line and why in line, line


@pytest.mark.tier1
def test_image_prompts_for_a_text_only_model_are_refused(tiny_vl: Path, tmp_path: Path) -> None:
    from rftpipe.errors import UserError

    (tmp_path / "a.png").write_bytes(vision_task.picture("red", 1))
    rows = [
        {"prompt": "Answer.", "answer": "x", "images": []},
        {"prompt": "<image>Answer.", "answer": "x", "images": ["a.png"]},
    ]
    with pytest.raises(UserError, match=r"row 1 of .*text-only"):
        _load(rows, tmp_path, "builtin:tiny")


@pytest.mark.parametrize("overlong", ["error", "truncate"])
def test_an_overlong_image_row_counts_its_image_tokens_and_offers_no_truncation(
    tiny_vl: Path, tmp_path: Path, overlong: str
) -> None:
    """The text row fits in 28 tokens, the image row's 4 image tokens take it past them:
    the refusal says they count, and never offers truncation, which would refuse it too."""
    from rftpipe.errors import UserError

    (tmp_path / "a.png").write_bytes(vision_task.picture("red", 1))
    rows = [
        {"prompt": "Answer.", "answer": "x", "images": []},
        {"prompt": "<image>Answer.", "answer": "x", "images": ["a.png"]},
    ]
    assert len(_load(rows[:1], tmp_path, max_prompt_tokens=28).prompts) == 1
    with pytest.raises(UserError) as err:
        _load(rows, tmp_path, max_prompt_tokens=28, overlong=overlong)
    line = str(err.value)
    assert "row 1" in line and "image tokens included" in line and "> data.max_prompt" in line
    assert "overlong=truncate" not in line and "filter|truncate" not in line, line
    assert "data.overlong=filter" in line and "data.images.max_pixels" in line, line


def test_the_images_enter_the_data_fingerprint_and_the_held_out_key(
    tiny_vl: Path, tmp_path: Path
) -> None:
    from rftpipe.data.prompts import content_key

    for i, colour in enumerate(("red", "blue")):
        (tmp_path / f"{i}.png").write_bytes(vision_task.picture(colour, i))
    rows = [{"prompt": "<image>Answer.", "answer": "x", "images": [f"{i}.png"]} for i in (0, 1)]
    first = _load(rows, tmp_path)
    # The same question about another picture is another problem (for the held-out split).
    assert content_key(first.prompts[0]) != content_key(first.prompts[1])
    (tmp_path / "1.png").write_bytes(vision_task.picture("red", 7))  # same size, new pixels
    second = _load(rows, tmp_path)
    assert first.prompts[1].token_ids == second.prompts[1].token_ids
    assert first.fingerprint() != second.fingerprint()


@pytest.mark.parametrize("fresh", FRESH_IN_CI, ids=[FRESH[i] for i in FRESH_IN_CI])
def test_the_policy_learns_to_use_the_image(tmp_path: Path, fresh: int) -> None:
    """The recipe (`vision_task.LEARN`) on a fresh dataset of each generator of
    tools/studies/vision_learning.py (seed and colour pair never used in choosing it) and on its
    control, whose pictures carry no colour (docs/vision.md, "The learning test")."""
    spec = parse_spec(FRESH[fresh])
    step = vision_task.final_step(vision_task.LEARN)
    result = {}
    for arm, informative in (("vlm", True), ("control", False)):
        data = write(tmp_path / "data", spec, vision_task.ROWS, informative)
        out = submit(tmp_path / arm, *vl_run(data, *vision_task.LEARN), env=TESTS_ON_PATH)
        assert out.returncode == 0, out.stderr[-3000:]
        result[arm] = vision_task.held_out_reward(tmp_path / arm, step)
    print(result)
    vlm, control = result["vlm"], result["control"]
    assert vlm["mean"] > vlm["bound"] + 0.2, vlm
    assert abs(control["mean"] - control["bound"]) <= 2 * control["se"], control
    # Both arms' rows went through the image path (the control's pictures are the same
    # noise tinted with the pair's mean colour).
    for arm in ("vlm", "control"):
        images = trajectories(tmp_path / arm).column("images")
        assert all(len(refs) == 1 for refs in images.to_pylist()), arm
    # Every step drew 2 prompts of each colour (`data.balance_by=answer`).
    rows = trajectories(tmp_path / "vlm").to_pylist()
    drawn = Counter(
        (r["step"], vision_task.parity_of(json.loads(r["metadata"])))
        for r in rows
        if r["sample_idx"] == 0
    )
    assert sorted(drawn.values()) == [2] * 2 * step, drawn


@starts_vllm
def test_a_vllm_vision_run_with_a_frozen_tower(mixed: Path, tiny_vl: Path, tmp_path: Path) -> None:
    """vLLM (on CPU through `rftpipe.engines.rollout.vllm_cpu_vl`) rolls out the image
    prompts; its logprobs agree with the trainer's before and after a weight sync that
    leaves the frozen tower out, and the tower keeps its initial weights."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    steps = (*BASE[1:], "total_steps=2", "rollout.engine=vllm", "train.freeze_vision=true")
    out = submit(run, *vl_run(mixed, *steps), env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    diffs = [m["rollout/logprob_abs_diff_max"] for m in metrics if m.get("step", 0) >= 1]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    assert any(trajectories(run).column("images").to_pylist())
    initial = load_file(tiny_vl / "model.safetensors")
    final = final_weights(run)
    tower = [k for k in final if "visual." in k]
    assert tower and all(torch.equal(final[k], initial[k]) for k in tower)
    text = [k for k in final if "visual." not in k and k in initial]
    assert any(not torch.equal(final[k], initial[k]) for k in text)


EPISODES = (
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=3",
    "rollout.env.max_total_tokens=200",
    "total_steps=2",
    # The trainer's logprobs beside the HF loop's, over every turn of the episodes.
    "train.old_logprobs=actor",
)


def test_multi_turn_episodes_on_image_prompts_resume_bitwise(mixed: Path, tmp_path: Path) -> None:
    """`rollout.env` on image prompts (mixed with text ones): the episode's prompt holds
    its images' tokens, the HF loop continues each episode's cache over 3 turns (the
    images prefilled once), and the trainer's logprobs over the whole episodes agree with
    the sampled ones. Killed in the middle of step 2's third turn, the resumed run (its
    caches rebuilt by replaying the committed turns, the first with the images) is bitwise
    the uninterrupted one."""
    steps = vl_run(mixed, *BASE[1:], *EPISODES)
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = submit(ref, *steps, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(ref).to_pylist()
    pictured = [r for r in t if r["images"]]
    assert pictured and len(pictured) < len(t)
    for r in pictured:
        pads = r["prompt_token_ids"].count(IMAGE_PAD)
        assert pads > len(r["images"])  # expanded to the images' token counts
        env_tokens = zip(r["response_token_ids"], r["loss_mask"], strict=True)
        assert IMAGE_PAD not in [x for x, m in env_tokens if not m]
    assert max(r["num_turns"] for r in pictured) == 3
    metrics = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    diffs = [m["rollout/logprob_abs_diff_max"] for m in metrics if m.get("step", 0) >= 1]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    # Step 2's third turn (4 calls a turn) is hit 21 after step 1's 3 turns and 8 more.
    kill_mid_turn_and_resume(ref, run, steps, TESTS_ON_PATH, skip=21, resumed=[(2, 2)])


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ("DropsImages", "gave messages with 0 image parts for the prompt's 2 images"),
        ("SpellsImagePad", "holds an image; environments answer with text only so far"),
    ],
)
def test_an_environment_that_loses_or_adds_images_exits_2(
    mixed: Path, tmp_path: Path, env: str, said: str
) -> None:
    """An environment whose reset drops an image prompt's image parts, or whose
    observation spells the image token: one line naming the environment and the episode,
    exit 2, no stage committed."""
    run = tmp_path / "run"
    steps = vl_run(mixed, *BASE[1:], *EPISODES, f"rollout.env.path=envs_toy:{env}")
    out = submit(run, *steps, env=TESTS_ON_PATH)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert f"envs_toy:{env}" in line and said in line and "prompt_id" in line, line
    assert not any(e["event"] == "commit" for e in events(run))


@starts_vllm
def test_multi_turn_image_episodes_on_vllm_agree_with_the_trainer(
    mixed: Path, tmp_path: Path
) -> None:
    """vLLM (which keeps no cache between turns) gets each image episode's images with
    every turn's request; its logprobs over 3-turn episodes agree with the trainer's.
    Held-out evaluation runs greedy and sampled image episodes too."""
    run = tmp_path / "run"
    held_out = ("eval.size=8", "eval.holdout_fraction=0.4", "eval.samples=1", "eval.metric=env")
    steps = vl_run(mixed, *BASE[1:], *EPISODES, *held_out, "rollout.engine=vllm")
    out = submit(run, *steps, "data.prompts_per_step=2", env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(run).to_pylist()
    assert {r["num_turns"] for r in t if r["images"]} == {3}
    for step in (0, 2):
        rows = eval_rows(run, step).to_pylist()
        pictured = [(r["mode"], r["num_turns"]) for r in rows if r["images"]]
        assert {"greedy", "sampled"} == {m for m, _ in pictured}
        assert {n for _, n in pictured} == {3}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    diffs = [m["rollout/logprob_abs_diff_max"] for m in metrics if m.get("step", 0) >= 1]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs


def test_a_saved_hf_dataset_with_image_features_loads(tiny_vl: Path, tmp_path: Path) -> None:
    """`data.datasets` on a `save_to_disk` directory whose `images` column is a list of
    `datasets.Image` features, mixed with a row without images."""
    import datasets

    from rftpipe.config.schema import DataConfig, DatasetSourceConfig
    from rftpipe.data.prompts import load_prompts
    from rftpipe.engines.models import load_tokenizer
    from rftpipe.engines.vision import VisionEncoder

    pictures = [tmp_path / f"{c}.png" for c in vision_task.COLOURS]
    for path, colour in zip(pictures, vision_task.COLOURS, strict=True):
        path.write_bytes(vision_task.picture(colour, 3))
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["<image> then <image>?", "No picture."],
            "answer": ["a", "b"],
            "images": [[str(p) for p in pictures], []],
        },
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "answer": datasets.Value("string"),
                "images": [datasets.Image()],
            }
        ),
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(
        source="datasets", datasets=(DatasetSourceConfig(path=str(tmp_path / "saved")),)
    )
    got = load_prompts(cfg, load_tokenizer(tiny_vl), VisionEncoder.load(tiny_vl)).prompts
    assert [len(p.images) for p in got] == [2, 0]
    assert [im.data for im in got[0].images] == [p.read_bytes() for p in pictures]
    assert got[0].token_ids.count(IMAGE_PAD) == 8 and IMAGE_PAD not in got[1].token_ids
    assert "images" not in got[0].metadata  # the pictures travel once, not in every row


def test_a_full_disk_at_the_image_store_stops_with_one_line_and_resumes(
    reference: Path, mixed: Path, tmp_path: Path
) -> None:
    """`EDQUOT`, then a real full file system, at the first image the rollout stores (issue
    51): each start stops with one line naming it, exit 75, no temporary file; the resumed
    run equals the uninterrupted one."""
    overrides = vl_run(mixed, *RUN)
    # A tiny-vl checkpoint needs ~313 MiB (the pre-checkpoint check counts it).
    done = each_fault_stops_then_resumes(
        tmp_path / "fs", 1 << 30, f"/{IMAGES_DIR}/", overrides, TESTS_ON_PATH, tmp_path / "copy"
    )
    assert trajectories(reference).equals(trajectories(done))
    wa, wb = final_weights(reference), final_weights(done)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
