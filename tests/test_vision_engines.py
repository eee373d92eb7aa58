"""Vision-language engines: the HF rollout loop with image prompts (prefilled once per
group, M-RoPE decode positions) against `generate` and against a full forward; the padded
train forward with images against one forward per row; freezing the vision tower."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from rftpipe.config.schema import EnvConfig, RolloutConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.base import adamw
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.engines.train.vision import (
    build_vision_micro_batch,
    freeze_vision,
    vision_response_logprobs,
    vision_tower,
)
from rftpipe.engines.vision import EncodedPrompt, VisionEncoder, collate

#: Two computations of the same rows' float32 logprobs and entropies (a padded batch against
#: one forward per row, a cached decode against a full forward) round differently, and
#: differently again on each CPU kernel ATen picks (AVX-512, AVX2, the scalar ones of
#: `ATEN_CPU_CAPABILITY=default`). The rounding scales with the values (log-sum-exps over
#: the vocabulary, about 5 on this random model), so the bound is relative: the worst seen
#: over those three kernels, on this 2-core AMD EPYC and a 16-core Intel Xeon with AVX-512
#: (2026-11-27), was 5.2e-7 (4.4 float32 eps); 2e-6 (17 eps) holds with room. An absolute
#: 1e-6 failed at 1.43e-6 on AVX-512 and the scalar kernels.
LOGPROB_RTOL = 2e-6


@pytest.fixture(scope="module")
def model(tiny_vl: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()


@pytest.mark.kernels
def test_greedy_rows_with_images_equal_generate(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    tok = vl_encoder.tokenizer
    # No EOS stop: every row decodes the full length, so each step's positions are checked.
    engine = HFGenerateEngine(model, RolloutConfig(max_new_tokens=10), -1, tok.pad_token_id)
    got = engine.greedy_rows(
        [e.input_ids for e in vl_prompts], [10] * 3, [e.vision_inputs() for e in vl_prompts]
    )
    # Evaluation's `greedy` (`generate` on the left-padded batch) gives the same tokens.
    vision = [e.vision_inputs() for e in vl_prompts]
    assert engine.greedy([e.input_ids for e in vl_prompts], 10, vision=vision) == [
        o.tokens for o in got
    ]
    # top_k=1 samples greedily and records each token's logprob: `generate`'s logits must
    # agree at every step (on a random model the argmax alone barely sees the positions).
    top1 = HFGenerateEngine(model, RolloutConfig(top_k=1, max_new_tokens=10), -1, 0)
    groups = top1.generate_groups(
        [e.input_ids for e in vl_prompts], 1, [0] * 3, [e.vision_inputs() for e in vl_prompts]
    )
    for e, out, g in zip(vl_prompts, got, groups, strict=True):
        batch = collate([e], tok.pad_token_id)
        ref = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = ref.sequences[0, len(e.input_ids) :]
        assert out.tokens == g.tokens[0] == new.tolist()
        lsm = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), -1)
        ref_lp = lsm.gather(-1, new[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs[0]), ref_lp, rtol=LOGPROB_RTOL, atol=0)
    # The image prompts' decode positions are not their lengths (else the test is moot):
    # an image of h x w merged patches spans max(h, w) positions.
    _, deltas = model.model.get_rope_index(
        **{k: v for k, v in collate(vl_prompts[:2], 0).items() if k != "pixel_values"}
    )
    assert (deltas != 0).all()


@pytest.mark.kernels
def test_sampled_logprobs_agree_with_a_full_forward(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    tok = vl_encoder.tokenizer
    cfg = RolloutConfig(n=2, max_new_tokens=6, temperature=0.9)
    engine = HFGenerateEngine(model, cfg, -1, tok.pad_token_id)
    vision = [e.vision_inputs() for e in vl_prompts]
    groups = engine.generate_groups([e.input_ids for e in vl_prompts], 2, [7, 8, 9], vision)
    again = engine.generate_groups([e.input_ids for e in vl_prompts], 2, [7, 8, 9], vision)
    assert [g.tokens for g in groups] == [g.tokens for g in again]  # seeded
    # The trainer's forward (one padded batch of all six rows) gives the same logprobs.
    rows = [(e, r) for e, g in zip(vl_prompts, groups, strict=True) for r in g.tokens]
    vb = build_vision_micro_batch(
        model,
        [e.input_ids for e, _ in rows],
        [r for _, r in rows],
        [e.vision_inputs() for e, _ in rows],
        tok.pad_token_id,
    )
    with torch.no_grad():
        lp, _ = vision_response_logprobs(model, vb, cfg.temperature, with_entropy=False)
    got = [lps for g in groups for lps in g.logprobs]
    for i, lps in enumerate(got):
        torch.testing.assert_close(torch.tensor(lps), lp[i, : len(lps)], rtol=LOGPROB_RTOL, atol=0)


RESPONSES = [[40, 41, 42, 43, 44], [50, 51], [60, 61, 62, 63, 64, 65, 66]]


def own_forward_logprobs(model: Any, e: EncodedPrompt, resp: list[int], pad: int) -> Any:
    """Row logprobs from the model's own forward of prompt+response (its own positions)."""
    model.model.rope_deltas = None  # `generate` leaves it set
    full = EncodedPrompt(
        input_ids=(*e.input_ids, *resp),
        mm_token_type_ids=(*e.mm_token_type_ids, *[0] * len(resp)),
        pixel_values=e.pixel_values,
        image_grid_thw=e.image_grid_thw,
    )
    logits = model(**collate([full], pad)).logits[0].float()
    pred = logits[len(e.input_ids) - 1 : -1]
    lsm = torch.log_softmax(pred, -1)
    return lsm.gather(-1, torch.tensor(resp)[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


@pytest.mark.kernels
def test_padded_train_forward_with_images_equals_one_forward_per_row(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    pad = vl_encoder.tokenizer.pad_token_id
    weights = [torch.linspace(-1, 1, len(r)) for r in RESPONSES]
    model.zero_grad()
    ref_lp, ref_ent = [], []
    for e, r, w in zip(vl_prompts, RESPONSES, weights, strict=True):
        lp, ent = own_forward_logprobs(model, e, r, pad)
        (lp * w).sum().backward()
        ref_lp.append(lp.detach())
        ref_ent.append(ent.detach())
    ref_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # Mixed image and text rows in one micro-batch, unequal lengths (right padding).
    vb = build_vision_micro_batch(
        model,
        [e.input_ids for e in vl_prompts],
        RESPONSES,
        [e.vision_inputs() for e in vl_prompts],
        pad,
    )
    lp, ent = vision_response_logprobs(model, vb, 1.0, with_entropy=True)
    assert ent is not None
    loss = sum(
        (lp[i, : len(r)] * w).sum() for i, (r, w) in enumerate(zip(RESPONSES, weights, strict=True))
    )
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    for i, r in enumerate(RESPONSES):
        torch.testing.assert_close(lp[i, : len(r)].detach(), ref_lp[i], rtol=LOGPROB_RTOL, atol=0)
        torch.testing.assert_close(ent[i, : len(r)].detach(), ref_ent[i], rtol=LOGPROB_RTOL, atol=0)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grad.keys()
    assert any(n.startswith("model.visual.") for n in grads)  # the tower is differentiated
    for n, g in grads.items():
        err = (g - ref_grad[n]).norm() / ref_grad[n].norm().clamp(min=1e-30)
        # Relative in norm: a gradient sums many rounded products (worst seen 1e-6 or less).
        assert err <= 1e-5, (n, float(err))
    model.zero_grad()


def test_a_frozen_vision_tower_stays_out_of_the_step(
    tiny_vl: Path, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    tower = vision_tower(model)
    frozen = freeze_vision(model)
    assert frozen == sum(p.numel() for p in tower.parameters()) > 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = adamw(TrainConfig(lr=1e-3), model)
    vb = build_vision_micro_batch(
        model,
        [e.input_ids for e in vl_prompts],
        RESPONSES,
        [e.vision_inputs() for e in vl_prompts],
        vl_encoder.tokenizer.pad_token_id,
    )
    lp, _ = vision_response_logprobs(model, vb, 1.0, with_entropy=False)
    (-lp[vb.mb.response_mask].sum()).backward()
    opt.step()
    tower_ids = {id(p) for p in tower.parameters()}
    assert not tower_ids & {id(p) for g in opt.param_groups for p in g["params"]}
    assert not tower_ids & {id(p) for p in opt.state}
    assert len(opt.state) == sum(1 for p in model.parameters() if p.requires_grad)
    for n, p in model.named_parameters():
        if id(p) in tower_ids:
            assert p.grad is None and torch.equal(p, before[n]), n
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(not n.startswith("model.visual.") for n in moved)
    assert any(n.startswith("model.language_model.") for n in moved)


def test_a_groups_image_prompt_is_prefilled_once(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    """n samples of a group share one prefill: the vision tower sees each image once."""
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[0])
    )
    try:
        engine = HFGenerateEngine(model, RolloutConfig(max_new_tokens=3), -1, 0)
        engine.generate_groups(
            [e.input_ids for e in vl_prompts], 4, [1, 2, 3], [e.vision_inputs() for e in vl_prompts]
        )
    finally:
        hook.remove()
    patches = sum(e.pixel_values.shape[0] for e in vl_prompts if e.pixel_values is not None)
    assert seen == [patches]


@pytest.mark.kernels
def test_episode_turns_continue_an_image_prompts_cache(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    """Multi-turn: the first turn's prompt holds the images, a later turn appends text to
    the kept cache (its positions continue the M-RoPE ones); every turn's logprobs are the
    trainer's over the whole conversation."""
    pad = vl_encoder.tokenizer.pad_token_id
    cfg = RolloutConfig(n=2, max_new_tokens=4, temperature=0.9)
    engine = HFGenerateEngine(model, cfg, -1, pad)
    assert engine.continues_turns
    rows = [e for e in vl_prompts for _ in range(2)]  # two episodes a prompt
    vision = [e.vision_inputs() for e in rows]
    keys = list(range(len(rows)))
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[0])
    )
    try:
        first = engine.generate_rows(
            [e.input_ids for e in rows], [10, 11, 12, 13, 14, 15], [4] * 6, keys, vision
        )
    finally:
        hook.remove()
    # A group's two episodes share one prefill: each image through the tower once.
    assert seen == [sum(e.pixel_values.shape[0] for e in vl_prompts if e.pixel_values is not None)]
    history = [
        [*e.input_ids, *o.tokens, 70 + i, 71]
        for i, (e, o) in enumerate(zip(rows, first, strict=True))
    ]
    with pytest.raises(ValueError, match="later turn"):
        engine.generate_rows(history, [0] * 6, [4] * 6, keys, vision)
    second = engine.generate_rows(history, [20, 21, 22, 23, 24, 25], [4] * 6, keys)
    engine.end_episodes()
    # `keep_kv_cache=false`: the second turn prefills the whole history, images included.
    env = EnvConfig(path="envs_toy:EvenChars", keep_kv_cache=False)
    again = HFGenerateEngine(model, dataclasses.replace(cfg, env=env), -1, pad)
    assert not again.continues_turns
    redone = again.generate_rows(history, [20, 21, 22, 23, 24, 25], [4] * 6, keys, vision)
    turns = ([[e.input_ids for e in rows], first], [history, second], [history, redone])
    for turn_prompts, outs in turns:
        vb = build_vision_micro_batch(model, turn_prompts, [o.tokens for o in outs], vision, pad)
        with torch.no_grad():
            lp, _ = vision_response_logprobs(model, vb, cfg.temperature, with_entropy=False)
        for i, o in enumerate(outs):
            assert o.tokens
            torch.testing.assert_close(
                torch.tensor(o.logprobs), lp[i, : len(o.tokens)], rtol=LOGPROB_RTOL, atol=0
            )


@pytest.mark.kernels
def test_the_single_engine_trains_rows_with_images(
    tiny_vl: Path, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    """`train.backend=single` takes rows with images (mixed with a text row), a frozen tower
    stays out of its step and of its checkpoint's optimizer state, and a reference engine
    scores the same rows."""
    from transformers import AutoModelForImageTextToText

    pad = vl_encoder.tokenizer.pad_token_id
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    freeze_vision(model)
    tower = {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = SingleDeviceEngine(model, TrainConfig(lr=1e-3), Dist())
    vision = [e.vision_inputs() for e in vl_prompts]
    ids = [e.input_ids for e in vl_prompts]
    with engine.train_mode():
        lp, ent = engine.forward(ids, RESPONSES, 1.0, with_entropy=True, vision=vision)
        assert ent is not None
        with torch.no_grad():
            for i, (e, r) in enumerate(zip(vl_prompts, RESPONSES, strict=True)):
                ref, _ = own_forward_logprobs(model, e, r, pad)
                torch.testing.assert_close(lp[i, : len(r)].detach(), ref, rtol=LOGPROB_RTOL, atol=0)
        engine.backward(-lp[:, :2].sum())
        engine.optimizer_step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not moved & tower
    state = engine.state_dict()
    optim_keys = set(state["optim"]["state"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert optim_keys == trainable and trainable and not trainable & tower
    assert not tower & state["model"].keys()

    ref_model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    reference = SingleDeviceEngine(ref_model, TrainConfig(), Dist(), role="reference")
    after = engine.compute_logprobs(ids, RESPONSES, 1.0, vision)
    initial = reference.compute_logprobs(ids, RESPONSES, 1.0, vision)
    with torch.no_grad():
        for e, r, a, b in zip(vl_prompts, RESPONSES, after, initial, strict=True):
            for m, got in ((model, a), (ref_model, b)):
                want, _ = own_forward_logprobs(m, e, r, pad)
                torch.testing.assert_close(torch.tensor(got), want, rtol=LOGPROB_RTOL, atol=0)
        assert after != initial


@pytest.mark.kernels
def test_a_groups_rows_run_the_tower_once_in_a_micro_batch(
    model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    """Rows that share their prompt's inputs (a group's, as `RowImages` gives them) run the
    tower on its images once, and take the same logprobs and gradients as rows given
    separate copies (each image through the tower once per row)."""
    pad = vl_encoder.tokenizer.pad_token_id
    one, two, text = (e.vision_inputs() for e in vl_prompts)
    assert one is not None and two is not None and text is None
    rows = [0, 0, 0, 1, 1, 2]
    ids = [vl_prompts[i].input_ids for i in rows]
    resp = [RESPONSES[i][: 2 + k] for k, i in enumerate(rows)]
    shared = [one, one, one, two, two, None]
    copies = [dataclasses.replace(v) if v is not None else None for v in shared]
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[0])
    )
    out = {}
    try:
        for name, vision in (("shared", shared), ("copies", copies)):
            model.zero_grad()
            vb = build_vision_micro_batch(model, ids, resp, vision, pad)
            lp, _ = vision_response_logprobs(model, vb, 1.0, with_entropy=False)
            (lp * vb.mb.response_mask).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            out[name] = (lp.detach(), grads)
    finally:
        hook.remove()
        model.zero_grad()
    patches = [one.pixel_values.shape[0], two.pixel_values.shape[0]]
    assert seen == [patches[0] + patches[1], 3 * patches[0] + 2 * patches[1]]
    torch.testing.assert_close(out["shared"][0], out["copies"][0], rtol=LOGPROB_RTOL, atol=0)
    assert out["shared"][1].keys() == out["copies"][1].keys()
    for n, g in out["shared"][1].items():
        ref = out["copies"][1][n]
        assert float((g - ref).norm() / ref.norm().clamp(min=1e-30)) <= 1e-5, n


@pytest.mark.kernels
def test_a_text_step_of_a_vlm_takes_the_forest_and_zero_tower_gradients(
    tiny_vl: Path, vl_prompts: list[EncodedPrompt]
) -> None:
    """`single`: a micro-batch without images takes the prefix forest (its logprobs equal
    the padded image forward's), and a step with no image gives the trained tower zero
    gradients, not none: AdamW keeps state for it and its weight decay moves it, as on the
    sharded backends, whose every forward runs the tower."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1)
    engine = SingleDeviceEngine(model, cfg, Dist())
    ids = [vl_prompts[2].input_ids] * 2
    with engine.train_mode():
        lp, _ = engine.forward(ids, RESPONSES[:2], 1.0, with_entropy=False)
        vb = build_vision_micro_batch(model, ids, RESPONSES[:2], [None, None], 0)
        padded, _ = vision_response_logprobs(model, vb, 1.0, with_entropy=False)
        for i, r in enumerate(RESPONSES[:2]):
            torch.testing.assert_close(
                lp[i, : len(r)], padded[i, : len(r)], rtol=LOGPROB_RTOL, atol=0
            )
        engine.backward(-lp[:, :2].sum())
        engine.optimizer_step()
    tower = [(n, p) for n, p in model.named_parameters() if n.startswith("model.visual.")]
    decay = {p for g in engine.optimizer.param_groups if g["weight_decay"] for p in g["params"]}
    assert tower and any(p in decay for _, p in tower)
    for n, p in tower:
        assert p in engine.optimizer.state, n
        # The update of a zero gradient is 0; only decay (where its group has it) moves it.
        want = before[n] * (1 - 1e-3 * 0.1) if p in decay else before[n]
        torch.testing.assert_close(p.detach(), want, atol=0, rtol=1e-6)
