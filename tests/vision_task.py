"""A synthetic image task for the vision-language tests, whose reward depends on the image
alone: every prompt reads the same ("<image>Answer." unless told), its picture is mostly
one colour of a pair or mostly the other (red and blue unless told), and a response earns
the share of its tokens whose parity the colour names (even ids for the pair's first
colour, odd for its second). Imported by path in the reward worker processes.

A policy that does not see the image cannot do better than 0.5 in expectation on a
balanced set: whatever it emits, a token's parity is right under one colour and wrong
under the other, so its expected share of right tokens is exactly 1/2 (the image-blind
bound the learning test compares with).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = "<image>Answer."
COLOURS = ("red", "blue")
# verl's layout for a new user's task: chat messages whose string content holds the
# placeholder, the pictures in an `images` column.
VERL_PROMPT = "<image>What colour is the image? Answer with one word."
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "orange": (255, 128, 0),
    "purple": (128, 0, 255),
    "teal": (0, 128, 128),
    "white": (255, 255, 255),
}


def picture(colour: str | tuple[str, ...], seed: int, size: int = 56) -> bytes:
    """A noisy picture dominated by `colour` (a `PALETTE` name), as PNG bytes (each seed
    another picture). A tuple of names tints it with their mean: given a pair, a picture
    that says nothing about which of the two a row names."""

    names = (colour,) if isinstance(colour, str) else colour
    tint = np.mean([PALETTE[c] for c in names], axis=0) / 255
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 90, (size, size, 3), dtype=np.int64)
    pixels += np.rint(tint * (150 + rng.integers(0, 16))).astype(np.int64)
    return _png(pixels)


def _png(pixels: np.ndarray) -> bytes:
    """An RGB picture's pixels (any integer or float values, clipped to 0-255) as PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_dataset(
    folder: Path,
    rows: int,
    seed: int,
    *,
    colours: tuple[str, str] = COLOURS,
    informative: bool = True,
    layout: str = "plain",
) -> tuple[Path, Path]:
    """`rows` prompts, colours alternating, as two JSON-lines files, one per colour (the
    pair's first colour, then its second; `vision_run` mixes them so that every step
    draws as many prompts of each), with image files beside them (relative paths).
    `informative=False` writes the control: the same rows, each
    picture (same noise, same seed) tinted with the pair's mean colour, so the images
    go through the same path but carry nothing about the colour the reward asks for.
    `layout="verl"` writes verl's chat layout with `VERL_PROMPT`; "plain" a `PROMPT`
    string."""
    folder.mkdir(parents=True, exist_ok=True)
    arm = "data" if informative else "control"
    prompt: str | list[dict[str, str]] = PROMPT
    if layout == "verl":
        prompt = [{"role": "user", "content": VERL_PROMPT}]
    lines: tuple[list[str], list[str]] = ([], [])
    for i in range(rows):
        colour = colours[i % 2]
        name = f"{arm}{seed}_{i}.png"
        (folder / name).write_bytes(picture(colour if informative else colours, seed * 100_000 + i))
        # The answer is the colour (never shown to the model; the reward reads `parity`;
        # the recipe balances steps by it); each picture makes its row a problem of its own.
        row = {"prompt": prompt, "answer": colour, "colour": colour, "parity": i % 2}
        lines[i % 2].append(json.dumps({**row, "images": [name]}))
    paths = (folder / f"{arm}_{colours[0]}.jsonl", folder / f"{arm}_{colours[1]}.jsonl")
    for path, part in zip(paths, lines, strict=True):
        path.write_text("\n".join(part) + "\n")
    return paths


USER_ROWS = 80
"""Rows of a `write_user_dataset` task: the new user's 64 training rows and 16 held out."""


def solid_picture(
    colour: str | tuple[str, ...], seed: int, size: int = 56, noise: float = 48.0
) -> bytes:
    """The second generator's picture: a solid `colour` under per-pixel Gaussian noise
    (standard deviation `noise` per channel), as PNG bytes. A tuple of names: their mean
    colour."""

    names = (colour,) if isinstance(colour, str) else colour
    solid = np.mean([PALETTE[c] for c in names], axis=0)
    rng = np.random.default_rng(seed)
    return _png(np.rint(solid + rng.normal(0.0, noise, (size, size, 3))))


def write_user_dataset(
    folder: Path,
    seed: int,
    *,
    colours: tuple[str, str] = COLOURS,
    informative: bool = True,
    rows: int = USER_ROWS,
    noise: float = 48.0,
) -> tuple[Path]:
    """The second generator, a task as a new user builds it (issue 51): one verl Parquet
    file (`format: verl`) of `rows` rows in random colour order, the chat prompt
    `VERL_PROMPT`, relative image paths, `reward_model.ground_truth` the colour word and
    `extra_info.parity` what `colour_parity` rewards; each picture a `solid_picture`, and
    per colour one row whose picture is a byte-identical copy (another file) of an earlier
    one. `informative=False`: the control, each picture the pair's mean colour under the
    same noise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    arm = "data" if informative else "control"
    rng = np.random.default_rng(seed)
    order = rng.permutation([i % 2 for i in range(rows)]).tolist()
    table: dict[str, list[Any]] = {k: [] for k in ("data_source", "prompt", "images")}
    table |= {"ability": [], "reward_model": [], "extra_info": []}
    pictures: tuple[list[bytes], list[bytes]] = ([], [])
    for i, side in enumerate(order):
        colour = colours[side]
        done = pictures[side]
        # The second row of each colour repeats the first's picture byte for byte.
        image = (
            done[0]
            if len(done) == 1
            else solid_picture(colour if informative else colours, seed * 100_000 + i)
        )
        done.append(image)
        name = f"{arm}{seed}_{i}.png"
        (folder / name).write_bytes(image)
        table["data_source"].append("colours")
        table["prompt"].append([{"role": "user", "content": VERL_PROMPT}])
        table["images"].append([name])
        table["ability"].append("vision")
        table["reward_model"].append({"style": "rule", "ground_truth": colour})
        table["extra_info"].append({"index": i, "parity": side})
    path = folder / f"{arm}.parquet"
    pq.write_table(pa.table(table), path)
    return (path,)


def write_mixed_dataset(folder: Path, rows: int, seed: int) -> Path:
    """Prompts with one image, with two images, and without any, in turn (a JSON-lines
    file, images beside it): what a mixed image/text micro-batch is made of."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        colour = COLOURS[i % 2]
        kind = i % 3
        count = {0: 1, 1: 2, 2: 0}[kind]
        names = [f"m{seed}_{i}_{k}.png" for k in range(count)]
        for k, name in enumerate(names):
            (folder / name).write_bytes(picture(COLOURS[(i + k) % 2], seed * 100_000 + 10 * i + k))
        prompt = {0: PROMPT, 1: "<image> then <image>. Answer.", 2: "Answer."}[kind]
        row = {"prompt": prompt, "answer": f"{colour} {i}", "colour": colour if count else None}
        row["parity"] = COLOURS.index(colour) if count else 0
        lines.append(json.dumps({**row, "images": names}))
    path = folder / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def parity_of(metadata: dict[str, Any]) -> int | None:
    """The parity a row's colour names: its `parity` column, or verl's `extra_info.parity`."""
    if "parity" in metadata:
        return metadata["parity"]
    return (metadata.get("extra_info") or {}).get("parity")


def colour_parity(sample) -> float:
    """The share of response tokens whose id parity is the row's `parity` (that of the
    picture's colour; a prompt without a picture: even ids)."""
    want = parity_of(sample.metadata) or 0
    ids = sample.response_token_ids
    return sum(1 for t in ids if t % 2 == want) / max(1, len(ids))


# The learning recipe (overrides of configs/tiny_dense.yaml beside `vision_run`'s), frozen:
# tests/test_vision_pipeline.py's learning test and tools/studies/vision_learning.py both
# run it.
LEARN = (
    "data.balance_by=answer",
    "total_steps=12",
    "data.prompts_per_step=4",
    "rollout.n=8",
    "rollout.max_new_tokens=1",
    "rollout.groups_per_call=8",
    "train.mini_batches=1",
    "train.micro_batch_size=32",
    "eval.size=64",
    "eval.holdout_fraction=0.5",
    "eval.every=12",
    "eval.samples=4",
    "eval.metric=colour_parity",
    "eval.threshold=0.5",
    "checkpoint.interval=12",
)
ROWS = 72
"""Rows of a learning dataset (half of them held out: about 18 problems of each colour)."""


def _source(path: Path) -> str:
    """One `data.datasets` entry: a Parquet file is `write_user_dataset`'s, in verl's layout."""
    return f"{{path: {path}, format: verl}}" if path.suffix == ".parquet" else f"{{path: {path}}}"


def vision_run(data: Path | tuple[Path, ...], *extra: str) -> tuple[str, ...]:
    """Overrides of configs/tiny_dense.yaml that make it a vision-language run on `data`
    rewarded by `colour_parity` (this module must be importable in the run: PYTHONPATH).
    Several files are mixed with equal weights: the prompt stream takes them in turn."""
    paths = (data,) if isinstance(data, Path) else data
    return (
        "model.path=builtin:tiny-vl",
        "data.source=datasets",
        "data.datasets=[" + ", ".join(_source(p) for p in paths) + "]",
        "data.max_prompt_tokens=96",
        "reward.functions=[{path: vision_task:colour_parity}]",
        *extra,
    )


def final_step(overrides: tuple[str, ...]) -> int:
    """The last `total_steps` among `overrides` (the step whose evaluation `held_out_reward`
    reads)."""
    steps = [o.split("=", 1)[1] for o in overrides if o.startswith("total_steps=")]
    return int(steps[-1])


def held_out_reward(run: Path, step: int) -> dict[str, Any]:
    """A run's held-out evaluation at `step`, each problem's greedy and sampled rewards
    averaged first: `mean`, the mean of the two colours' mean rewards; `se`, its standard
    error over problems; `bound`, what a policy blind to the images gets for `mean` in
    expectation (1/2); `colours`, each colour's (mean, problems); `plain_mean` and
    `plain_bound`, the mean over problems and the best a blind policy can expect of it."""
    import statistics

    import pyarrow.parquet as pq

    parts = sorted((run / "stages" / f"step={step}" / "eval").glob("part-r*.parquet"))
    rows = [r for p in parts for r in pq.read_table(p).to_pylist()]
    per_problem: dict[int, list[float]] = {}
    parity: dict[int, int] = {}
    for r in rows:
        per_problem.setdefault(r["prompt_id"], []).append(r["reward"])
        parity[r["prompt_id"]] = parity_of(json.loads(r["metadata"]))
    means: tuple[list[float], list[float]] = ([], [])
    for pid, rewards in per_problem.items():
        means[parity[pid]].append(statistics.mean(rewards))
    # A blind policy emits the same tokens whatever the picture: with a share e of even
    # tokens it earns e on the first colour's problems and 1 - e on the second's, so the
    # two colours' mean is 1/2 exactly, however unbalanced the held-out split. (The plain
    # mean with a share q of first-colour problems is q e + (1 - q)(1 - e): anywhere in
    # [min(q, 1 - q), max(q, 1 - q)], which a two-sided check cannot use.)
    if min(len(m) for m in means) < 2:
        raise ValueError(f"{run}: fewer than 2 held-out problems of a colour ({parity})")
    q = len(means[0]) / len(per_problem)
    return {
        "mean": (statistics.mean(means[0]) + statistics.mean(means[1])) / 2,
        "se": sum(statistics.variance(m) / len(m) for m in means) ** 0.5 / 2,
        "bound": 0.5,
        "colours": [[statistics.mean(m), len(m)] for m in means],
        "plain_mean": statistics.mean(means[0] + means[1]),
        "plain_bound": max(q, 1 - q),
    }
