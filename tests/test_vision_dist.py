"""Vision-language training on the sharded backends (FSDP2, DeepSpeed ZeRO-2/3 on 2 real
gloo ranks) against `train.backend=single`, and the critic's values with images."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import vision_task
from helpers import TESTS_ON_PATH, final_weights, launch_ranks, png, submit, trajectories
from safetensors.torch import load_file
from test_vision_pipeline import BASE as PIPELINE
from test_vision_pipeline import vl_run
from vision_worker import VARIANTS, single_name

from rftpipe.config.schema import CriticConfig, TrainConfig
from rftpipe.data.images import vision_prompt
from rftpipe.dist import Dist
from rftpipe.engines.train.critic import Critic, critic_train_config, load_value_model
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.engines.vision import VisionEncoder, collate
from rftpipe.storage.layout import IMAGES_COLUMN

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RUN = [v for v in ("fsdp2", "fsdp2-tower", "zero3") if HAVE_DEEPSPEED or not v.startswith("zero")]
"""The variants CI runs: `zero2-tower` passes too (run by hand, 2026-11-26), left out for
the time budget."""

LOGPROB_TOL = 1e-5
"""Max |logprob - single's| (and of the critic's values): measured 0 before the step (the
same fp32 operations on the same rows) and at most 1.9e-6 after it (ZeRO-3), 2026-11-26."""
WEIGHT_TOL = 1e-6
"""Max |w - w_single| after the AdamW step (lr 1e-3, eps `vision_worker.ADAM_EPS`), which
moves weights by up to 9.7e-4: measured 1.2e-7 (one float32 ulp at 1.0) on FSDP2 and
ZeRO-3, 2026-11-26."""


SCORES = ("before", "after", "reference", "values")
"""What `vision_worker` scores: the actor's logprobs before and after its step, the
reference engine's, the critic's values."""


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def ranks(tiny_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant on 2 ranks in one launch (one process group, one import each), then
    the single backend's results on the same rows."""
    out = tmp_path_factory.mktemp("vision-dist")
    launch_ranks("vision_worker.py", 2, str(out), *RUN, timeout=500)
    return out


def _results(out: Path, name: str) -> dict[str, Any]:
    """A variant's results, the ranks' rows in rank order, and its final weights."""
    got: dict[str, Any] = {key: [] for key in SCORES}
    for path in sorted((out / name).glob("rank*.json")):
        res = json.loads(path.read_text())
        for key in SCORES:
            got[key] += res[key]
        got.setdefault("optim_keys", res["optim_keys"])
        assert res["optim_keys"] == got["optim_keys"]  # the same names on every rank
    got["weights"] = load_file(out / name / "weights.safetensors")
    return got


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", RUN)
def test_sharded_backend_trains_image_rows_like_single(ranks: Path, variant: str) -> None:
    """Rows with and without images (rank 1's training rows have none, and its extra
    scoring micro-batch meets rank 0's padding one): the actor's logprobs before and after
    one AdamW step, the reference engine's and the critic's values equal the single
    backend's on the same rows; the step moves the text weights alike, and a frozen tower
    is bitwise unchanged and absent from the checkpoint's optimizer state."""
    freeze = VARIANTS[variant].get("freeze", True)
    want = _results(ranks, single_name(freeze))
    got = _results(ranks, variant)
    assert got["optim_keys"] == want["optim_keys"], variant
    for key in SCORES:
        assert _max_diff(got[key], want[key]) <= LOGPROB_TOL, (variant, key)
    assert _max_diff(got["after"], got["before"]) > 1e-3  # the step changed the policy

    weights = got["weights"]
    initial = load_file(ranks / "initial.safetensors")
    assert weights.keys() == want["weights"].keys() == initial.keys()
    tower = {k for k in weights if k.startswith("model.visual.")}
    assert tower and len(tower) < len(weights)
    for k, w in weights.items():
        assert float((w - want["weights"][k]).abs().max()) <= WEIGHT_TOL, (variant, k)
    moved = {k for k in weights if not torch.equal(weights[k], initial[k])}
    assert any(k.startswith("model.language_model.") for k in moved)
    optim_tower = [k for k in want["optim_keys"] if k.startswith("model.visual.")]
    if freeze:
        assert not moved & tower  # bitwise unchanged
        assert not optim_tower
    else:
        assert tower <= moved
        assert optim_tower


@pytest.mark.tier1
@pytest.mark.slow
def test_critic_values_see_the_image(tiny_vl: Path, tmp_path: Path) -> None:
    """Two prompts with the same tokens and different images (and a text prompt) in one
    micro-batch: the values differ from the image on, and equal the backbone's own
    forward (its own M-RoPE positions and image placement) of each row alone."""
    enc = VisionEncoder.load(tiny_vl)
    for i in (0, 1):
        (tmp_path / f"{i}.png").write_bytes(png(10 + i))
    encoded = [
        enc.encode(vision_prompt("<image>Which colour?", str(tmp_path / f"{i}.png"), row="r"))
        for i in (0, 1)
    ]
    encoded.append(enc.encode(vision_prompt("no image in this prompt", row="r")))
    assert encoded[0].input_ids == encoded[1].input_ids
    responses = [[40, 41, 42], [40, 41, 42], [50, 51, 52, 53]]
    cfg = critic_train_config(TrainConfig(), CriticConfig())
    model = load_value_model(tiny_vl, "float32", seed=0)
    critic = Critic(
        engine=SingleDeviceEngine(model, cfg, Dist()),
        cfg=CriticConfig(),
        train_cfg=cfg,
        dist=Dist(),
    )
    ids = [e.input_ids for e in encoded]
    got = critic.compute_values(ids, responses, [e.vision_inputs() for e in encoded])
    assert min(abs(a - b) for a, b in zip(got[0], got[1], strict=True)) > 1e-4
    with torch.no_grad():
        for e, r, values in zip(encoded, responses, got, strict=True):
            batch = collate([e], enc.tokenizer.pad_token_id)
            batch["input_ids"] = torch.tensor([[*e.input_ids, *r]])
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batch["mm_token_type_ids"] = torch.tensor([[*e.mm_token_type_ids, *[0] * len(r)]])
            model.model.rope_deltas = None
            hidden = model.model(**batch, use_cache=False).last_hidden_state
            own = model.value_head(hidden)[0, len(e.input_ids) - 1 : -1, 0]
            torch.testing.assert_close(torch.tensor(values), own, atol=1e-6, rtol=0)


LORA_VL = "model.lora={r: 4, target_modules: [q_proj, v_proj, fc1], vision_tower: true}"
"""Adapters on the text model's attention and the vision tower's MLP (`fc1`, in the tower
only)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_a_vision_run_on_two_fsdp2_ranks_ends_like_one_rank(tmp_path: Path, tuning: str) -> None:
    """The pipeline (rollout, advantage with the reference's and the actor's logprobs,
    train; micro-batches with and without images, a trained tower) for 2 steps on
    `single` and on 2 `fsdp2` ranks: the same samples, and final weights within 1e-6
    (AdamW's eps 1e-3 as in `vision_worker.ADAM_EPS`; measured 1.2e-7, 2026-11-26).
    With `lora`, the adapters (the tower's among them; the reference is the base model
    with them off) agree so, and every one moved."""
    data = vision_task.write_mixed_dataset(tmp_path / "data", 12, 3)
    lora = (LORA_VL,) if tuning == "lora" else ()
    overrides = vl_run(data, *PIPELINE, "total_steps=2", "train.adam_eps=1e-3", *lora)
    runs = {}
    for name, extra, launch in (
        ("single", (), ()),
        ("fsdp2", ("train.backend=fsdp2",), ("--tasks-per-node", "2")),
    ):
        runs[name] = tmp_path / name
        out = submit(runs[name], *overrides, *extra, extra=launch, env=TESTS_ON_PATH)
        assert out.returncode == 0, out.stderr[-3000:]
    order = [("step", "ascending"), ("prompt_id", "ascending"), ("sample_idx", "ascending")]
    one, two = (trajectories(runs[n]).drop_columns(["rank"]).sort_by(order) for n in runs)
    assert one.num_rows == two.num_rows > 0
    assert any(one.column(IMAGES_COLUMN).to_pylist()) and not all(
        one.column(IMAGES_COLUMN).to_pylist()
    )
    for col in one.column_names:
        a, b = one.column(col).to_pylist(), two.column(col).to_pylist()
        if col in ("logprobs", "ref_logprobs"):
            # Step 2 samples from weights that differ in the last bits, and `single` scores
            # a micro-batch without images through the prefix forest, the sharded ranks
            # through the padded forward (equal within 5e-7 on these rows).
            assert _max_diff(a, b) <= LOGPROB_TOL, col
        else:
            assert a == b, col
    if lora:
        wa, wb = (load_file(runs[n] / "export" / "adapter_model.safetensors") for n in runs)
        assert any(".visual." in k for k in wa) and any(".language_model." in k for k in wa)
        # B starts at zero: each adapter's B moved, in the tower as in the text model.
        assert all(float(w.abs().max()) > 0 for k, w in wa.items() if ".lora_B." in k)
    else:
        wa, wb = final_weights(runs["single"]), final_weights(runs["fsdp2"])
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= WEIGHT_TOL
