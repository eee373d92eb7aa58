"""Stage 4, train: PPO epochs x mini-batches of the clipped surrogate, KL and entropy terms.

PPO's old policy is the committed `old_logprobs` column (the actor's own forward, written by
the advantage stage) when there is one, else the rollout engine's `logprobs`; a rollout
correction (`train.rollout_correction`) weights each token's policy loss by a function of
their ratio.

Mini-batches come from `stages.batching` (a world-size-independent global order), and losses
are normalised by global token and sequence counts, so the update is the same on any number
of ranks and any micro-batching.

With `train.ptx.coef` each optimizer step also accumulates PPO-ptx's supervised term: coef x
the token-mean NLL of a batch of PTX examples chosen by the update's number alone
(`data.ptx_batch`), normalised by the batch's global completion-token count.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from rftpipe.algos.correction import correction_weights
from rftpipe.algos.losses import AGGREGATIONS, entropy_top_mask, kl_estimate, policy_loss
from rftpipe.algos.variants import ROLLOUT_CORRECTIONS, K3Settings
from rftpipe.atomic import CorruptionError
from rftpipe.config.schema import (
    KLConfig,
    TrainConfig,
    response_budget,
    skip_blockers,
    skips_alike_groups,
)
from rftpipe.data.ptx import PTXExample, ptx_batch
from rftpipe.data.sampler import rank_slice
from rftpipe.dist import Dist
from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.forward import split_micro_batches
from rftpipe.engines.train.ulysses import data_view
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.observe import machine, perf
from rftpipe.stages import StageName, critic_train
from rftpipe.stages.base import ReplayCheck, Rows, Runtime, StageOutput, StepPlan
from rftpipe.stages.batching import (
    TrainInputs,
    alike_rows,
    mini_batches,
    model_token_mask,
    model_tokens,
    pad_ragged,
    seeded_rng,
)
from rftpipe.stages.images import RowImages
from rftpipe.stages.routes import REPLAYED, RouteColumn, committed_column, routing_metrics
from rftpipe.storage.baseline_rows import without_baseline

log = logging.getLogger(__name__)

# The drift from the old policy reported as train/kl when there is no reference.
_DRIFT_KL = K3Settings()

# Per-token sums gathered over the step, all-reduced once at the end.
#: Stand-in row for a rank with no rows left in a micro-batch slot (its loss weight is 0).
_PADDING_ROW = {
    "prompt_token_ids": [0],
    "response_token_ids": [0],
    "logprobs": [0.0],
    "old_logprobs": [0.0],
    "advantages": [0.0],
    "ref_logprobs": [0.0],
    "response_length": 1,
}
_SUMS = (
    "tokens",
    "clipped",
    "dual_clipped",
    "kl",
    "entropy",
    "ratio",
    "pg_loss",
    "updates",
    "grad_norm",
    "skipped",
    "correction_weight",
    "correction_masked",
    "ptx_nll",
    "ptx_tokens",
    "moe_aux_loss",
    "skipped_rows",
    "skipped_tokens",
)


def run(
    cfg: TrainConfig, kl: KLConfig, engine: TrainEngine, dist: Dist, inp: TrainInputs
) -> dict[str, float]:
    t0 = perf.clock(dist.device)
    if engine.routers is not None:
        engine.routers.take_stats()  # from here: this stage's forwards only
    with engine.train_mode(), seeded_rng(inp.run_seed, inp.step, "train", dist.device):
        metrics = _run(cfg, kl, engine, dist, inp)
    metrics |= routing_metrics(engine.routers, dist)
    seconds = perf.clock(dist.device) - t0
    # Every rank reaches this one extra collective right after the stage's last one.
    work = dist.all_reduce_sum(perf.train_work(engine.model, inp.table, cfg.ppo_epochs))
    return {**metrics, **perf.throughput(work, seconds), **_offload_metrics(cfg, engine)}


def _offload_metrics(cfg: TrainConfig, engine: TrainEngine) -> dict[str, float]:
    """This rank's optimizer-state bytes the stage moved to host memory at its end, and the
    seconds of that offload and of its start's reload (`train.offload_between_stages`;
    timings and rank-local sizes, hence under perf/, which a replay does not compare)."""
    if not cfg.offload_between_stages:
        return {}
    rec = engine.offload_record
    return {
        "perf/offload_gib": rec.bytes / 2**30,
        "perf/offload_s": rec.offload_s,
        "perf/reload_s": rec.reload_s,
    }


def _run(
    cfg: TrainConfig, kl: KLConfig, engine: TrainEngine, dist: Dist, inp: TrainInputs
) -> dict[str, float]:
    correction = ROLLOUT_CORRECTIONS.of(cfg.rollout_correction)
    if correction.traits.reads_ratio and "old_logprobs" not in inp.table.column_names:
        raise ValueError(
            f"train.rollout_correction={correction.name} needs the actor's "
            "old_logprobs column (train.old_logprobs=actor)"
        )
    rows = inp.table.to_pylist()
    sums = dict.fromkeys(_SUMS, 0.0)
    lr = engine.current_lr()  # the step's first update; the scheduler moves it per update
    skipped = sorted(inp.skip or ())
    sums["skipped_rows"] = float(len(skipped))
    # Per epoch, as train/tokens counts the trained ones.
    sums["skipped_tokens"] = float(cfg.ppo_epochs * sum(model_tokens(rows[i]) for i in skipped))
    for mb in mini_batches(cfg, dist, inp, rows, inp.skip):
        for chunk in mb.micro:
            _micro_step(cfg, kl, engine, dist, inp, chunk, mb.counts, sums)
        if cfg.ptx.coef:
            update = (inp.step * cfg.ppo_epochs + mb.epoch) * cfg.mini_batches + mb.index
            _ptx_step(cfg, engine, dist, inp.ptx, (inp.run_seed, update), sums)
        sums["grad_norm"] += engine.optimizer_step()
        sums["updates"] += 1
        engine.lr_scheduler_step()
        fault("train_mid_step")
    metrics = _finish_metrics(sums, dist, correction.traits.reads_ratio)
    if inp.skip is None:  # skipping off: the metrics as they always were
        del metrics["train/skipped_rows"], metrics["train/skipped_tokens"]
    return {**metrics, **_ptx_metrics(sums, dist, cfg), "train/lr": lr}


def ptx_nll(
    engine: TrainEngine, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL of the completion tokens, with gradients; their count): one forward of
    the actor at temperature 1, the model's own distribution, whatever the rollout's."""
    lp, _ = engine.forward(prompts, completions, 1.0, with_entropy=False)
    lengths = torch.tensor([len(c) for c in completions], device=lp.device)
    mask = torch.arange(lp.shape[1], device=lp.device)[None, :] < lengths[:, None]
    # where, not a product: a padding position's logprob must not reach the sum at all.
    return torch.where(mask, -lp, 0.0).sum(), mask.sum()


def _ptx_step(
    cfg: TrainConfig,
    engine: TrainEngine,
    dist: Dist,
    examples: Sequence[PTXExample],
    key: tuple[int, int],
    sums: dict[str, float],
) -> None:
    """PPO-ptx's term for optimizer step `key` = (run seed, update number): coef x the NLL
    of this rank's slice of the update's batch over the whole batch's completion tokens,
    so the gradients the backend sums over ranks are the batch's token mean on any world."""
    batch = [examples[i] for i in ptx_batch(len(examples), *key, cfg.ptx.batch_size)]
    total = sum(len(e.completion_ids) for e in batch)  # global: every rank knows the batch
    mine = [batch[i] for i in rank_slice(range(len(batch)), dist.rank, dist.world)]
    prompts = [e.prompt_ids for e in mine]
    completions = [e.completion_ids for e in mine]
    chunks = split_micro_batches(cfg, prompts, completions)
    # As the policy micro-batches: the same number of forwards on every rank (padding: weight 0).
    for c in range(int(dist.all_reduce_max(torch.tensor([len(chunks)]))[0])):
        rows = chunks[c] if c < len(chunks) else range(0)
        weight = 1.0 if rows else 0.0
        nll, tokens = ptx_nll(
            engine,
            [prompts[i] for i in rows] or [[0]],
            [completions[i] for i in rows] or [[0]],
        )
        loss = cfg.ptx.coef * nll / total
        if dist.any(not bool(torch.isfinite(loss))):
            sums["skipped"] += 1
            continue
        engine.backward(loss * weight)
        if weight:
            sums["ptx_nll"] += float(nll.detach())
            sums["ptx_tokens"] += float(tokens)


def _ptx_metrics(sums: dict[str, float], dist: Dist, cfg: TrainConfig) -> dict[str, float]:
    """The token-mean PTX NLL over every update of the step (unscaled by coef), and its
    tokens; nothing with ptx off, so the other runs' metrics stay as they were."""
    if not cfg.ptx.coef:
        return {}
    g = dist.all_reduce_sum(
        torch.tensor([sums["ptx_nll"], sums["ptx_tokens"]], dtype=torch.float64)
    )
    nll, tokens = g.tolist()
    return {"train/ptx_loss": nll / max(tokens, 1.0), "train/ptx_tokens": tokens}


def _micro_step(
    cfg: TrainConfig,
    kl: KLConfig,
    engine: TrainEngine,
    dist: Dist,
    inp: TrainInputs,
    chunk: list[dict],
    count: torch.Tensor,
    sums: dict[str, float],
) -> None:
    weight = 1.0 if chunk else 0.0
    chunk = chunk or [_PADDING_ROW]
    rollout, mask = pad_ragged([r["logprobs"] for r in chunk], torch.float32)
    mask = model_token_mask([r.get("loss_mask") for r in chunk], mask)
    old = rollout
    if "old_logprobs" in chunk[0]:  # the actor's own, when the advantage stage recomputed them
        old, _ = pad_ragged([r["old_logprobs"] for r in chunk], torch.float32)
    adv, _ = pad_ragged([r["advantages"] for r in chunk], torch.float32)
    lp, ent = engine.forward(
        [r["prompt_token_ids"] for r in chunk],
        [r["response_token_ids"] for r in chunk],
        inp.temperature,
        with_entropy=True,
        vision=inp.vision(chunk),
        routes=None if inp.routes is None else inp.routes.of(chunk),
    )
    aux = engine.moe_aux_loss()
    assert ent is not None  # asked for with_entropy=True
    old, adv, mask = old.to(lp.device), adv.to(lp.device), mask.to(lp.device)
    # The high-entropy token mask narrows only the policy loss; KL and entropy keep all tokens.
    pg_mask = entropy_top_mask(ent, mask, cfg.entropy_mask_top)
    out = policy_loss(lp, old, adv, pg_mask, cfg.policy_loss)
    corr = correction_weights(old, rollout.to(lp.device), mask, cfg.rollout_correction)
    # `none` weighs every token exactly 1.0, which leaves the loss bit for bit as it is.
    pg_tok = out.loss * corr.weight
    agg = AGGREGATIONS[cfg.loss_agg]
    norm = {
        # With the entropy mask, token-mean divides by the expected number of kept tokens
        # (top x all valid ones), as the paper's mean over kept tokens; each micro-batch
        # keeps ceil(top x its tokens), so this matches it up to rounding while the
        # micro-batch shares still add up. x1.0 leaves the unmasked case bit for bit.
        "num_tokens": float(count[0]) * cfg.entropy_mask_top,
        "num_seqs": float(count[1]),
        "norm_len": float(inp.response_budget) if inp.response_budget else None,
    }
    loss = agg(pg_tok, pg_mask, **norm)
    if kl.mode != "none":
        ref, _ = pad_ragged([r["ref_logprobs"] for r in chunk], torch.float32)
        ref = ref.to(lp.device)
        kl_tok = kl_estimate(lp, ref, kl.estimator) * mask
    else:
        # Without a reference, report the drift from the old (behaviour) policy instead.
        kl_tok = kl_estimate(lp, old, _DRIFT_KL) * mask
    full = {**norm, "num_tokens": float(count[0])}  # KL and entropy keep every token
    if kl.mode == "loss":
        loss = loss + inp.kl_coef * agg(kl_tok, mask, **full)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg(ent, mask, **full)
    loss, aux_part = _with_aux_loss(cfg, loss, aux, mask, count)
    # An invalid (non-finite) micro-batch on any rank is skipped on all of them together,
    # so no rank waits in a backward collective that the others never enter.
    if dist.any(not bool(torch.isfinite(loss))):
        sums["skipped"] += 1
        return
    engine.backward(loss * weight)
    if not weight:
        return
    with torch.no_grad():
        sums["tokens"] += float(mask.sum())
        sums["clipped"] += float((out.clipped & mask).sum())
        sums["dual_clipped"] += float((out.dual_clipped & mask).sum())
        sums["kl"] += float(kl_tok.sum())
        sums["entropy"] += float((ent * mask).sum())
        sums["ratio"] += float((out.ratio * mask).sum())
        sums["pg_loss"] += float(agg(pg_tok, pg_mask, **norm))
        sums["correction_weight"] += float((corr.weight * mask).sum())
        sums["correction_masked"] += float(corr.masked.sum())
        sums["moe_aux_loss"] += aux_part


def _with_aux_loss(
    cfg: TrainConfig,
    loss: torch.Tensor,
    aux: torch.Tensor | None,
    mask: torch.Tensor,
    count: torch.Tensor,
) -> tuple[torch.Tensor, float]:
    """The loss with an MoE policy's load-balancing term (`train.moe_aux_loss_coef`), and
    that term's share for the metric. Each micro-batch weighs it by its share of the
    mini-batch's tokens, so an update's sum is the token-weighted mean over its
    micro-batches."""
    if aux is None:
        return loss, 0.0
    share = float(mask.sum()) / max(float(count[0]), 1.0)
    if cfg.moe_aux_loss_coef:
        loss = loss + cfg.moe_aux_loss_coef * aux * share
    return loss, float(aux) * share


def _finish_metrics(sums: dict[str, float], dist: Dist, correction: bool) -> dict[str, float]:
    # updates, grad_norm and skipped are identical on every rank (collective decisions).
    # The PTX sums are reduced on their own (`_ptx_metrics`), only when there is a PTX term.
    skip = ("updates", "grad_norm", "skipped", "ptx_nll", "ptx_tokens")
    local = {k: v for k, v in sums.items() if k not in skip}
    total = dist.all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64))
    g = dict(zip(local, total.tolist(), strict=True))
    tok = max(g["tokens"], 1.0)
    updates = max(sums["updates"], 1.0)
    out = {
        "train/pg_loss": g["pg_loss"] / updates,
        "train/kl": g["kl"] / tok,
        "train/entropy": g["entropy"] / tok,
        "train/clip_frac": g["clipped"] / tok,
        "train/dual_clip_frac": g["dual_clipped"] / tok,
        "train/ratio_mean": g["ratio"] / tok,
        # Each rank sees the same clipped global norm, so no reduction is needed.
        "train/grad_norm": sums["grad_norm"] / updates,
        "train/updates": sums["updates"],
        "train/tokens": g["tokens"],
        "train/skipped_micro_batches": sums["skipped"],
        # Rows of all-alike groups left out of the forward and backward (each once).
        "train/skipped_rows": g["skipped_rows"],
        "train/skipped_tokens": g["skipped_tokens"],
    }
    if correction:
        # Over every token of every epoch, like the other per-token means.
        out["train/correction_weight_mean"] = g["correction_weight"] / tok
        out["train/correction_masked_frac"] = g["correction_masked"] / tok
    if g["moe_aux_loss"] > 0:  # an MoE policy (the loss is positive whenever it runs)
        out["train/moe_aux_loss"] = g["moe_aux_loss"] / updates
    return out


@dataclass(frozen=True, slots=True)
class TrainStage:
    """4. PPO epochs x mini-batches on the committed rows; replayed after a restart until
    the weights catch up with the newest committed step."""

    name: StageName = "train"
    publish: bool = False
    replay_reads_rows: bool = True
    engine_awake: bool = False

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        metrics = self._train(rt, plan, rows)
        # What a replay after a restart compares its own platform with.
        return StageOutput(
            rows=None, extra={"metrics": metrics, "platform": machine.identity(rt.dist.world)}
        )

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        rt.stop.check(rt.dist, f"step {plan.step} train replay")
        fault("train_mid_replay")
        new = _update_metrics(self._train(rt, plan, rows))
        old = _update_metrics(manifest["metrics"])
        recorded = manifest.get("platform")
        check = ReplayCheck(
            step=plan.step,
            identical=new == old,
            max_rel_diff=max_rel_diff(new, old),
            platform_changed=(
                None
                if recorded is None
                else machine.changed(recorded, machine.identity(rt.dist.world))
            ),
        )
        rt.replays.append(check)
        events().write(
            "replay",
            step=plan.step,
            identical=check.identical,
            max_rel_diff=check.max_rel_diff,
            platform_changed=check.platform_changed,
        )
        if not check.identical:
            # Same inputs and seeds give the same update only on the same platform (CPU
            # kernels, GPU, library versions, thread count): the user must know it changed.
            log.warning(
                "replayed train step %d differs from its committed metrics (largest relative "
                "difference %.3g); the platform changed: %s",
                plan.step,
                check.max_rel_diff,
                "unknown (not recorded)"
                if check.platform_changed is None
                else (check.platform_changed or "not in what is recorded"),
            )

    def _train(self, rt: Runtime, plan: StepPlan, rows: Rows) -> dict[str, float]:
        # The previous step's checkpoint may still be reading the weights this stage updates,
        # or a restart still loading the optimizer state it needs.
        try:
            rt.ckpt_writer.wait()
        except CorruptionError as exc:
            _refuse_corrupt_late_load(rt, exc)
        # The controller's coefficient for this step is the one its advantage stage recorded.
        kl_coef = float(rt.store.manifest(plan.step, "advantage")["kl_coef"])
        n = rt.cfg.rollout.n
        # ReMax's greedy baseline rows only set the other rows' advantages. Under sequence
        # parallelism the ranks of an SP group train on their rows together, one data rank.
        dist, table = data_view(rt.dist, rt.cfg.train.sp_size, without_baseline(rows()))
        inp = TrainInputs(
            step=plan.step,
            run_seed=rt.cfg.seed,
            table=table,
            kl_coef=kl_coef,
            global_samples=[(p, k) for p in plan.global_ids for k in range(n)],
            temperature=rt.cfg.rollout.temperature,
            response_budget=response_budget(rt.cfg.rollout),
            ptx=rt.ptx,
            images=RowImages(rt.vision, rt.run.root) if rt.vision is not None else None,
            routes=_route_column(rt, plan.step, table),
            skip=alike_rows(table) if skips_alike_groups(rt.cfg) else None,
        )
        if not plan.global_ids:
            # Dynamic sampling kept no group (none varied): nothing to learn from this step.
            return {"train/kl": 0.0, "train/updates": 0.0}
        critic = {} if rt.critic is None else critic_train.run(rt.critic, rt.dist, inp)
        if rt.critic is not None and plan.step <= rt.critic.cfg.warmup_steps:
            # Critic warm-up: the actor waits (no update, no KL-controller input).
            return {"train/kl": 0.0, "train/updates": 0.0, **critic}
        metrics = run(rt.cfg.train, rt.cfg.kl, rt.train_engine, dist, inp)
        if rt.cfg.train.skip_zero_advantage == "auto":
            # Why auto does not skip here (each blocker a metric, 1.0; jobs.status says it too).
            metrics |= {f"train/skip_blocked/{k}": 1.0 for k in skip_blockers(rt.cfg)}
        rt.kl_ctrl.update(metrics["train/kl"], n_steps=len(plan.global_ids) * n)
        dtype = perf.compute_dtype(rt.cfg.train.param_dtype, rt.cfg.model.dtype)
        peak = perf.peak_tflops(rt.dist.device, dtype, rt.cfg.launch.peak_tflops)
        return {**metrics, **perf.mfu(metrics["perf/train_tflops"], peak, rt.dist.world), **critic}


def _route_column(rt: Runtime, step: int, table: pa.Table) -> RouteColumn | None:
    """The routes column this step's updates replay (None: routed live)."""
    column = REPLAYED[rt.replay]
    if column is None or rt.route_shape is None:
        return None
    if column not in table.column_names:
        raise UserError(
            f"train.router_replay={rt.replay}: the committed rows have no column {column} "
            "(a run started without routes cannot replay them)"
        )
    return committed_column(rt, step, column)


def _update_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """What the update determines (timings, under perf/, are the machine's business)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def max_rel_diff(new: dict[str, float], old: dict[str, float]) -> float:
    """The largest |new - old| / max(|new|, |old|) over both dicts' keys (0 where equal, 1
    where one side lacks the key or is 0 and the other not)."""
    worst = 0.0
    for k in new.keys() | old.keys():
        a, b = new.get(k), old.get(k)
        if a == b:
            continue
        if a is None or b is None:
            return 1.0
        worst = max(worst, abs(a - b) / max(abs(a), abs(b)))
    return worst


def _refuse_corrupt_late_load(rt: Runtime, exc: CorruptionError) -> None:
    """The optimizer state that a restart loaded in the background is corrupt. The model
    weights it sampled this step's rows with were verified, so those rows stand; the
    checkpoint goes, and the next start falls back to the one before and replays."""
    ckpt = exc.path.parent
    events().write("corrupt_checkpoint", path=str(exc.path), deferred=True)
    if rt.dist.is_main and ckpt.parent == rt.run.checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
    raise UserError(
        f"checkpoint {ckpt} is corrupt ({exc.path.name}: {exc.why}) and was removed; "
        "start the run again to resume from the previous checkpoint"
    ) from exc
