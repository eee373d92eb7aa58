"""Whole PPO steps of a vision-language run against a text run of the same token count,
both on `builtin:tiny-vl`, each a real run through `jobs.submit` (local cluster).

    python -m tools.bench vision_step [--steps 5] [--prompts 8] [--n 8] [--images 1]
                                      [--size 112] [--response 32] [--repeats 1] [--out DIR]

The image side's prompts hold `--images` pictures of `--size` x `--size` pixels each and
the same short question; the text side's prompts are that question padded with text to
exactly the image prompts' token count (image tokens included), so both sides roll out,
score and train sequences of the same lengths (with a KL term, so the advantage stage runs
the reference's forward over them too). The text side trains through the text path
(prefix forest: a group's prompt computed once), the image side through the padded forward
with the vision tower (see docs/vision.md). Sides alternate `--repeats` times; prints, per
side, the medians over steps 2..N (step 1 warms up) of each stage's seconds and memory
peak, and their ratio (a Markdown table).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tools.bench import Benchmark
from tools.bench.harness import (
    ROOT,
    alternate,
    comparison_table,
    fresh_process,
    key_medians,
    parser,
)

QUESTION = "What is in the picture? Answer."
KEYS = (
    "perf/rollout_s",
    "perf/advantage_s",
    "perf/train_s",
    "perf/rollout_mem_increment_gib",
    "perf/advantage_mem_increment_gib",
    "perf/train_mem_increment_gib",
    "perf/train_mem_peak_gib",
)


def write_data(folder: Path, prompts: int, images: int, size: int) -> tuple[Path, Path, int]:
    """(image dataset, text dataset, prompt tokens of each prompt)."""
    import numpy as np
    from PIL import Image

    from rftpipe.data.images import vision_prompt
    from rftpipe.data.prompts import template_prompt
    from rftpipe.engines.models import load_tokenizer, prepare_tiny_vl
    from rftpipe.engines.vision import VisionEncoder

    model = prepare_tiny_vl()
    enc, tok = VisionEncoder.load(model), load_tokenizer(model)
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    prompt = "<image>" * images + QUESTION
    img_rows, txt_rows = [], []
    length = 0
    for i in range(prompts):
        names = []
        for k in range(images):
            name = f"p{i}_{k}.png"
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name)
            names.append(name)
        vp = vision_prompt(prompt, names, row=f"row {i}", base_dir=folder)
        length = len(enc.template_ids(vp))
        img_rows.append({"prompt": prompt, "answer": str(i), "images": names})
    base = len(template_prompt(tok, None, QUESTION))
    # The tiny tokenizer is byte-level: one token per ASCII character of filler.
    filler = "x" * (length - base)
    text = filler + QUESTION
    got = len(template_prompt(tok, None, text))
    assert got == length, (got, length)
    txt_rows = [{"prompt": text, "answer": str(i)} for i in range(prompts)]
    paths = folder / "images.jsonl", folder / "text.jsonl"
    for path, rows in zip(paths, (img_rows, txt_rows), strict=True):
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return paths[0], paths[1], length


def run(data: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    overrides = [
        "model.path=builtin:tiny-vl",
        "data.source=datasets",
        f"data.datasets=[{{path: {data}}}]",
        "data.max_prompt_tokens=1024",
        f"data.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.response}",
        f"rollout.min_new_tokens={args.response}",
        f"rollout.groups_per_call={args.prompts}",
        f"total_steps={args.steps}",
        "train.mini_batches=1",
        f"train.micro_batch_size={args.prompts * args.n}",
        "checkpoint.interval=1000",
        # The reference's logprobs in the advantage stage take the images too.
        "kl.mode=loss",
        "kl.coef=0.05",
    ]
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(out)]
    cmd += ["--config", str(ROOT / "configs" / "tiny_dense.yaml"), *overrides]
    child = fresh_process(cmd, capture=True)
    if child.code:
        raise SystemExit(f"{out} failed with exit code {child.code}:\n{child.stderr[-3000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("step", 0) >= 2 and "perf/train_s" in m]


def main(argv: list[str] | None = None) -> int:
    ap = parser("vision_step", __doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-vision-step-"))
    images, text, length = write_data(root / "data", args.prompts, args.images, args.size)
    print(f"prompt tokens {length} (each prompt {args.images} images of {args.size}px)")
    count = {"images": 0, "text": 0}

    def side(name: str, data: Path) -> list[dict]:
        count[name] += 1
        return run(data, root / f"{name}-{count[name] - 1}", args)

    # No warm-up round: each run is a fresh process whose step 1 is left out.
    rounds = alternate(
        {"images": lambda: side("images", images), "text": lambda: side("text", text)},
        args.repeats,
        warmup=0,
    )
    med = {s: key_medians([m for r in runs for m in r], KEYS) for s, runs in rounds.runs.items()}
    print(comparison_table({k: {s: med[s][k] for s in med} for k in KEYS}, ("images", "text")))
    return 0


BENCHMARK = Benchmark(
    name="vision_step",
    runs="real runs through jobs.submit on builtin:tiny-vl: prompts with images against text "
    "prompts of the same token count (rollout, KL reference, train), alternating",
    measures="medians over steps 2..N of each stage's seconds and memory increments and "
    "peak, per side, and images over text",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
