"""The train forward+backward of rows whose prompts hold images against text rows of the
same token count, on `builtin:tiny-vl`.

    python -m tools.bench vision [--rows 4] [--images 1] [--size 112] [--text 32]
                                 [--response 64] [--runs 3] [--threads 1] [--device cpu|cuda]

Each row's prompt is `--images` images of `--size` x `--size` pixels and about `--text`
tokens of text; its response `--response` tokens. Sides, each through the padded M-RoPE
forward (`rftpipe.engines.train.vision`) and a backward of the summed logprobs:

- `images`: the rows as they are (the vision tower runs on every image's patches);
- `text`: the same token ids with every image-pad token replaced by a text token, no
  images: the same sequence lengths through the text model alone;
- `text-forest`: those text rows through the text path of the single backend
  (`grouped_logprobs`, the prefix forest), for scale.

They alternate run by run after one warm-up each; prints each side's median over `--runs`.
"""

from __future__ import annotations

import argparse
import io
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rftpipe.data.images import vision_prompt
from rftpipe.engines.models import prepare_tiny_vl
from rftpipe.engines.train.forward import grouped_logprobs
from rftpipe.engines.train.vision import build_vision_micro_batch, vision_response_logprobs
from rftpipe.engines.vision import VisionEncoder
from tools.bench import Benchmark
from tools.bench.harness import alternate, parser, timed


def main(argv: list[str] | None = None) -> int:
    ap = parser("vision", __doc__)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--text", type=int, default=32)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForImageTextToText

    path = prepare_tiny_vl()
    enc = VisionEncoder.load(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.to(args.device).train()
    prompts, vision, responses = image_rows(args, enc)
    text_prompts = [[t if t != enc.image_token_id else 120 for t in p] for p in prompts]
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    image_tokens = sum(sum(v.mm_token_type_ids) for v in vision if v is not None)
    print(f"{args.rows} rows, {tokens} tokens ({image_tokens} image tokens), {args.device}")

    def padded(rows: list[list[int]], vis: list) -> Callable[[], None]:
        def run() -> None:
            vb = build_vision_micro_batch(model, rows, responses, vis, 0).to(
                torch.device(args.device)
            )
            lp, _ = vision_response_logprobs(model, vb, 1.0, with_entropy=True, entropy_grad=False)
            lp[vb.mb.response_mask].sum().backward()

        return run

    def forest() -> None:
        lp, _ = grouped_logprobs(model, text_prompts, responses, 1.0, True, False)
        lp.sum().backward()

    def clocked(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            model.zero_grad(set_to_none=True)
            return timed(fn, args.device == "cuda")[0]

        return run

    sides = {
        "images": clocked(padded(prompts, vision)),
        "text": clocked(padded(text_prompts, [None] * args.rows)),
        "text-forest": clocked(forest),
    }
    for name, ts in alternate(sides, args.runs).runs.items():
        print(f"{name:12s} median {statistics.median(ts) * 1e3:8.1f} ms  runs {ts}")
    return 0


def image_rows(args: argparse.Namespace, enc: Any) -> tuple[list, list, list]:
    """(prompt ids, vision inputs, response ids) of `--rows` rows, each prompt `--images`
    random images and about `--text` tokens of text."""
    from PIL import Image

    rng = np.random.default_rng(0)
    prompts, vision = [], []
    for r in range(args.rows):
        images = []
        for _ in range(args.images):
            buf = io.BytesIO()
            pixels = rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, format="PNG")
            images.append(buf.getvalue())
        text = "<image>" * args.images + f"row {r} " + "x" * args.text
        e = enc.encode(vision_prompt(text, images, row=f"row {r}"))
        prompts.append(list(e.input_ids))
        vision.append(e.vision_inputs())
    responses = [rng.integers(3, 250, args.response).tolist() for _ in range(args.rows)]
    return prompts, vision, responses


BENCHMARK = Benchmark(
    name="vision",
    runs="the train forward+backward on builtin:tiny-vl of rows whose prompts hold images, "
    "against the same token ids as text (padded forward, and the prefix forest), alternating",
    measures="median milliseconds of each side's forward+backward",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
