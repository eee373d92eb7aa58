"""Rewards receive the images: a reward function in the worker pool reads them, a remote
server gets each as sha256 + path (or base64 bytes) and checks them, and a vision-language
reward model (a judge, `VisionJudge`) scores a row with its images."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import png
from reward_fns import image_rollouts, rollouts
from reward_server import RewardServer, Schedule, score_of

from rftpipe.config.loader import from_dict
from rftpipe.config.schema import RewardConfig
from rftpipe.errors import UserError
from rftpipe.rewards import pool, resolve_all
from rftpipe.rewards.model import VisionJudge, judge_prompt
from rftpipe.rewards.types import RewardSample, SampleImage
from rftpipe.stages import score
from rftpipe.storage.images import ImageRef

PICTURES = [png(1), png(2, width=84, height=56), png(3)]
"""Prompt 0 shows the first; prompt 1 the other two."""


def red(data: bytes) -> float:
    from PIL import Image

    return float(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[..., 0].mean())


def test_a_pooled_function_sees_the_rows_images(tmp_path: Path) -> None:
    """The rftpipe signature gets `SampleImage`s; the trl one, decoded pictures."""
    table = image_rollouts(tmp_path, PICTURES)
    trl = {"path": "reward_fns:trl_red_mean", "signature": "trl", "name": "trl_red"}
    cfg = from_dict(RewardConfig, {"functions": ["reward_fns:red_mean", trl], "workers": 1})
    try:
        t = score.run(cfg, resolve_all(cfg, None), table, tmp_path).to_pydict()
    finally:
        for p in pool._shared.values():
            p.close()
        pool._shared.clear()
    prompts = t["prompt_id"]
    assert t["reward_status"] == ["ok"] * 6
    assert t["reward_red_mean"] == [
        red(PICTURES[0]) if p == 0 else red(PICTURES[1]) for p in prompts
    ]
    assert t["reward_red_mean_images"] == [1.0 if p == 0 else 2.0 for p in prompts]
    assert t["reward_red_mean_verified"] == [1.0] * 6
    assert t["reward_trl_red"] == t["reward_red_mean"]
    # A text-only table: no images, and no run directory needed.
    text = score.run(cfg, resolve_all(cfg, None), rollouts()).to_pydict()
    assert text["reward_red_mean"] == [-1.0] * 6 and text["reward_red_mean_images"] == [0.0] * 6
    assert text["reward_trl_red"] == [-1.0] * 6


def test_samples_carry_absolute_store_paths(tmp_path: Path) -> None:
    rel = ImageRef(sha256=hashlib.sha256(PICTURES[0]).hexdigest(), ext="png").relpath
    im = SampleImage.in_run(tmp_path, rel)
    assert im.path == str(tmp_path.absolute() / rel) and im.ext == "png"
    table = image_rollouts(tmp_path, PICTURES)
    with pytest.raises(ValueError, match="run_root"):
        score.run(RewardConfig(functions=("dense_even_tokens",)), {}, table)


@pytest.mark.parametrize("how", ["path", "base64"])
def test_a_remote_server_receives_and_checks_the_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    run = tmp_path / "run"
    table = image_rollouts(run, PICTURES)
    remote = {"url": "", "image_payload": how, "backoff_s": 0.01}
    with RewardServer(Schedule(), tmp_path / "log.jsonl") as srv:
        remote["url"] = srv.url
        cfg = from_dict(RewardConfig, {"functions": ["remote"], "remote": remote})
        t = score.run(cfg, resolve_all(cfg, None), table, run).to_pydict()
        log = srv.log()
        # Bytes that no longer match their name: the server sees it (by path or by bytes).
        stored = run / ImageRef.parse(table.column("images")[0].as_py()[0]).relpath
        stored.write_bytes(PICTURES[2])
        bad = score.run(cfg, resolve_all(cfg, None), table, run).to_pydict()
        stored.unlink()
        if how == "base64":  # a damaged run directory: one line naming the row, no retries
            with pytest.raises(UserError, match="reward.remote: cannot read image .* of step 1"):
                score.run(cfg, resolve_all(cfg, None), table, run)
    assert t["reward_remote"] == [score_of(r) for r in t["response"]]
    assert t["reward_remote_images"] == [1.0 if p == 0 else 2.0 for p in t["prompt_id"]]
    assert t["reward_remote_verified"] == t["reward_remote_images"]
    assert sorted(len(r["image_keys"]) for r in log) == [1, 1, 1, 2, 2, 2]
    assert all(keys == sorted(["sha256", how]) for r in log for keys in r["image_keys"])
    # Prompt 0's picture changed on disk; prompt 1's two images still verify.
    assert bad["reward_remote_verified"] == [0.0 if p == 0 else 2.0 for p in t["prompt_id"]]


def test_a_text_reward_model_scores_the_text_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entry = {"path": "reward_model", "name": "rm", "model": {"path": "builtin:tiny-reward"}}
    cfg = from_dict(RewardConfig, {"functions": [entry]})
    rm = resolve_all(cfg, None)
    with_images = score.run(cfg, rm, image_rollouts(tmp_path, PICTURES), tmp_path)
    score.run(cfg, rm, image_rollouts(tmp_path, PICTURES), tmp_path)
    text = score.run(cfg, rm, rollouts())
    assert with_images.column("reward_rm").equals(text.column("reward_rm"))
    said = [m for m in caplog.messages if "does not see their images" in m]
    assert len(said) == 1, caplog.messages  # once, not once per shard


def _judge_config(batch_size: int) -> RewardConfig:
    return from_dict(
        RewardConfig,
        {
            "functions": [
                {
                    "path": "reward_model",
                    "name": "judge",
                    "model": {"path": "builtin:tiny-vl", "batch_size": batch_size},
                }
            ]
        },
    )


def _direct(judge: VisionJudge, s: RewardSample) -> float:
    """One unpadded forward of the row alone, the model placing its own positions."""
    e = judge.encoder.encode(judge_prompt(s))
    kwargs = {"input_ids": torch.tensor([e.input_ids])}
    kwargs["mm_token_type_ids"] = torch.tensor([e.mm_token_type_ids])
    if e.pixel_values is not None:
        kwargs |= {"pixel_values": e.pixel_values, "image_grid_thw": e.image_grid_thw}
    with torch.no_grad():
        lp = torch.log_softmax(judge.model(**kwargs).logits[0, -1].float(), -1)
    yes, no = judge.verdict_ids
    return float(lp[yes] - lp[no])


@pytest.mark.slow  # 4 to 45 s on a loaded 2-core machine: 8 forwards of the tiny VLM
def test_a_vision_judge_scores_rows_with_their_images(tiny_vl: Path, tmp_path: Path) -> None:
    table = image_rollouts(tmp_path, PICTURES, n=2)
    # One more row, a text prompt of the same vision run.
    text = rollouts(prompts=1, n=1).append_column("images", pa.array([[]], pa.list_(pa.string())))
    table = pa.concat_tables([table, text.set_column(1, "prompt_id", pa.array([2]))])
    cfg = _judge_config(8)
    judge = resolve_all(cfg, None)["reward_judge"]
    assert isinstance(judge, VisionJudge)
    t = score.run(cfg, {"reward_judge": judge}, table, tmp_path).to_pydict()
    samples = [score._sample(r, tmp_path) for r in table.to_pylist()]
    want = [_direct(judge, s) for s in samples]
    # One left-padded batch of rows of 2, 1 and no images and of unequal lengths equals
    # each row alone.
    assert len({len(judge.encoder.encode(judge_prompt(s)).input_ids) for s in samples}) == 3
    assert t["reward_judge"] == pytest.approx(want, abs=1e-5, rel=0)
    # The image decides the score: the same row with another picture scores otherwise.
    s = samples[0]
    moved = tmp_path / "other.png"
    moved.write_bytes(PICTURES[2])
    sha = hashlib.sha256(PICTURES[2]).hexdigest()
    other = RewardSample(**{**_fields(s), "images": (SampleImage(sha, str(moved)),)})
    alone = _direct(judge, other)
    assert abs(alone - want[0]) > 1e-4
    assert judge.score([other], True)[0].value == pytest.approx(alone, abs=1e-5, rel=0)
    # A multi-turn row's conversation places its images by its own placeholders: the same
    # conversation as messages reads exactly as the single-turn row.
    chat = [
        {"role": "user", "content": "<image>" + s.prompt},
        {"role": "assistant", "content": s.response},
    ]
    turns = RewardSample(**{**_fields(s), "messages": chat})
    assert judge_prompt(turns) == judge_prompt(s)


def _fields(s: RewardSample) -> dict:
    return {k: getattr(s, k) for k in s.__dataclass_fields__}
