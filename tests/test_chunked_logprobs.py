"""Chunked logprobs (`train.logprob_chunk_size`): the head's logits a chunk of positions at
a time, in the forward and again in the backward, equal to the full-logits path (fp32:
values within 1e-6, gradients within 1e-5 relative) and never holding a micro-batch's
full (tokens x vocabulary) logits for the backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rftpipe.algos.losses import entropy_from_logits, gather_logprobs
from rftpipe.engines.train.chunked_head import chunked_head_logprobs
from rftpipe.engines.train.forward import (
    build_micro_batch,
    grouped_logprobs,
    logprob_chunk_size,
    root_forward_logprobs,
)

VOCAB = 1000


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """A 2-layer Llama whose vocabulary (1000) dwarfs its width (32), so the logits are the
    biggest tensors of the forward, as SmolLM2's 49k vocabulary is at width 576."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    m = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # logits far from uniform
    return m


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[5, 6, 7, 8, 9, 10]] * 3 + [[40, 41, 42]] * 2
    responses = [[11, 12, 13, 14], [15, 16], [17], [50, 51, 52, 53, 54], [955, 56, 999]]
    return prompts, responses


@pytest.mark.parametrize(("chunk", "with_bias"), [(1, False), (7, True), (64, False)])
@pytest.mark.kernels
def test_chunked_head_equals_full_logits(chunk: int, with_bias: bool) -> None:
    torch.manual_seed(chunk)
    head = torch.nn.Linear(16, VOCAB, bias=with_bias)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    tokens = torch.randint(0, VOCAB, (2, 9))
    g_lp, g_ent = torch.randn(2, 9), torch.randn(2, 9)

    def run(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        head.zero_grad()
        hidden.grad = None
        lp, ent = fn()
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if with_bias else [])
        return [lp.detach(), ent.detach(), *[g.clone() for g in grads]]

    def full() -> tuple[torch.Tensor, torch.Tensor]:
        # The unchunked path's own functions (forward._head_logprobs without a chunk).
        logits = head(hidden).float()
        return gather_logprobs(logits, tokens, 0.7), entropy_from_logits(logits / 0.7)

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = chunked_head_logprobs(head, hidden, tokens, 0.7, chunk, with_entropy=True)
        assert ent is not None
        return lp, ent

    ref, got = run(full), run(chunked)
    assert (got[0] - ref[0]).abs().max() <= 1e-6
    assert (got[1] - ref[1]).abs().max() <= 1e-6
    for g, r in zip(got[2:], ref[2:], strict=True):
        assert _rel(g, r) <= 1e-5


def _largest_saved(model: torch.nn.Module, fn: Callable[[], torch.Tensor]) -> int:
    """The most elements any activation (a tensor saved for the backward that is not one of
    the model's parameters) has, while `fn` builds its graph."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: list[int] = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().backward()
    return max(sizes)


@pytest.mark.parametrize("path", ["grouped", "root"])
@pytest.mark.kernels
def test_model_forward_chunked_equals_full_and_keeps_no_logits(
    model: LlamaForCausalLM, path: str
) -> None:
    """Through the single backend's prefix forward and through the root forward the sharded
    backends run (the head's forward replaced while the model's own forward runs)."""
    prompts, responses = _rows()
    mb = build_micro_batch(prompts, responses, pad_id=0)
    mask = mb.response_mask
    g_lp = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    g_ent = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))

    def forward(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        if path == "grouped":
            lp, ent = grouped_logprobs(model, prompts, responses, 0.8, True, chunk=chunk)
        else:
            lp, ent = root_forward_logprobs(model, mb, 0.8, True, chunk=chunk)
        assert ent is not None
        return lp, ent

    def loss(chunk: int) -> torch.Tensor:
        lp, ent = forward(chunk)
        return torch.where(mask, lp * g_lp + ent * g_ent, 0.0).sum()

    results = []
    for chunk in (0, 4):
        model.zero_grad()
        largest = _largest_saved(model, lambda c=chunk: loss(c))
        with torch.no_grad():
            lp, ent = forward(chunk)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp, ent, grads, largest))
    (lp0, ent0, g0, big0), (lp1, ent1, g1, big1) = results
    assert (lp1 - lp0).abs()[mask].max() <= 1e-6
    assert (ent1 - ent0).abs()[mask].max() <= 1e-6
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        assert _rel(g1[n], g0[n]) <= 1e-5, n
    # Full logits of the response positions (B x T x V) are kept only without chunking;
    # chunked, the largest activation is far smaller than one logit row per response token.
    tokens = int(mask.numel())
    assert big0 >= tokens * VOCAB
    assert big1 < tokens * VOCAB // 4


def test_chunked_entropy_without_gradient_is_detached(model: LlamaForCausalLM) -> None:
    prompts, responses = _rows()
    lp, ent = grouped_logprobs(model, prompts, responses, 1.0, True, entropy_grad=False, chunk=5)
    assert lp.requires_grad and ent is not None and not ent.requires_grad
    lp, ent = grouped_logprobs(model, prompts, responses, 1.0, False, chunk=5)
    assert ent is None


def test_chunking_is_off_for_heads_it_cannot_reproduce(model: LlamaForCausalLM) -> None:
    assert logprob_chunk_size(model, 0) == 0
    assert logprob_chunk_size(model, 256) == 256
    model.config.final_logit_softcapping = 30.0  # the model's forward would cap the logits
    try:
        assert logprob_chunk_size(model, 256) == 0
    finally:
        del model.config.final_logit_softcapping
