"""Response logprobs and entropies from the last hidden state, a chunk of positions at a
time, without ever holding a micro-batch's full-vocabulary logits.

The head's logits for N positions are an (N, V) float32 tensor: 4 bytes x 49,152 per
position for SmolLM2, 152,064 for Qwen2.5, and the log-softmax, the entropy and their
backward each keep one or two more of that size. `chunked_head_logprobs` runs the head on
`chunk` positions at a time and keeps only the hidden states, the logsumexp and the
result; the backward recomputes each chunk's logits (one more head matmul, the price of
the memory) and accumulates the hidden-state and weight gradients chunk by chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmul dtype the unchunked head would use: autocast's, if it is on."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(n, V) float32 logits of one chunk, the matmul in `dtype` as `lm_head` would run it."""
    out = h.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        out = out + bias.to(dtype)
    return out.float()


class _ChunkedHead(torch.autograd.Function):
    """(N, H) hidden, (V, H) weight, (V,) bias or None, (N,) targets -> (N,) logprobs and
    (N,) entropies of softmax(logits / temperature)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # Autocast would recast inside; the dtype is already chosen above.
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                z = _chunk_logits(hidden[s : s + chunk], weight, bias, dtype) / temperature
                lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
                lp[s : s + chunk] = (
                    z.gather(-1, targets[s : s + chunk, None])[:, 0] - lse[s : s + chunk]
                )
                if with_entropy:
                    p = torch.softmax(z, dim=-1)
                    ent[s : s + chunk] = lse[s : s + chunk] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.settings = (temperature, chunk, dtype, with_entropy)
        return lp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk, dtype, with_entropy = ctx.settings
        if not with_entropy:
            g_ent = None  # the entropies were zeros, not a function of anything
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.zeros_like(hidden) if need_h else None
        g_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        g_b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_b and bias is not None
            else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk]
                z = _chunk_logits(h, weight, bias, dtype) / temperature
                p = torch.exp(z - lse[s : s + chunk, None])
                # d(logprob)/dz = onehot - p;  d(entropy)/dz = p * (E_p[z] - z).
                g_z = torch.zeros_like(z)
                if g_lp is not None:
                    gl = g_lp[s : s + chunk, None].float()
                    g_z -= gl * p
                    g_z.scatter_add_(-1, targets[s : s + chunk, None], gl)
                if g_ent is not None:
                    mean_z = (p * z).sum(-1, keepdim=True)
                    g_z += g_ent[s : s + chunk, None].float() * p * (mean_z - z)
                g_z /= temperature
                if g_h is not None:
                    g_h[s : s + chunk] = (g_z.to(dtype) @ weight.to(dtype)).to(g_h.dtype)
                if g_w is not None:
                    g_w += (g_z.to(dtype).T @ h.to(dtype)).float()
                if g_b is not None:
                    g_b += g_z.sum(0)
        return (
            g_h,
            g_w.to(weight.dtype) if g_w is not None else None,
            g_b.to(bias.dtype) if g_b is not None else None,
            None,
            None,
            None,
            None,
        )


def chunked_head_logprobs(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(..., ) logprobs (and entropies) of `tokens` under softmax(head(hidden) / temperature),
    for hidden (..., H) and tokens (...), `chunk` positions of logits at a time."""
    shape = tokens.shape
    lp, ent = _ChunkedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        head.bias,
        tokens.reshape(-1),
        temperature,
        max(1, chunk),
        with_entropy,
    )
    if not with_entropy:
        return lp.reshape(shape), None
    if not entropy_grad:
        # Only a metric: its gradient would be zero anyway, and none flows from it.
        ent = ent.detach()
    return lp.reshape(shape), ent.reshape(shape)


def chunkable(head: torch.nn.Module) -> bool:
    """Whether `head` is a plain linear layer, the only head the chunked path reproduces."""
    return type(head) is torch.nn.Linear


@contextlib.contextmanager
def head_returns_logprobs(
    head: torch.nn.Linear,
    index: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> Iterator[None]:
    """While open, `head`'s forward (through its own `__call__`, so the hooks sharding
    wrappers put on it still gather its weight) turns hidden states (B, L', H) into a
    (B, T, 2) stack of logprobs and entropies (zeros without `with_entropy`) of `tokens`
    (B, T) at positions `index` (B, T) of L'.

    The root forward of a sharded backend (FSDP2, DeepSpeed) then never makes the full
    logits, and its hooks run exactly as for the unchunked head."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        lp, ent = chunked_head_logprobs(
            head, picked, tokens, temperature, chunk, with_entropy, entropy_grad
        )
        return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)

    # An instance attribute shadows the class's forward; `__call__` and its hooks stay.
    head.forward = forward  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del head.forward
