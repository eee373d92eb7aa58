"""Train and rollout engines on the tiny model (loaded through from_pretrained)."""

from __future__ import annotations

import pytest
import torch

from rftpipe.config.schema import RolloutConfig
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.forward import (
    build_micro_batch,
    grouped_logprobs,
    response_logprobs,
    root_forward_logprobs,
)


@pytest.fixture(scope="module")
def tiny():
    path = prepare_tiny()
    torch.manual_seed(0)
    model = load_causal_lm(path, "float32")
    # Perturb the random init so logits are far from uniform and differences would show.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model, load_tokenizer(path)


def _rows():
    prompts = [[5, 6, 7, 8, 9, 10]] * 3 + [[40, 41, 42]] * 2
    responses = [[11, 12, 13, 14], [15, 16], [17], [50, 51, 52, 53, 54], [55, 56, 57]]
    return prompts, responses


@pytest.mark.kernels
def test_shared_prefix_equals_full_forward_values_and_grads(tiny) -> None:
    model, _ = tiny
    prompts, responses = _rows()
    mb = build_micro_batch(prompts, responses, pad_id=0)
    model.zero_grad()
    full, full_ent = response_logprobs(model, mb, 0.7, with_entropy=True)
    (full * mb.response_mask).sum().backward()
    g_full = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shared, shared_ent = grouped_logprobs(model, prompts, responses, 0.7, with_entropy=True)
    (shared * mb.response_mask).sum().backward()
    m = mb.response_mask
    assert (full - shared).abs()[m].max() < 1e-5
    assert (full_ent - shared_ent).abs()[m].max() < 1e-5
    for n, p in model.named_parameters():
        rel = (p.grad - g_full[n]).norm() / g_full[n].norm().clamp_min(1e-12)
        assert rel < 1e-4, (n, float(rel))


@pytest.mark.kernels
def test_root_forward_equals_decoder_forward(tiny) -> None:
    model, _ = tiny
    prompts, responses = _rows()
    mb = build_micro_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        a, a_ent = response_logprobs(model, mb, 0.9, with_entropy=True)
        b, b_ent = root_forward_logprobs(model, mb, 0.9, with_entropy=True)
    m = mb.response_mask
    assert (a - b).abs()[m].max() < 1e-5
    assert (a_ent - b_ent).abs()[m].max() < 1e-5
    assert a[m].std() > 0.1  # the rows really differ


@pytest.mark.kernels
def test_rollout_logprobs_are_pre_filter_and_seeded(tiny) -> None:
    model, tok = tiny
    cfg = RolloutConfig(n=4, max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9)
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)
    prompt = [5, 6, 7, 8, 9]
    a = engine.generate_group(prompt, 4, seed=123)
    b = engine.generate_group(prompt, 4, seed=123)
    c = engine.generate_group(prompt, 4, seed=124)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    mb = build_micro_batch([prompt] * 4, a.tokens, pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, mb, 0.8, with_entropy=False)
    for i, row in enumerate(a.logprobs):
        assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-5)
    # top-k/top-p filtered tokens still have their unfiltered (smaller) probability
    assert all(x < 0 for row in a.logprobs for x in row)


@pytest.mark.kernels
def test_batched_groups_left_pad_and_score_like_the_trainer(tiny) -> None:
    model, tok = tiny
    cfg = RolloutConfig(n=3, max_new_tokens=5, temperature=1.0)
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]  # unequal lengths: the short one is padded
    a = engine.generate_groups(prompts, 3, seeds=[9, 10])
    assert [len(g.tokens) for g in a] == [3, 3]
    assert engine.generate_groups(prompts, 3, seeds=[9, 10]) == a  # the call's seed fixes it all
    for prompt, group in zip(prompts, a, strict=True):
        mb = build_micro_batch([prompt] * 3, group.tokens, pad_id=0)
        with torch.no_grad():
            lp, _ = response_logprobs(model, mb, 1.0, with_entropy=False)
        for i, row in enumerate(group.logprobs):
            # The padding never reaches the real tokens: same logprobs as an unpadded forward.
            assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)


def test_top_k_1_sampling_decodes_like_generate_greedy(tiny) -> None:
    """The shared-prefix decode loop (cache, positions, left padding) against `generate`."""
    model, tok = tiny
    cfg = RolloutConfig(n=2, max_new_tokens=6, top_k=1)
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [70, 71, 72]]
    greedy = engine.greedy(prompts, 6)
    groups = engine.generate_groups(prompts, 2, [3] * len(prompts))
    for prompt, group, ref in zip(prompts, groups, greedy, strict=True):
        for row in group.tokens:
            assert [t for t in row if t != tok.eos_token_id] == ref, prompt


def test_sampling_filters_and_draws_in_proportion(tiny) -> None:
    from rftpipe.engines.rollout.hf import _sample

    model, tok = tiny
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    cfg = RolloutConfig(top_p=0.7, min_new_tokens=2, max_new_tokens=4)
    engine = HFGenerateEngine(model, cfg, eos_id=0, pad_id=3)
    kept = engine._filter(probs.log()[None], t=5)[0].isfinite().tolist()
    assert kept == [True, True, False, False]  # smallest set holding >= 0.7
    assert engine._filter(probs.log()[None], t=1)[0, 0] == -torch.inf  # EOS before min
    k2 = HFGenerateEngine(model, RolloutConfig(top_k=3), eos_id=0, pad_id=3)
    assert k2._filter(probs.log()[None], t=0)[0].isfinite().tolist() == [True] * 3 + [False]
    gen = torch.Generator().manual_seed(0)
    draws = _sample(
        probs.expand(20000, 4), torch.rand(20000, 1, generator=gen, dtype=torch.float64)
    )
    freq = torch.bincount(draws, minlength=4) / 20000
    assert (freq - probs).abs().max() < 0.015, freq
    gen = torch.Generator().manual_seed(0)
    zeroed = torch.tensor([0.0, 0.6, 0.0, 0.4]).expand(5000, 4)
    u = torch.rand(5000, 1, generator=gen, dtype=torch.float64)
    assert set(_sample(zeroed, u).tolist()) == {1, 3}


def test_min_new_tokens_holds_eos_back(tiny) -> None:
    model, tok = tiny
    prompt = [5, 6, 7, 8, 9]
    cfg = RolloutConfig(n=8, max_new_tokens=5, min_new_tokens=5)
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)
    out = engine.generate_group(prompt, 8, seed=1)
    assert all(len(t) == 5 and tok.eos_token_id not in t for t in out.tokens)
    assert out.finish_reasons == ["length"] * 8


def _engine(role: str = "actor"):
    from rftpipe.config.schema import TrainConfig
    from rftpipe.dist import Dist
    from rftpipe.engines.train.single import SingleDeviceEngine

    model = load_causal_lm(prepare_tiny(), "float32")
    # A schedule whose LR changes at every update, so a lost scheduler state shows.
    cfg = TrainConfig(lr=1e-2, micro_batch_size=2, lr_schedule="cosine", warmup_steps=3)
    return SingleDeviceEngine(model, cfg, Dist(rank=0, world=1), role=role, total_updates=4)


def _update(engine) -> None:
    prompts, responses = _rows()
    with engine.train_mode():
        assert engine.model.training
        lp, _ = engine.forward(prompts, responses, 1.0, with_entropy=False)
        engine.backward(-lp.sum())
        assert engine.optimizer_step() > 0
        engine.lr_scheduler_step()
    assert not engine.model.training


def test_engine_checkpoint_roundtrip_restores_weights_optimizer_and_scheduler(tmp_path) -> None:
    from rftpipe.checkpoint.writer import Writer, list_committed, load
    from rftpipe.dist import Dist

    a = _engine()
    _update(a)
    writer = Writer(Dist())
    writer.submit(tmp_path, 1, {"engine": a}, keep_last=2)
    writer.wait()
    _update(a)  # a moves on past the checkpoint
    b = _engine()
    load(list_committed(tmp_path)[-1], {"engine": b})
    assert b.scheduler.last_epoch == 1 and b.optimizer.param_groups[0]["lr"] != 1e-2
    _update(b)  # b replays the same update from the checkpoint
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    for (n, pa_), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa_, pb), n


@pytest.mark.kernels
def test_reference_role_scores_but_never_trains() -> None:
    ref = _engine("reference")
    prompts, responses = _rows()
    got = ref.compute_logprobs(prompts, responses, 0.7)
    mb = build_micro_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        want, _ = response_logprobs(ref.model, mb, 0.7, with_entropy=False)
    assert [len(r) for r in got] == [len(r) for r in responses]
    for i, row in enumerate(got):
        assert torch.allclose(torch.tensor(row), want[i, : len(row)], atol=1e-5)
    assert not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="reference"):
        ref.optimizer_step()


def test_background_checkpoint_commits_and_restores(tmp_path) -> None:
    from rftpipe.checkpoint.writer import Writer, list_committed, load, verify
    from rftpipe.dist import Dist

    a = _engine()
    _update(a)
    writer = Writer(Dist())
    writer.submit(tmp_path, 3, {"engine": a}, keep_last=2)
    writer.wait()  # what the next train stage does before it changes the weights
    [ckpt] = list_committed(tmp_path)
    assert ckpt.step == 3
    verify(ckpt)
    _update(a)
    b = _engine()
    load(ckpt, {"engine": b})
    _update(b)
    pairs = zip(a.model.parameters(), b.model.parameters(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


def test_a_stop_abandons_a_checkpoint_still_writing_at_its_deadline(tmp_path, monkeypatch):
    """`wait(until=)` (a stop before Slurm's kill): a write still running then stops at its
    next piece, commits nothing and says so in the event log; the next checkpoint commits."""
    import json
    import time

    from rftpipe.checkpoint.writer import Writer, list_committed, load
    from rftpipe.dist import Dist
    from rftpipe.events import EventLog, set_event_log

    a = _engine()
    _update(a)
    set_event_log(EventLog(tmp_path / "events.jsonl"))
    try:
        monkeypatch.setenv("RFTPIPE_SLOW", "checkpoint=600")  # a slow writer: 600 s a file
        writer = Writer(Dist())
        writer.submit(tmp_path / "ck", 1, {"engine": a}, keep_last=2)
        t0 = time.monotonic()
        writer.wait(until=time.time() + 0.5)
        assert time.monotonic() - t0 < 60, "the stop waited for the slowed write"
        assert list_committed(tmp_path / "ck") == [] and (tmp_path / "ck" / ".tmp-step=1").is_dir()
        logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [(e["event"], e["step"]) for e in logged] == [("checkpoint_abandoned", 1)]
        monkeypatch.delenv("RFTPIPE_SLOW")
        writer.submit(tmp_path / "ck", 2, {"engine": a}, keep_last=2)
        writer.wait(until=time.time() + 600)  # time enough: it commits as without a deadline
    finally:
        set_event_log(EventLog(None))
    [ckpt] = list_committed(tmp_path / "ck")
    b = _engine()
    load(ckpt, {"engine": b})
    pairs = zip(a.model.parameters(), b.model.parameters(), strict=True)
    assert ckpt.step == 2 and all(torch.equal(x, y) for x, y in pairs)


def test_background_checkpoint_failure_surfaces_and_commits_nothing(tmp_path) -> None:
    from rftpipe.checkpoint.writer import Writer, list_committed
    from rftpipe.dist import Dist

    a = _engine()
    state = a.state_dict()
    # DCP cannot store a sparse tensor: a real failure inside the writer thread.
    state["model"]["broken"] = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    a.state_dict = lambda: state
    writer = Writer(Dist())
    writer.submit(tmp_path, 1, {"engine": a}, keep_last=2)
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        writer.wait()
    assert list_committed(tmp_path) == []
    assert writer.wait() == 0.0  # the failure is reported once


def test_background_checkpoint_disk_full_names_the_cause(tmp_path, monkeypatch) -> None:
    """A failed write inside torch.save reaches the user as the OS error, not as torch's
    "unexpected pos" zip message, and nothing is committed."""
    import os

    from rftpipe.checkpoint.writer import Writer, list_committed
    from rftpipe.dist import Dist

    a = _engine()
    _update(a)
    real_write = os.write

    def disk_full(fd, data):  # noqa: ANN001 (os.write's signature)
        if len(data) > 32 << 10:  # a checkpoint piece, not the small metadata writes
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    writer = Writer(Dist())
    writer.submit(tmp_path, 1, {"engine": a}, keep_last=2)
    with pytest.raises(
        RuntimeError, match="checkpoint write failed: no space left on device writing"
    ):
        writer.wait()
    assert list_committed(tmp_path) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_checkpoint_load_verifies_the_blocks_it_reads(tmp_path, damage: str) -> None:
    """A damaged DCP file is refused by the load itself (no separate checksum pass)."""
    from rftpipe.atomic import CorruptionError
    from rftpipe.checkpoint.writer import Writer, list_committed, load
    from rftpipe.dist import Dist

    a = _engine()
    _update(a)
    writer = Writer(Dist())
    writer.submit(tmp_path, 1, {"engine": a}, keep_last=2)
    writer.wait()
    [ckpt] = list_committed(tmp_path)
    data = next(ckpt.path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[len(raw) * 2 // 3] ^= 0x10  # deep inside a tensor's bytes, not the zip headers
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(bytes(raw[:-5]))
    else:
        data.unlink()
    with pytest.raises(CorruptionError, match=data.name):
        load(ckpt, {"engine": _engine()})


class _Part:
    """A Stateful with a 'model' and an 'optim' tensor, as the engine's state is split."""

    def __init__(self, n: int, fill: float) -> None:
        self.state = {
            "model": {"w": torch.full((n,), fill)},
            "optim": {"m": torch.full((n,), fill)},
        }

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            for name, t in v.items():
                self.state[k][name].copy_(t)


def test_restart_loads_optimizer_state_later_and_verifies_it(tmp_path) -> None:
    """`load(..., later=writer)` applies the model part at once and the optimizer part at
    the writer's next `wait()`; damage in a block only the late part reads is raised there."""
    from rftpipe.atomic import CorruptionError
    from rftpipe.checkpoint.writer import Writer, list_committed, load
    from rftpipe.dist import Dist

    n = 3 << 20  # 12 MB a tensor: the optimizer's bytes lie in blocks of their own
    writer = Writer(Dist())
    writer.submit(tmp_path, 1, {"p": _Part(n, 1.5)}, keep_last=2)
    writer.wait()
    [ckpt] = list_committed(tmp_path)

    part = _Part(n, 0.0)
    later = Writer(Dist())
    load(ckpt, {"p": part}, later=later)
    assert torch.equal(part.state["model"]["w"], torch.full((n,), 1.5))
    later.wait()
    assert torch.equal(part.state["optim"]["m"], torch.full((n,), 1.5))

    data = next(ckpt.path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-4096] ^= 0x01  # inside the optimizer tensor, written after the model's
    data.write_bytes(bytes(raw))
    part = _Part(n, 0.0)
    load(ckpt, {"p": part}, later=later)  # the model's blocks are intact
    assert torch.equal(part.state["model"]["w"], torch.full((n,), 1.5))
    with pytest.raises(CorruptionError, match=data.name):
        later.wait()
    assert later.wait() == 0.0  # reported once


def test_generate_rows_seeds_each_row_alone_and_cuts_at_its_limit(tiny) -> None:
    """A multi-turn episode's turns: row r's draws come from its own seed, so the other
    rows' seeds never change it; each row stops at its own token limit."""
    model, tok = tiny
    engine = HFGenerateEngine(model, RolloutConfig(max_new_tokens=8), eos_id=0, pad_id=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    a = engine.generate_rows(prompts, [1, 2, 3], [8, 5, 0])
    b = engine.generate_rows(prompts, [1, 7, 9], [8, 5, 0])
    assert a[0] == b[0] and a[1] != b[1]
    assert [len(s.tokens) for s in a] == [8, 5, 0]
    assert [s.finish_reason for s in a] == ["length"] * 3
    assert all(len(s.logprobs) == len(s.tokens) for s in a)
    assert all(lp <= 0 for s in a for lp in s.logprobs)
    assert engine.generate_rows(prompts, [1, 2, 3], [8, 5, 0]) == a  # reproducible


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # 2 warm-up updates, then 4 more: the multiplier at updates 0..6.
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466, 0.0]),
    ],
)
def test_lr_schedules_warm_up_then_decay_to_their_end(schedule, expected) -> None:
    from rftpipe.config.schema import TrainConfig
    from rftpipe.engines.train.base import lr_lambda

    f = lr_lambda(TrainConfig(lr_schedule=schedule, warmup_steps=2), total_updates=6)
    assert [f(i) for i in range(7)] == pytest.approx(expected, abs=1e-7)
