"""Varlen packing (`rftpipe/engines/train/packing.py`): the packed forward equals the padded
one on FSDP2 and DeepSpeed ZeRO-2/3 (2 gloo ranks, real processes), honours a row's loss
mask and explicit position ids, and refuses a model it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import launch_ranks

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.fsdp2 import FSDP2Engine
from rftpipe.engines.train.packing import PackRow, pack_rows, packed_logprobs
from rftpipe.errors import UserError

LP_TOL = 1e-6
"""Max |logprob packed - padded| (fp32). The two forwards differ only in the attention
kernel's sequence length and mask; measured 0 to 9.5e-7 on the tiny model (2026-11-25)."""
GRAD_REL_TOL = 1e-5
"""Max relative L2 difference of any parameter's full gradient, packed vs padded (fp32)."""


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_causal_lm(prepare_tiny(), "float32")


def _lp(model: torch.nn.Module, *rows: PackRow) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = packed_logprobs(model, pack_rows(rows), 1.0, with_entropy=False)
    return lp


PROMPT, RESPONSE = [11, 12, 13, 14], [21, 22, 23, 24, 25]


def test_pack_layout() -> None:
    """Rows end to end, each row's last token dropped, positions restarting per row, a
    block-diagonal causal mask, and the head on exactly the loss positions."""
    b = pack_rows(
        [
            PackRow(prompt=[5, 6], response=[7, 8, 9], loss_mask=[True, False, True]),
            PackRow(prompt=[1], response=[2]),
        ]
    )
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0]]
    assert b.group_ids.tolist() == [0, 0, 0, 0, 1] and b.row_ids.tolist() == [-1, -1, 0, 0, -1]
    assert b.target_index.tolist() == [1, 3, 4] and b.target_ids.tolist() == [7, 9, 2]
    assert b.loss_mask.tolist() == [[True, False, True], [True, False, False]]
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    expected[4, 4] = True
    assert torch.equal(b.attention_mask[0, 0], expected)


def test_rows_sharing_a_prompt_share_one_copy(model: torch.nn.Module) -> None:
    """Two rows of one prompt (and one of another between them): the prompt is packed once,
    each response sees it and not the other response, and the logprobs equal one copy per
    row's."""
    other = PackRow(prompt=[1, 2, 3], response=[4, 5])
    rows = [
        PackRow(prompt=PROMPT, response=RESPONSE),
        other,
        PackRow(prompt=PROMPT, response=[31, 32, 33]),
    ]
    b = pack_rows(rows)
    assert b.input_ids.tolist() == [[*PROMPT, *RESPONSE[:-1], 31, 32, 1, 2, 3, 4]]
    assert b.row_ids.tolist() == [-1] * 4 + [0] * 4 + [2] * 2 + [-1] * 3 + [1]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 0, 1, 2, 3]]
    # Row 2's first response token (index 8) sees the prompt and itself, not row 0.
    assert b.attention_mask[0, 0, 8].nonzero().flatten().tolist() == [0, 1, 2, 3, 8]
    # Row-major targets: row 0 from the prompt's last position on, then row 1, then row 2.
    assert b.target_index.tolist() == [3, 4, 5, 6, 7, 12, 13, 3, 8, 9]
    with torch.no_grad():
        shared = packed_logprobs(model, b, 1.0, with_entropy=False)[0]
        copies = packed_logprobs(model, pack_rows(rows, share_prompts=False), 1.0, False)[0]
    assert (shared - copies).abs().max() <= LP_TOL
    # Prompts count as one only with equal positions too.
    moved = PackRow(prompt=PROMPT, response=[7], position_ids=torch.arange(5) + 1)
    assert pack_rows([rows[0], moved]).input_ids.shape[1] == 2 * len(PROMPT) + 4


def test_loss_mask_drops_a_token_from_the_loss_but_not_the_input(model: torch.nn.Module) -> None:
    """A masked middle token (an environment token) gets logprob 0 and no gradient, yet the
    tokens after it still see it: their logprobs equal the unmasked row's."""
    full = PackRow(prompt=PROMPT, response=RESPONSE)
    masked = PackRow(prompt=PROMPT, response=RESPONSE, loss_mask=[True, True, False, True, True])
    a, b = _lp(model, full, full), _lp(model, full, masked)
    assert torch.equal(a[0], b[0])  # the other row is untouched
    assert b[1, 2] == 0.0 and a[1, 2] != 0.0
    keep = [0, 1, 3, 4]
    assert (a[1, keep] - b[1, keep]).abs().max() <= LP_TOL
    # Not the same as cutting the token out of the input: later tokens did attend to it.
    cut = _lp(model, PackRow(prompt=PROMPT, response=[21, 22, 24, 25]))
    assert (cut[0, 2:4] - b[1, 3:5]).abs().max() > 1e-3
    # The masked token's logprob is a constant: no gradient flows from it into the model.
    lp, _ = packed_logprobs(model, pack_rows([masked]), 1.0, with_entropy=False)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(lp[0, 2], params, allow_unused=True, retain_graph=True)
    assert all(g is None or not g.any() for g in grads)
    assert any(g is not None and g.any() for g in torch.autograd.grad(lp[0, 3], params))


@pytest.mark.kernels
def test_explicit_position_ids_reach_the_rotary_embedding(model: torch.nn.Module) -> None:
    """Shifting a whole row's positions by a constant leaves a rotary model's logprobs as
    they were (attention sees only relative positions), up to float error; shifting the
    response alone against its prompt changes them."""
    n = len(PROMPT) + len(RESPONSE)
    base = _lp(model, PackRow(prompt=PROMPT, response=RESPONSE))
    default = _lp(model, PackRow(prompt=PROMPT, response=RESPONSE, position_ids=torch.arange(n)))
    assert torch.equal(base, default)
    shifted = _lp(
        model, PackRow(prompt=PROMPT, response=RESPONSE, position_ids=torch.arange(n) + 7)
    )
    assert (shifted - base).abs().max() <= 1e-5
    gap = torch.arange(n) + torch.tensor([0] * len(PROMPT) + [5] * len(RESPONSE))
    moved = _lp(model, PackRow(prompt=PROMPT, response=RESPONSE, position_ids=gap))
    assert (moved - base).abs().max() > 1e-3
    # (k, L) positions travel as (k, 1, N), the layout multi-axis rotary models take.
    three = pack_rows([PackRow(prompt=PROMPT, response=RESPONSE, position_ids=gap.repeat(3, 1))])
    assert three.position_ids.shape == (3, 1, n - 1)
    assert torch.equal(three.position_ids[1, 0], gap[:-1])


def test_rows_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask of row 0: 2 entries for 5"):
        pack_rows([PackRow(prompt=PROMPT, response=RESPONSE, loss_mask=[True, False])])
    with pytest.raises(ValueError, match="position_ids of row 0"):
        pack_rows([PackRow(prompt=PROMPT, response=RESPONSE, position_ids=torch.arange(3))])


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"_attn_implementation": "eager"}, "'eager', not 'sdpa'"),
        ({"sliding_window": 8}, "sliding"),
    ],
)
def test_models_packing_cannot_run_are_refused(change: dict, needle: str) -> None:
    model = load_causal_lm(prepare_tiny(), "float32")
    for k, v in change.items():
        setattr(model.config, k, v)
    with pytest.raises(UserError, match=needle) as err:
        FSDP2Engine(model, TrainConfig(backend="fsdp2"), Dist())
    assert "train.packing=true" in str(err.value) and "train.packing=false" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_equals_padded_on_sharded_backends(tmp_path: Path) -> None:
    specs = ["fsdp2", "deepspeed:2", "deepspeed:3"]
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed by tools/setup.sh")
    launch_ranks("packing_worker.py", 2, str(tmp_path), *specs, timeout=280)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results.keys() == set(specs)
    for spec, r in results.items():
        assert r["lp_max_abs"] <= LP_TOL, (spec, r)
        assert r["grad_max_rel"] <= GRAD_REL_TOL, (spec, r)
        assert r["grad_min_norm"] > 0, (spec, r)
