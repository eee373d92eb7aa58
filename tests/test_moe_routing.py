"""Routing replay on MoE policies (rftpipe/engines/moe.py): what the hooks record and
replay, on random tiny Mixtral and Qwen3-MoE models built here (their experts differ, so
the selection matters; an upcycled model's are copies of one MLP)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from rftpipe.config.schema import RolloutConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines import moe
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.base import _EngineBase
from rftpipe.engines.train.forward import build_micro_batch, grouped_logprobs, root_forward_logprobs
from rftpipe.engines.train.packing import PackRow, pack_rows, packed_logprobs
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.errors import UserError

VOCAB, EOS, PAD = 64, 63, 0
# The rollout engines' tolerance between their logprobs and the trainer's on CPU fp32
# (tests/test_rollout_engines.py bounds the HF loop against the train forward alike).
TOL = 1e-4


def _mixtral(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        # Experts far enough apart that another selection moves the logits visibly.
        initializer_range=0.2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _qwen3_moe(norm_topk_prob: bool) -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _ids(rows: int = 3, width: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB - 1, (rows, width), generator=g)


def _record(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Live logits and each row's routes over all of its tokens."""
    routers = moe.Routers.of(model)
    assert routers is not None
    with routers.recording(noise=0.0):
        logits = model(input_ids=ids).logits
        got = routers.take()
    slots = moe.padded_slots(torch.ones_like(ids))
    n = ids.shape[1]
    return logits, moe.cut_rows(got, slots, [n] * len(ids), [n] * len(ids))


def _replay(model: torch.nn.Module, ids: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
    routers = moe.Routers.of(model)
    assert routers is not None
    moe.RowRoutes(routers=routers, rows=routes).apply(moe.padded_slots(torch.ones_like(ids)))
    try:
        return model(input_ids=ids).logits
    finally:
        routers.clear()


def test_replaying_the_live_selection_is_bitwise_the_live_forward() -> None:
    model = _mixtral()
    ids = _ids()
    live, routes = _record(model, ids)
    assert torch.equal(_replay(model, ids, routes), live)
    # Qwen3-MoE, with a dense layer among the MoE ones: only the MoE layers route.
    for norm in (True, False):
        q = _qwen3_moe(norm)
        shape = moe.route_shape(q)
        assert shape == moe.RouteShape(layers=2, experts=4, top_k=2)
        live, routes = _record(q, ids)
        assert routes[0].shape == (ids.shape[1], 2, 2)
        assert torch.equal(_replay(q, ids, routes), live)


def test_replayed_ids_are_used() -> None:
    model = _mixtral()
    ids = _ids()
    live, routes = _record(model, ids)
    shifted = [((r.long() + 1) % 4).to(torch.uint8) for r in routes]
    moved = (_replay(model, ids, shifted) - live).abs().max()
    assert moved > 0.05, float(moved)


def test_the_router_keeps_its_gradient_and_it_equals_the_live_one() -> None:
    """Weights gathered from the full softmax at the replayed ids: with the live ids the
    gradient of every parameter, the router's included, is the live forward's, bitwise;
    with other ids the router still gets one."""
    model = _mixtral()
    routers = moe.Routers.of(model)
    assert routers is not None
    ids = _ids()
    live, routes = _record(model, ids)
    live.float().pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    _replay(model, ids, routes).float().pow(2).mean().backward()
    for name, grad in want.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name
    model.zero_grad(set_to_none=True)
    shifted = [((r.long() + 1) % 4).to(torch.uint8) for r in routes]
    _replay(model, ids, shifted).float().pow(2).mean().backward()
    for r in routers.modules:
        assert r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0


def test_replayed_weights_are_the_full_softmax_renormalised_as_the_model_does() -> None:
    """Forcing experts outside the live top-k: their weights are softmax(logits) at those
    ids (not the zeros of a top-k-masked distribution), divided by their sum where the
    model renormalises (Mixtral; Qwen3-MoE with norm_topk_prob) and not where it does not."""
    for model, renorm in ((_mixtral(), True), (_qwen3_moe(True), True), (_qwen3_moe(False), False)):
        routers = moe.Routers.of(model)
        assert routers is not None
        seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        hook = routers.modules[0].register_forward_hook(
            lambda m, a, out, seen=seen: seen.append(out)
        )
        ids = _ids(rows=1)
        _, routes = _record(model, ids)
        seen.clear()
        # The experts the live router ranked last: never its own choice.
        logits_live = model(input_ids=ids)
        seen.clear()
        flipped = [((r.long() + 2) % 4).to(torch.uint8) for r in routes]
        _replay(model, ids, flipped)
        hook.remove()
        logits, weights, chosen = seen[0]
        assert torch.equal(chosen, flipped[0][:, 0].long())
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        expect = probs / probs.sum(-1, keepdim=True) if renorm else probs
        assert torch.equal(weights.float(), expect.to(weights.dtype).float())
        assert bool((weights > 0).all())
        del logits_live


def test_routes_are_prompt_plus_all_but_the_last_sampled_token_and_a_group_shares_its_prompts() -> (
    None
):
    model = _mixtral()
    cfg = RolloutConfig(n=3, max_new_tokens=6, temperature=1.0)
    engine = HFGenerateEngine(model, cfg, EOS, PAD, record_routes=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # left-padded to 7 in the prefill
    groups = engine.generate_groups(prompts, 3, [1, 2])
    for p, g in zip(prompts, groups, strict=True):
        assert g.routes is not None
        for toks, routes in zip(g.tokens, g.routes, strict=True):
            assert routes.dtype == torch.uint8
            assert routes.shape == (len(p) + len(toks) - 1, 2, 2)
            assert torch.equal(routes[: len(p)], g.routes[0][: len(p)])
        # Each fed token's route is what the train forward of the whole row selects live
        # (up to near-ties: the prefill and the decode steps are other kernels).
        for toks, routes in zip(g.tokens, g.routes, strict=True):
            _, full = _record(model, torch.tensor([list(p) + toks]))
            same = (full[0][: len(routes)].sort(-1).values == routes.sort(-1).values).all(-1)
            assert float(same.float().mean()) > 0.95


def _rollout(noise: float) -> tuple[torch.nn.Module, list, list, list, list]:
    model = _mixtral()
    cfg = RolloutConfig(n=4, max_new_tokens=8, temperature=1.0)
    engine = HFGenerateEngine(model, cfg, EOS, PAD, record_routes=True)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [3, 4, 5, 6, 7, 8]]  # a repeated prompt
    # The test-only fault, read by the recording the engine opens.
    os.environ["RFTPIPE_ROUTER_NOISE"] = str(noise)
    try:
        groups = engine.generate_groups(prompts, 4, [7, 8, 9])
    finally:
        del os.environ["RFTPIPE_ROUTER_NOISE"]
    P, R, LP, RT = [], [], [], []
    for p, g in zip(prompts, groups, strict=True):
        assert g.routes is not None
        for toks, lps, rt in zip(g.tokens, g.logprobs, g.routes, strict=True):
            P.append(p)
            R.append(toks)
            LP.append(lps)
            RT.append(rt)
    return model, P, R, LP, RT


def _gap(lp: torch.Tensor, R: list, LP: list) -> float:
    return max(float((lp[i, : len(r)] - torch.tensor(LP[i])).abs().max()) for i, r in enumerate(R))


def _three_layouts(model, P, R, routes) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Response logprobs through the prefix forest, right padding and packing."""
    routers = moe.Routers.of(model)
    assert routers is not None
    rr = None if routes is None else moe.RowRoutes(routers=routers, rows=routes)
    out = {}
    with torch.no_grad():
        routers.clear()
        out["forest"] = grouped_logprobs(model, P, R, 1.0, False, routes=rr)[0]
        routers.clear()
        mb = build_micro_batch(P, R, pad_id=0)
        out["padded"] = root_forward_logprobs(model, mb, 1.0, False, routes=rr)[0]
        routers.clear()
        keys = [b"" if rr is None else rr.prompt_key(i, len(p)) for i, p in enumerate(P)]
        rows = [
            PackRow(prompt=p, response=r, prompt_key=k) for p, r, k in zip(P, R, keys, strict=True)
        ]
        out["packed"] = packed_logprobs(model, pack_rows(rows), 1.0, False, routes=rr)[0]
        routers.clear()
    return out


@pytest.mark.kernels  # a tolerance between the rollout's kernels and the trainer's
def test_noise_in_the_rollouts_router_opens_a_gap_that_replay_closes_in_every_layout() -> None:
    """The rollout selects top-k from perturbed logits (weights from clean ones): routed
    live, the trainer disagrees with it and its logprobs of the sampled tokens move away
    from the rollout's; replaying the recorded routes closes the gap in the prefix forest,
    right padding (the rollout left-padded) and packing, a repeated prompt included."""
    model, P, R, LP, RT = _rollout(noise=1.0)
    replayed = _three_layouts(model, P, R, RT)
    live = _three_layouts(model, P, R, None)
    for name in replayed:
        assert _gap(replayed[name], R, LP) < TOL, name
        assert _gap(live[name], R, LP) > 50 * TOL, name
    routers = moe.Routers.of(model)
    assert routers is not None
    routers.take_stats()
    _three_layouts(model, P, R, RT)
    stats = routers.take_stats()
    assert stats.replayed > 0 and float(stats.agree.max()) < stats.replayed  # disagreement seen


@pytest.mark.kernels  # a tolerance between the rollout's kernels and the trainer's
def test_without_noise_replay_and_live_agree_with_the_rollout() -> None:
    model, P, R, LP, RT = _rollout(noise=0.0)
    for name, lp in _three_layouts(model, P, R, RT).items():
        assert _gap(lp, R, LP) < TOL, name


def test_a_prompt_repeated_with_other_routes_is_not_shared() -> None:
    """Two rows with the same prompt tokens but other prompt routes (prefilled in other
    batches) each replay their own: the layouts do not merge their prompts."""
    model = _mixtral()
    ids = _ids(rows=1, width=6)
    _, routes = _record(model, ids)
    p, r = ids[0, :4].tolist(), ids[0, 4:].tolist()
    other = routes[0].clone()
    other[:4] = (other[:4].long() + 1).remainder(4).to(torch.uint8)
    rows = [routes[0][:5], other[:5]]
    lp = _three_layouts(model, [p, p], [r, r], rows)
    for name, got in lp.items():
        assert not torch.equal(got[0], got[1]), name  # each its own prompt routes
        alone = _three_layouts(model, [p], [r], rows[1:])[name]
        assert float((got[1, : len(r)] - alone[0, : len(r)]).abs().max()) < 1e-5, name


def test_r2_records_the_actor_forward_and_replays_it_bitwise() -> None:
    """`compute_logprobs(record=...)` (R2's old-logprob pass) gives each row's P + R - 1
    routes, a shared prompt's to every row of its tree; replaying them in the training
    forward reproduces the recorded forward's logprobs exactly."""
    model = _mixtral()
    engine = SingleDeviceEngine(model, TrainConfig(micro_batch_size=3), Dist(), total_updates=1)
    P = [[3, 4, 5], [3, 4, 5], [6, 7], [3, 4, 5]]
    R = [[8, 9, 10], [11], [12, 13], [14, 15, 16, 17]]
    recorded: list[torch.Tensor] = []
    old = engine.compute_logprobs(P, R, 1.0, record=recorded)
    assert [len(r) for r in recorded] == [len(p) + len(r) - 1 for p, r in zip(P, R, strict=True)]
    assert torch.equal(recorded[0][:3], recorded[1][:3])
    again = engine.compute_logprobs(P, R, 1.0, routes=recorded)
    assert again == old
    with engine.train_mode():  # the micro-batches compute_logprobs cut (3 rows, then 1)
        for cut in (slice(0, 3), slice(3, 4)):
            lp, _ = engine.forward(P[cut], R[cut], 1.0, with_entropy=False, routes=recorded[cut])
            for row, (r, want) in enumerate(zip(R[cut], old[cut], strict=True)):
                assert lp[row, : len(r)].tolist() == want
    assert isinstance(engine, _EngineBase) and engine.routers is moe.Routers.of(model)


def test_the_aux_loss_is_mixtrals_on_the_live_selection() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 4, generator=g)
    ids = torch.softmax(logits, -1).topk(2, dim=-1).indices
    ours = moe.aux_loss(logits, ids, torch.ones(50, dtype=torch.bool), 4)
    theirs = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    assert float((ours - theirs).abs()) < 1e-6
    # Padding does not count: the same loss over the real tokens alone.
    padded = torch.cat([logits, torch.randn(7, 4, generator=g)])
    pids = torch.cat([ids, torch.zeros(7, 2, dtype=torch.long)])
    real = torch.arange(57) < 50
    assert float((moe.aux_loss(padded, pids, real, 4) - ours).abs()) < 1e-6


def test_a_route_cell_that_does_not_match_its_tokens_is_refused_naming_the_row() -> None:
    shape = moe.RouteShape(layers=2, experts=4, top_k=2)
    good = moe.encode(torch.zeros(5, 2, 2, dtype=torch.uint8))
    assert moe.decode(good, 5, shape, "row x").shape == (5, 2, 2)
    with pytest.raises(
        UserError, match="step 3 prompt_id 7 sample 1: its routes hold 16 bytes, not 20"
    ):
        moe.decode(good[:-4], 5, shape, "step 3 prompt_id 7 sample 1")
    bad = moe.encode(torch.full((5, 2, 2), 4, dtype=torch.uint8))
    with pytest.raises(UserError, match="name expert 4 of 4"):
        moe.decode(bad, 5, shape, "row x")


def test_activation_recompute_replays_the_same_routes() -> None:
    """With gradient checkpointing the backward runs each layer's forward again: the plan
    stays set through it, so the gradients equal those without checkpointing, under routes
    that differ from the live selection (a recompute routed live would differ)."""
    ids = _ids()
    P, R = [ids[0, :4].tolist()] * 2, [ids[0, 4:].tolist(), ids[1, 4:].tolist()]
    grads = []
    for checkpointing in (False, True):
        model = _mixtral()
        _, routes = _record(model, torch.tensor([P[0] + R[0], P[1] + R[1]]))
        shifted = [((r[:-1].long() + 1) % 4).to(torch.uint8) for r in routes]
        cfg = TrainConfig(gradient_checkpointing=checkpointing)
        engine = SingleDeviceEngine(model, cfg, Dist(), total_updates=1)
        with engine.train_mode():
            lp, _ = engine.forward(P, R, 1.0, with_entropy=False, routes=shifted)
            engine.backward(lp.sum())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name
