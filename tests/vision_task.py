"""A synthetic image task for the vision-language tests, whose reward depends on the image
alone: every prompt reads the same ("<image>Answer."), its picture is mostly red or mostly
blue, and a response earns the share of its tokens whose parity the colour names (even
ids for red, odd for blue). Imported by path in the reward worker processes.

A policy that does not see the image cannot do better than 0.5 in expectation on a
balanced set: whatever it emits, a token's parity is right under one colour and wrong
under the other, so its expected share of right tokens is exactly 1/2 (the image-blind
bound the learning test compares with).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

PROMPT = "<image>Answer."
COLOURS = ("red", "blue")


def picture(colour: str, seed: int, size: int = 56) -> bytes:
    """A noisy picture dominated by `colour`, as PNG bytes (each seed another picture)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 90, (size, size, 3), dtype=np.int64)
    pixels[..., 0 if colour == "red" else 2] += 150 + rng.integers(0, 16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_dataset(folder: Path, rows: int, seed: int, *, images: bool = True) -> Path:
    """`rows` prompts, colours alternating, as a JSON-lines file with image files beside
    it (relative paths); `images=False` writes the same rows without an images column
    (the text-only control: the placeholder stays plain text)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        colour = COLOURS[i % 2]
        name = f"img{seed}_{i}.png"
        (folder / name).write_bytes(picture(colour, seed * 100_000 + i))
        # A distinct answer per row (never shown to the model; the reward reads `colour`)
        # makes every row its own problem for the held-out split, images or not.
        row = {"prompt": PROMPT, "answer": f"{colour} {i}", "colour": colour}
        if images:
            row["images"] = [name]
        lines.append(json.dumps(row))
    path = folder / ("data.jsonl" if images else "data_text.jsonl")
    path.write_text("\n".join(lines) + "\n")
    return path


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
        lines.append(json.dumps({**row, "images": names}))
    path = folder / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def colour_parity(sample) -> float:
    """The share of response tokens whose parity the picture's colour names (a prompt
    without a picture: even ids)."""
    want = 1 if sample.metadata.get("colour") == "blue" else 0
    ids = sample.response_token_ids
    return sum(1 for t in ids if t % 2 == want) / max(1, len(ids))
