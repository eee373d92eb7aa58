"""`train.ema_decay`: the actor's parameter average, by hand on a tiny tensor, end to end
through checkpoints and exports, and bitwise across a SIGKILL and a replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_chunks, events, submit, two_ranks_then_one
from safetensors.torch import load_file

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import prepare_tiny
from rftpipe.engines.train.ema import ParameterEMA
from rftpipe.engines.train.single import SingleDeviceEngine


def test_ema_update_by_hand() -> None:
    lin = torch.nn.Linear(2, 1, bias=False)
    values = [[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0], [0.25, 0.0]]
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([values[0]]))
    ema = ParameterEMA(lin, decay=0.75)
    want = torch.tensor([values[0]], dtype=torch.float64)
    for v in values[1:]:
        with torch.no_grad():
            lin.weight.copy_(torch.tensor([v]))
        ema.update()
        want = 0.75 * want + 0.25 * torch.tensor([v], dtype=torch.float64)
        assert torch.allclose(ema.params["weight"].double(), want, atol=1e-7, rtol=0)
    # 0.75^3 * 1 + 0.75^2 * 0.25 * 3 + 0.75 * 0.25 * -1 + 0.25 * 0.25, written out.
    assert ema.params["weight"][0, 0].item() == pytest.approx(0.421875 + 0.421875 - 0.1875 + 0.0625)
    assert ema.params["weight"] is not lin.weight  # a copy, not the live parameter


@pytest.mark.kernels
def test_engine_updates_after_every_optimizer_step_and_restores() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = TrainConfig(lr=0.1, grad_clip=0.0, ema_decay=0.9)
    engine = SingleDeviceEngine(model, cfg, Dist())
    assert engine.ema is not None
    want = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    for _ in range(3):
        model(torch.randn(4, 3)).square().sum().backward()
        engine.optimizer_step()
        for n, p in model.named_parameters():
            want[n] = 0.9 * want[n] + 0.1 * p.detach().double()
            assert torch.allclose(engine.ema.params[n].double(), want[n], atol=1e-6, rtol=0)
    saved = {n: t.clone() for n, t in engine.ema.state_dict()["params"].items()}
    fresh = SingleDeviceEngine(torch.nn.Linear(3, 2), cfg, Dist())
    fresh.ema.load_state_dict({"params": saved})
    assert all(torch.equal(fresh.ema.params[n], saved[n]) for n in saved)
    # Off by default, and for a reference.
    assert SingleDeviceEngine(torch.nn.Linear(3, 2), TrainConfig(), Dist()).ema is None
    ref = SingleDeviceEngine(torch.nn.Linear(3, 2), cfg, Dist(), role="reference")
    assert ref.ema is None


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


DECAY = 0.5
#: One optimizer step per train step, so every update's weights are an export of some run.
ONE_UPDATE = ("train.mini_batches=1", f"train.ema_decay={DECAY}")


@pytest.mark.slow
def test_exported_ema_is_the_hand_computed_average(tmp_path: Path) -> None:
    """Step 1's export is w1, the extended run's is w2; the EMA exports must be
    d*w0 + (1-d)*w1 and then d*ema1 + (1-d)*w2 (ema1 restored from the step-1 checkpoint)."""
    run = tmp_path / "run"
    out = submit(run, "total_steps=1", *ONE_UPDATE)
    assert out.returncode == 0, out.stderr[-3000:]
    w0 = _weights(prepare_tiny())
    w1, ema1 = _weights(run / "export"), _weights(run / "export_ema")
    out = submit(run, "total_steps=2", *ONE_UPDATE, config=None)
    assert out.returncode == 0, out.stderr[-3000:]
    w2, ema2 = _weights(run / "export"), _weights(run / "export_ema")
    assert w0.keys() == w1.keys() == ema1.keys() == ema2.keys()
    for k in w0:
        assert torch.allclose(ema1[k], DECAY * w0[k] + (1 - DECAY) * w1[k], atol=1e-7), k
        assert torch.allclose(ema2[k], DECAY * ema1[k] + (1 - DECAY) * w2[k], atol=1e-7), k
    moved = [k for k in w0 if not torch.equal(w0[k], w2[k])]
    assert moved, "training changed nothing"
    assert any(not torch.equal(ema2[k], w2[k]) for k in moved)
    assert any(not torch.equal(ema2[k], w0[k]) for k in moved)


@pytest.mark.slow
def test_ema_survives_sigkill_and_replay_bitwise(tmp_path: Path) -> None:
    steps = ("total_steps=4", "train.ema_decay=0.9")
    ref = tmp_path / "ref"
    assert submit(ref, *steps).returncode == 0
    run = tmp_path / "run"
    # stage_after_commit hit 14 is step 3's train commit, after the step-2 checkpoint.
    killed = submit(
        run, *steps, env={"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "13"}
    )
    assert killed.returncode != 0
    last = [e for e in events(run) if e["event"] == "commit"][-1]
    assert (last["step"], last["stage"]) == (3, "train")
    assert not (run / "export_ema").exists()
    out = submit(run, *steps, config=None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {e["step"] for e in events(run) if e["event"] == "replay"} == {3}
    a, b = _weights(ref / "export_ema"), _weights(run / "export_ema")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "EMA differs from the uninterrupted run"
    final = _weights(ref / "export")
    assert any(not torch.equal(a[k], final[k]) for k in a)


@pytest.mark.slow
def test_fsdp2_ema_is_sharded_and_reshards_on_resume(tmp_path: Path) -> None:
    """Under fsdp2 the average is saved in shards like the weights, and a run killed on 2
    ranks after step 3's train commit and resumed on 1 ends with the EMA of a run that
    switched from 2 ranks to 1 at the same checkpoint, bitwise."""
    switched, killed = two_ranks_then_one(tmp_path, "train.ema_decay=0.9")
    key = "ema.params.model.layers.0.mlp.up_proj.weight"
    assert dcp_chunks(switched / "checkpoints" / "step=2", key) == 2
    assert dcp_chunks(switched / "checkpoints" / "step=2", "engine.model." + key[11:]) == 2
    a, b = _weights(switched / "export_ema"), _weights(killed / "export_ema")
    assert all(torch.equal(a[k], b[k]) for k in a), "EMA differs after resharding"
    final = _weights(killed / "export")
    assert any(not torch.equal(a[k], final[k]) for k in a)
