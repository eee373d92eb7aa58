"""What an MoE policy changes outside the routers: which replay a config resolves to (and
what it refuses), LoRA's default targets, the FLOPs a token costs, Mixtral's jitter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY
from transformers import AutoModelForCausalLM, MixtralConfig

from rftpipe.config.loader import load_config
from rftpipe.config.schema import LoraConfig, RunConfig
from rftpipe.engines import lora, moe
from rftpipe.engines.models import TINY_MOE, TINY_QWEN3_MOE, resolve_model_path
from rftpipe.errors import UserError
from rftpipe.observe.perf import model_shape


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, TINY, list(overrides))


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return resolve_model_path(TINY_MOE)


@pytest.fixture(scope="module")
def dense_dir() -> Path:
    return resolve_model_path("builtin:tiny")


def test_auto_is_r3_where_the_rollout_records_else_r2_with_actor_logprobs(moe_dir: Path) -> None:
    assert moe.replay_mode(_cfg(), moe_dir) == "r3"
    # A serving engine's rollout records no routes here; the old logprobs are the actor's.
    assert moe.replay_mode(_cfg("rollout.engine=vllm"), moe_dir) == "r2"
    assert moe.replay_mode(_cfg("train.router_replay=none"), moe_dir) == "none"
    # Episodes and agent calls record routes on the HF loop too.
    episodes = ("rollout.env.path=envs_toy:EvenChars", "reward.functions=[]")
    assert moe.replay_mode(_cfg(*episodes), moe_dir) == "r3"
    assert (
        moe.replay_mode(_cfg("train.router_replay=r2", "train.old_logprobs=actor"), moe_dir) == "r2"
    )


def test_a_dense_policy_routes_nothing_and_refuses_replay(dense_dir: Path) -> None:
    assert moe.replay_mode(_cfg(), dense_dir) == "none"
    assert moe.dir_route_shape(dense_dir) is None
    with pytest.raises(
        UserError, match=r"^train.router_replay=r3: model.path 'builtin:tiny' is a dense"
    ):
        moe.replay_mode(_cfg("train.router_replay=r3"), dense_dir)


def test_r3_that_the_rollout_cannot_record_is_refused_at_load() -> None:
    with pytest.raises(
        ValueError, match="rollout.engine=vllm: route capture .* needs the engine's"
    ):
        _cfg("train.router_replay=r3", "rollout.engine=vllm")
    with pytest.raises(ValueError, match="rollout.engine=sglang: route capture .* SGLang's"):
        _cfg("train.router_replay=r3", "rollout.engine=sglang")


def test_r2_needs_the_actor_forward_and_expert_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="router_replay=r2 replays the selection of the actor"):
        _cfg("train.router_replay=r2")
    with pytest.raises(ValueError, match="expert_parallel=2 cannot run"):
        _cfg("train.expert_parallel=2")
    sp = ("train.backend=fsdp2", "train.sp_size=2", "train.packing=false")
    with pytest.raises(ValueError, match="moe_aux_loss_coef with train.sp_size>1: each rank"):
        _cfg(*sp, "train.moe_aux_loss_coef=0.01")
    assert _cfg(*sp, "train.router_replay=r3").train.router_replay == "r3"


def test_route_shape_from_the_directory_alone(moe_dir: Path) -> None:
    assert moe.is_moe_dir(moe_dir)
    assert moe.dir_route_shape(moe_dir) == moe.RouteShape(layers=2, experts=4, top_k=2)
    qwen = resolve_model_path(TINY_QWEN3_MOE)
    assert moe.dir_route_shape(qwen) == moe.RouteShape(layers=2, experts=4, top_k=2)


def test_lora_defaults_on_an_moe_model_are_attention_only(moe_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    got = lora.effective(model, LoraConfig())
    assert got.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    # Named targets are checked as given: the fused experts have no down_proj module.
    with pytest.raises(UserError, match="down_proj match no module"):
        lora.check_targets(model, LoraConfig(target_modules=("q_proj", "down_proj")))
    # A Qwen3-MoE's dense layer keeps its MLP adapters.
    qwen = AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY_QWEN3_MOE))
    assert "down_proj" in lora.effective(qwen, LoraConfig()).target_modules
    peft_model = lora.apply_lora(model, LoraConfig(), run_seed=0, role="actor")
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("self_attn" in n for n in trained)


def test_a_token_costs_k_of_e_experts_flops(moe_dir: Path, dense_dir: Path) -> None:
    """Upcycled E=4, k=2: a token meets two copies of the dense MLP, so the non-embedding
    parameters it meets are the dense model's plus one more MLP per layer, and a router."""
    dense = model_shape(AutoModelForCausalLM.from_pretrained(dense_dir))
    sparse_model = AutoModelForCausalLM.from_pretrained(moe_dir)
    sparse = model_shape(sparse_model)
    cfg = sparse_model.config
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    router = cfg.num_local_experts * cfg.hidden_size
    layers = cfg.num_hidden_layers
    assert sparse.non_embedding_params == dense.non_embedding_params + layers * (mlp + router)


def test_router_jitter_is_off_once_the_routers_are_hooked() -> None:
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.5,
    )
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, 32, (2, 6))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert moe.Routers.of(model) is not None
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
