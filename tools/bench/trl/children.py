"""The TRL comparison's child measurements, each in a fresh process of its own
(`python -m tools.bench trl --child=trl|floor`): TRL's GRPOTrainer on rftpipe's prompts and
reward, and the floor (bare generate plus rftpipe's forward/backward and optimizer step)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.bench.trl.options import CONFIG, overrides

# ----------------------------------------------------------------------------- the child


def child_main(a: argparse.Namespace) -> int:
    """One child measurement (`--child`), its figures written to `--child-out`."""
    import torch

    torch.set_num_threads(a.threads)
    if a.child == "floor":
        from rftpipe.run.runtime import retain_host_memory

        # The floor runs rftpipe's compute under the allocator policy rftpipe's worker uses
        # (launch.retain_host_memory); TRL runs as its users run it.
        retain_host_memory()
    if a.child == "floor":
        res = bench_floor(a)
    elif a.child_engine == "hf":
        res = bench_trl(a)
    else:
        # TRL's vLLM colocate mode is written for GPUs: record how it fails on this machine.
        try:
            res = bench_trl(a)
        except Exception as exc:  # noqa: BLE001
            import traceback

            res = {
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                "traceback": traceback.format_exc()[-4000:],
            }
    Path(a.child_out).write_text(json.dumps(res))
    return 0


def step_prompts(a: argparse.Namespace):
    """The prompts rftpipe's sampler hands out in steps 1..N, in order, and the run config."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig
    from rftpipe.data.prompts import load_prompts
    from rftpipe.data.sampler import SamplerState, global_window
    from rftpipe.engines.models import load_tokenizer, resolve_model_path

    cfg = load_config(RunConfig, CONFIG, overrides(a, a.steps, a.child_engine))
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_dir)
    ps = load_prompts(cfg.data, tok)
    order = []
    for s in range(a.steps):
        state = SamplerState(consumed=s * a.prompts)
        window = global_window(len(ps), cfg.seed, cfg.data.shuffle, state, a.prompts)
        order += [ps.prompts[i] for i in window]
    return cfg, model_dir, tok, ps, order


def trl_reward(cfg: Any, components: dict[str, Any], eos_ids: set[int]):  # noqa: ANN201
    """TRL's reward function scoring with rftpipe's own score stage: the same components,
    weights, data-source routing and `reward.on_error`, so both sides train on one reward.

    TRL calls it with the step's completions and the dataset's columns (`answer`,
    `metadata` as JSON, `prompt_id`, `data_source`), plus its `completion_ids` and
    `trainer_state`."""
    import pyarrow as pa

    from rftpipe.stages import score

    def reward(
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        answer: list[str | None],
        metadata: list[str],
        prompt_id: list[int],
        data_source: list[str],
        trainer_state: Any = None,
        **_: Any,
    ) -> list[float]:
        # TRL scores before the optimizer step: the step being rolled out is the next one.
        step = trainer_state.global_step + 1 if trainer_state is not None else 0
        seen: dict[int, int] = {}
        rows = []
        for i, (p, c, ids) in enumerate(zip(prompts, completions, completion_ids, strict=True)):
            # A group's completions come in consecutive rows; number them within the group.
            seen[prompt_id[i]] = seen.get(prompt_id[i], -1) + 1
            rows.append(
                {
                    "step": step,
                    "prompt_id": prompt_id[i],
                    "sample_idx": seen[prompt_id[i]],
                    # Conversational rows: the user message, as rftpipe's rows hold it.
                    "prompt": p[-1]["content"] if isinstance(p, list) else p,
                    "response": c[0]["content"] if isinstance(c, list) else c,
                    "answer": answer[i],
                    "data_source": data_source[i],
                    "metadata": metadata[i],
                    "response_token_ids": list(ids),
                    # TRL keeps the EOS that ended a completion, as rftpipe's engines do.
                    "finish_reason": "stop" if ids and ids[-1] in eos_ids else "length",
                }
            )
        return score.run(cfg, components, pa.Table.from_pylist(rows))["reward"].to_pylist()

    return reward


# ---------------------------------------------------------------------------------- TRL


def bench_trl(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer; `--child-engine vllm`: generating with vLLM in colocate mode (in
    this process, the same vLLM settings as rftpipe's engine where TRL exposes them)."""
    use_vllm = a.child_engine == "vllm"
    if use_vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from rftpipe.rewards import resolve_all

    cfg, model_dir, tok, ps, order = step_prompts(a)
    components = resolve_all(cfg.reward, ps.scorer, cfg.rollout.max_new_tokens)
    reward = trl_reward(cfg.reward, components, {tok.eos_token_id, *cfg.rollout.eos_token_ids})
    data = trl_dataset(cfg.data.system_prompt, order)
    times: list[float] = []
    targs = trl_config(a, cfg, use_vllm)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_float32())
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=targs,
        train_dataset=data,
        processing_class=tok,
        callbacks=[step_clock(times)],
    )
    gen_s, sync_s = time_rollouts(trainer, use_vllm)
    trainer.train()
    return trl_figures(times, gen_s, sync_s, use_vllm)


def trl_dataset(system: str | None, order: list[Any]) -> Any:
    """The prompts in rftpipe's order as TRL's conversational dataset, with the columns
    the reward reads (`answer`, `metadata` as JSON, `prompt_id`, `data_source`)."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": p.text},
                ],
                "answer": p.answer,
                "metadata": json.dumps(p.metadata, default=str),
                "prompt_id": p.prompt_id,
                "data_source": p.data_source,
            }
            for p in order
        ]
    )


def step_clock(times: list[float]) -> Any:
    """A TrainerCallback appending the wall-clock time of each step's end to `times`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            times.append(time.time())

    return Clock()


def trl_config(a: argparse.Namespace, cfg: Any, use_vllm: bool) -> Any:
    """GRPOConfig as rftpipe's side is configured: group size, fixed response length,
    beta 0, one PPO epoch, fp32 on the CPU, AdamW at a constant learning rate, no saving."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=a.prompts * a.n,
        gradient_accumulation_steps=1,
        num_generations=a.n,
        max_completion_length=a.tokens,
        # vLLM's SamplingParams calls it min_tokens, transformers' generate min_new_tokens.
        generation_kwargs={"min_tokens" if use_vllm else "min_new_tokens": a.tokens},
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=a.steps,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=a.seed,
        disable_tqdm=True,
        **(
            {
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_max_model_length": cfg.data.max_prompt_tokens + a.tokens,
            }
            if use_vllm
            else {}
        ),
    )


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """`fn`, each call's seconds appended to `into`."""

    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def time_rollouts(trainer: Any, use_vllm: bool) -> tuple[list[float], list[float]]:
    """Clock the trainer's rollout: TRL's generate-and-score call of a step (generation,
    rewards, and the old logprobs it computes); its vLLM weight sync, which runs inside it,
    apart. The two lists fill as the trainer trains."""
    gen_s: list[float] = []
    sync_s: list[float] = []
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, gen_s)
    if use_vllm:
        vg = trainer.vllm_generation
        vg.sync_weights = _timed(vg.sync_weights, sync_s)
    return gen_s, sync_s


def trl_figures(
    times: list[float], gen_s: list[float], sync_s: list[float], use_vllm: bool
) -> dict[str, Any]:
    """Step seconds (between step ends) and, over steps 2..N, rollout, train and sync."""
    gaps = [b - a_ for a_, b in zip(times, times[1:], strict=False)]
    # One generate-and-score call and at most one sync per step (num_iterations=1).
    steps = len(times)
    syncs = _per_step(sync_s, steps) if use_vllm else [0.0] * steps
    rollout = [g - y for g, y in zip(gen_s[:steps], syncs, strict=True)]
    return {
        "step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": gaps,
        "rollout_steps": rollout[1:],
        "train_steps": [g - r for g, r in zip(gaps, gen_s[1:steps], strict=True)],
        "sync_steps": syncs[1:] if use_vllm else [],
    }


def _per_step(sync_s: list[float], steps: int) -> list[float]:
    """TRL syncs before every generation but the first (global_step 0 is what vLLM loaded)."""
    if len(sync_s) == steps:
        return sync_s
    return ([0.0] * (steps - len(sync_s)) + sync_s)[:steps]


def torch_float32():
    import torch

    return torch.float32


# -------------------------------------------------------------------------------- floor


def bench_floor(a: argparse.Namespace) -> dict[str, Any]:
    """Bare generate + rftpipe's forward/backward + optimizer step on the same batches;
    with `--child-engine vllm`, generating with rftpipe's vLLM engine and timing its
    `update_weights` from the trained module after each step."""
    cfg, model_dir, tok, _, order = step_prompts(a)
    model, engine, gen = floor_engines(a, cfg, model_dir, tok)
    naive = a.floor_naive and a.child_engine == "hf"
    t: dict[str, list[Any]] = {
        k: [] for k in ("generate", "train", "fwd_bwd", "naive", "sync", "engine_sync")
    }
    for s in range(a.floor_steps):
        floor_step(a, cfg, model, engine, gen, order, s, t, naive)
    model.zero_grad(set_to_none=True)
    med = statistics.median
    return {
        "generate_s": med(t["generate"][1:]),
        "train_s": med(t["train"][1:]),
        "fwd_bwd_s": med(t["fwd_bwd"][1:]),
        "naive_fwd_bwd_s": med(t["naive"][1:]) if naive else None,
        "sync_s": med(t["sync"][1:]),
        "generate_steps": t["generate"][1:],
        "train_steps": t["train"][1:],
        "sync_steps": t["sync"][1:],
        # The engine's own clock (vLLM's last_sync_s): reload_weights + prefix-cache reset.
        "engine_sync_steps": t["engine_sync"][1:],
    }


def floor_engines(a: argparse.Namespace, cfg: Any, model_dir: Any, tok: Any) -> tuple[Any, ...]:
    """(model, single-device train engine on it, rollout engine: the HF loop on the same
    module, or rftpipe's vLLM engine), as rftpipe's worker builds them."""
    from rftpipe.dist import Dist
    from rftpipe.engines.models import load_causal_lm
    from rftpipe.engines.rollout.hf import HFGenerateEngine
    from rftpipe.engines.train.single import SingleDeviceEngine
    from rftpipe.run.runtime import retain_train_blocks

    model = load_causal_lm(model_dir, "float32")
    engine = SingleDeviceEngine(model, cfg.train, Dist())
    # The worker's bound for a CPU train step's blocks (launch.retain_host_memory).
    retain_train_blocks(cfg, engine, Dist())
    if a.child_engine == "vllm":
        from rftpipe.engines.rollout import engine_spec
        from rftpipe.engines.rollout.vllm import VLLMEngine

        gen = VLLMEngine(cfg.rollout, engine_spec(cfg, model_dir, tok), Dist())
    else:
        gen = HFGenerateEngine(model, cfg.rollout, tok.eos_token_id, tok.pad_token_id)
    return model, engine, gen


def floor_step(
    a: argparse.Namespace,
    cfg: Any,
    model: Any,
    engine: Any,
    gen: Any,
    order: list[Any],
    s: int,
    t: dict[str, list[Any]],
    naive: bool,
) -> None:
    """Step s+1 of the floor: generate its groups, train on them (PPO-clip, token-mean,
    random advantages), hand the weights to the rollout engine; seconds of each into `t`."""
    import torch

    from rftpipe.seeding import derive_seed
    from rftpipe.stages.batching import pad_ragged

    prompts = order[s * a.prompts : (s + 1) * a.prompts]
    t0 = time.perf_counter()
    seeds = [derive_seed(a.seed, s + 1, "rollout", p.prompt_id) for p in prompts]
    groups = gen.generate_groups([p.token_ids for p in prompts], a.n, seeds)
    t["generate"].append(time.perf_counter() - t0)
    p_ids = [list(p.token_ids) for p in prompts for _ in range(a.n)]
    r_ids = [tok for g in groups for tok in g.tokens]
    old, mask = pad_ragged([lp for g in groups for lp in g.logprobs], torch.float32)
    adv = torch.randn(len(r_ids), 1).expand_as(old).contiguous()
    fwd_bwd, train = _floor_train(cfg, engine, p_ids, r_ids, old, adv, mask)
    t["train"].append(train)
    t["fwd_bwd"].append(fwd_bwd)
    t0 = time.perf_counter()
    gen.update_weights(model, s + 1)  # the HF loop shares the module: nothing to do
    t["sync"].append(time.perf_counter() - t0)
    t["engine_sync"].append(getattr(gen, "last_sync_s", None))
    if naive:
        t["naive"].append(_naive_train(model, p_ids, r_ids, old, adv, mask))


def _floor_train(cfg, engine, p_ids, r_ids, old, adv, mask) -> tuple[float, float]:  # noqa: ANN001
    """rftpipe's forward/backward and optimizer step on one batch: (seconds of the
    forward/backward, seconds with the optimizer step)."""
    from rftpipe.algos.losses import AGGREGATIONS, ppo_clip_loss
    from rftpipe.algos.variants import PPOClipSettings

    t0 = time.perf_counter()
    with engine.train_mode():
        lp, _ = engine.forward(p_ids, r_ids, cfg.rollout.temperature, with_entropy=True)
        out = ppo_clip_loss(lp, old, adv, mask, PPOClipSettings(dual_clip=None))
        loss = AGGREGATIONS["token-mean"](
            out.loss, mask, num_tokens=float(mask.sum()), num_seqs=float(len(r_ids))
        )
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.optimizer_step()
    return t1 - t0, time.perf_counter() - t0


def _naive_train(model, p_ids, r_ids, old, adv, mask) -> float:  # noqa: ANN001
    """Forward/backward over every full (prompt + response) sequence, no prefix sharing;
    gradients are discarded (no optimizer step), so the model is unchanged."""
    import torch

    seqs = [p + r for p, r in zip(p_ids, r_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    t0 = time.perf_counter()
    model.train()
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    rows = []
    for i, (p, r) in enumerate(zip(p_ids, r_ids, strict=True)):
        rows.append(
            torch.nn.functional.pad(
                logp[i, len(p) - 1 : len(p) - 1 + len(r)], (0, old.shape[1] - len(r))
            )
        )
    lp = torch.stack(rows)
    ratio = torch.exp(lp - old)
    loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return time.perf_counter() - t0
