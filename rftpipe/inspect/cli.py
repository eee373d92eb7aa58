"""Inspect a run from its committed files: per-step tables, samples, exports, plots, comparisons.

    rftpipe inspect RUN_DIR summary [--json]
    rftpipe inspect RUN_DIR samples [--step N] [--prompt-id ID] [--min-reward X]
                                            [--max-reward X] [--regex PAT]
                                            [--best K | --worst K] [--limit N]
    rftpipe inspect RUN_DIR export --format csv|jsonl --out FILE [sample filters]
    rftpipe inspect RUN_DIR html [--out FILE] [sample filters] [--limit N (64)]
    rftpipe inspect RUN_DIR plot --out PNG [--data-out CSV]
    rftpipe inspect RUN_DIR compare RUN_B [--out PNG]
    rftpipe inspect RUN_DIR routes [--step N] [--json]
    rftpipe inspect RUN_DIR verify [--json]

`verify` checks every committed file of the run against its manifest (every stage shard,
every published trajectory file, every file of every committed checkpoint, every stored
image against its sha256 name) and that every image a committed row references is stored,
and exits 1 if any is missing, truncated or altered. A restart checks only what it reads; this is the
full audit, for a quiet moment or a cron job. On an MoE run it also checks every routes
column (`routes`, `actor_routes`): each shard's shape against its step's manifest, and
each row's cell (exactly its fed tokens' routes, expert ids in range; one on every
trained row), one line per bad row naming it.

`routes` prints, per MoE layer of a step (default: the newest), the expert load of its
committed routes and the trainer's router agreement and load imbalance that step; a run
without routes is an error. On an MoE run `html` titles each response token with its
experts per layer, and `plot` adds a router agreement / load imbalance panel.

Only committed data is read: a step counts once its trajectories are published
(RUN/trajectories/step=N appears by an atomic rename) and its train MANIFEST.json exists,
so the tool is safe on a live or preempted run. Definitions:

  rollout/reward_std     population std (ddof=0), like rftpipe.run.metrics.step_metrics
  rollout/pass_rate      fraction of samples with reward_accuracy > 0 when that column
                         exists, otherwise the fraction with reward > 0
  advantage/mean, /std   over every token of every sample of the step (ddof=0)
  perf/STAGE_s           the stage's committed compute seconds (null if not committed)
  episode/turns_mean     multi-turn steps only (schema version 2): turns per episode;
  episode/STATUS_frac    the fraction of episodes that ended done, max_turns, truncated
                         or error; episode/model_tokens_mean and /env_tokens_mean the
                         response tokens per episode the model sampled (loss_mask 1)
                         and the environment added (loss_mask 0)

On a multi-turn run (trajectory schema version 2) `samples` prints each episode turn by
turn: per turn the model's message, the environment's answer, the turn's reward and its
tokens by role (from turn_offsets and loss_mask; the text is the recorded messages).

On a run whose model takes images (trajectory schema version 3) `samples` lists each
sample's images: the store path (images/ab/<sha256>.<ext>) with the pixel size and format
read from the file's header, or why it cannot be read.

`html` writes one self-contained page (nothing fetched, images embedded as data: URIs) of
the filtered samples: per prompt its text and images, per sample its rewards, advantage
and response, or its turns on a multi-turn run. A missing or altered image is an error
box in its place.

--regex matches the response text (RE2 syntax, as pyarrow.compute evaluates it; on a
multi-turn run, the last turn's).
CSV exports drop the list columns (token ids, logprobs, advantages): CSV has no list
type and a spreadsheet cannot use them; JSONL keeps them as JSON arrays.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from rftpipe.atomic import atomic_write_bytes
from rftpipe.inspect import images, page, routes
from rftpipe.inspect.episodes import (
    EPISODE_FIELDS,
    episode_turns,
    message_line,
    printable,
    sequence_text,
)
from rftpipe.inspect.summary import InspectError, Run, open_run, summarize
from rftpipe.inspect.verify import verify_run
from rftpipe.space import EXIT_NO_SPACE, NoSpace
from rftpipe.stages import ORDER as STAGES
from rftpipe.stages.generation import ahead_line, generated_ahead
from rftpipe.storage import branch_rows
from rftpipe.storage.branch_rows import BRANCH
from rftpipe.storage.episode_stats import has_episodes
from rftpipe.storage.layout import IMAGES_COLUMN
from rftpipe.storage.stage_store import StageStore

PROG = "inspect"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Right-aligned text table of `rows` under (key, header) `columns`."""
    cells = [[h for _, h in columns]] + [[_fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells
    )


def summary_columns(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    comps = sorted(k for k in rows[0] if k.startswith("rollout/reward_") and k[15:] not in _STATS)
    return [
        ("step", "step"),
        ("rollout/samples", "n"),
        ("rollout/reward_mean", "reward"),
        ("rollout/reward_std", "std"),
        ("rollout/reward_min", "min"),
        ("rollout/reward_max", "max"),
        *[(c, c.removeprefix("rollout/reward_")) for c in comps],
        ("rollout/pass_rate", "pass"),
        ("rollout/response_length", "len"),
        ("rollout/response_length_max", "len_max"),
        ("rollout/stop_frac", "stop"),
        *(EPISODE_COLUMNS if any("episode/turns_mean" in r for r in rows) else []),
        ("advantage/mean", "adv"),
        ("advantage/std", "adv_std"),
        ("train/kl", "kl"),
        ("train/clip_frac", "clip"),
        ("train/entropy", "entropy"),
        ("train/pg_loss", "pg_loss"),
        ("train/grad_norm", "gnorm"),
        *[(f"perf/{s}_s", f"{s}_s") for s in STAGES],
    ]


_STATS = {"mean", "std", "min", "max"}
EPISODE_COLUMNS = [
    ("episode/turns_mean", "turns"),
    ("episode/done_frac", "done"),
    ("episode/max_turns_frac", "max_t"),
    ("episode/truncated_frac", "trunc"),
    ("episode/error_frac", "err"),
    ("episode/model_tokens_mean", "model_tok"),
    ("episode/env_tokens_mean", "env_tok"),
]
"""A multi-turn run's summary columns (schema version 2 steps only)."""


def cmd_summary(args: argparse.Namespace) -> int:
    run = open_run(args.run_dir)
    rows = summarize(run)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows, summary_columns(rows)))
    if ahead := generated_ahead(StageStore(run.rundir)):
        # rollout.staleness >= 1: later steps' generation commits before they train.
        print(f"generated, not yet trained: {ahead_line(ahead)}")
    return 0


# -- samples and export ---------------------------------------------------------------------


def _check_regex(pattern: str) -> None:
    # pyarrow evaluates RE2, not Python's re: validate with the engine that will run it.
    try:
        pc.match_substring_regex(pa.array([""]), pattern=pattern)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise InspectError(f"bad regex {pattern!r}: {e}") from None


def sample_filter(run: Run, args: argparse.Namespace) -> ds.Expression:
    """The samples/export filters as one dataset expression, so Parquet row-group statistics
    and the step partition prune what is read before any row is decoded."""
    expr = ds.field("step").isin(run.steps)
    if args.step is not None:
        expr &= ds.field("step") == args.step
    if args.prompt_id is not None:
        expr &= ds.field("prompt_id") == args.prompt_id
    if args.min_reward is not None:
        expr &= ds.field("reward") >= args.min_reward
    if args.max_reward is not None:
        expr &= ds.field("reward") <= args.max_reward
    if args.regex is not None:
        _check_regex(args.regex)
        expr &= pc.match_substring_regex(ds.field("response"), pattern=args.regex)
    return expr


def select_samples(run: Run, args: argparse.Namespace, columns: list[str]) -> pa.Table:
    """Filtered rows in a stable order: by reward for --best/--worst, else by step,
    prompt_id, sample_idx (and an agent episode's sequences in branch order, `branch`);
    then cut to --best/--worst K or --limit N."""
    branched = [c for c in branch_rows.COLUMNS if c in run.dataset.schema.names]
    cols = list(dict.fromkeys(["step", "prompt_id", "sample_idx", *branched, "reward", *columns]))
    table = run.dataset.to_table(columns=cols, filter=sample_filter(run, args))
    key = [("step", "ascending"), ("prompt_id", "ascending"), ("sample_idx", "ascending")]
    key += [(BRANCH, "ascending")] if branched else []
    if args.best is not None:
        table = table.sort_by([("reward", "descending"), *key]).slice(0, args.best)
    elif args.worst is not None:
        table = table.sort_by([("reward", "ascending"), *key]).slice(0, args.worst)
    else:
        table = table.sort_by(key)
    if args.limit is not None:
        table = table.slice(0, args.limit)
    return table


def _indent(s: str) -> str:
    return "\n".join("    " + line for line in printable(s).splitlines() or [""])


def cmd_samples(args: argparse.Namespace) -> int:
    run = open_run(args.run_dir)
    comps = run.reward_components
    multi_turn = has_episodes(run.dataset.schema.names)
    cols = ["prompt", "response", "response_length", "finish_reason", *comps]
    cols += EPISODE_FIELDS if multi_turn else []
    vision = IMAGES_COLUMN in run.dataset.schema.names
    cols += [IMAGES_COLUMN] if vision else []
    table = select_samples(run, args, cols)
    described: dict[str, str] = {}
    for r in table.to_pylist():
        print(
            f"== step {r['step']}  prompt_id {r['prompt_id']}  sample {r['sample_idx']}"
            f"{sequence_text(r, '  ')}  reward {r['reward']:.6g}  finish {r['finish_reason']} "
            f"({r['response_length']} tokens)"
        )
        for c in comps:
            print(f"   {c} {'null' if r[c] is None else format(r[c], '.6g')}")
        if vision:
            print_images(run, r[IMAGES_COLUMN] or [], described)
        if multi_turn and r["num_turns"] is not None:
            print_episode(r)
        else:
            print("  prompt:")
            print(_indent(r["prompt"]))
            print("  response:")
            print(_indent(r["response"]))
        print()
    print(f"{table.num_rows} sample(s)", file=sys.stderr)
    return 0


def print_images(run: Run, relpaths: list[str], seen: dict[str, str]) -> None:
    """A vision row's images: each store path with its size and format from the file's
    header (or why it cannot be read); `none` for a text prompt of a vision run. `seen`
    keeps each file's description: a group's samples show the same images."""
    if not relpaths:
        print("  images: none")
        return
    print(f"  images ({len(relpaths)}):")
    for p in relpaths:
        if p not in seen:
            seen[p] = images.header(run.rundir.root, p).describe()
        print(f"    {printable(p)}  {seen[p]}")


def print_episode(r: dict[str, Any]) -> None:
    """A multi-turn row turn by turn: the prompt, then per turn the model's text, the
    environment's answer, the turn's tokens, reward and status; then the episode's end."""
    prompt, turns = episode_turns(r)
    model = sum(r["loss_mask"])
    print(
        f"   episode {r['episode_status']}: {r['num_turns']} turn(s), return "
        f"{_fmt(r['env_reward'])}, {model} model + {len(r['loss_mask']) - model} "
        "environment tokens"
    )
    print("  prompt:")
    for m in prompt:
        print(_indent(message_line(m)))
    for t, turn in enumerate(turns, 1):
        last = t == len(turns)
        status = f"ends the episode: {r['episode_status']}" if last else "continues"
        print(
            f"  turn {t}: reward {_fmt(turn.reward)}, {turn.model_tokens} model + "
            f"{turn.env_tokens} environment tokens, {status}"
        )
        if turn.action is not None:
            print(_indent(message_line(turn.action)))
        for m in turn.observations:
            print(_indent(message_line(m)))
        if turn.info not in (None, "{}"):
            print(f"    info {printable(turn.info or '')}")


def cmd_html(args: argparse.Namespace) -> int:
    """One self-contained HTML page of the filtered samples (`rftpipe.inspect.page`)."""
    run = open_run(args.run_dir)
    names = run.dataset.schema.names
    comps = run.reward_components
    multi_turn = has_episodes(names)
    cols = ["prompt", "response", "response_length", "finish_reason", *comps]
    cols += [
        c for c in ("reward_status", "reward_error", "advantages", IMAGES_COLUMN) if c in names
    ]
    cols += EPISODE_FIELDS if multi_turn else []
    route = _run_routes(run)
    cols += [route.column, "prompt_token_ids", "response_token_ids"] if route else []
    table = select_samples(run, args, cols)
    name = run.rundir.root.name
    out = args.out or Path(f"{name}-samples{'' if args.step is None else f'-step{args.step}'}.html")
    subtitle = (
        f"{run.rundir.root}: {table.num_rows} sample(s) of committed steps "
        f"{run.steps[0]}..{run.steps[-1]}"
        + ("" if args.step is None else f", step {args.step}")
        + (", with images" if IMAGES_COLUMN in names else "")
        + (", multi-turn" if multi_turn else "")
        + (f", with routes (column {route.column})" if route else "")
    )
    doc = page.render(
        run.rundir.root,
        table.to_pylist(),
        components=comps,
        multi_turn=multi_turn,
        title=f"rftpipe samples: {name}",
        subtitle=subtitle,
        routes=route,
    )
    # Whole or not at all: a full disk leaves no half page (and says so in one line).
    atomic_write_bytes(out, doc.encode("utf-8"))
    print(out)
    print(f"{table.num_rows} sample(s)", file=sys.stderr)
    return 0


def _run_routes(run: Run) -> page.RouteMarkup | None:
    """The page's token routes on an MoE run with routes (None: none)."""
    try:
        frags = [f for s in run.steps for f in run.fragments[s]]
        found = routes.run_routes(run.dataset.schema.names, frags)
    except ValueError as e:
        raise InspectError(f"routes: {e}") from None
    return None if found is None else page.RouteMarkup(*found)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def cmd_export(args: argparse.Namespace) -> int:
    run = open_run(args.run_dir)
    schema = run.dataset.schema
    if args.format == "csv":
        cols = [f.name for f in schema if not _is_list(f.type)]
    else:
        cols = list(schema.names)
    table = select_samples(run, args, cols)
    order = dict.fromkeys(["step", *schema.names])  # schema.names already holds "step"
    table = table.select([c for c in order if c in table.column_names])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.format == "csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, args.out)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            # Batch-wise so an export of a large run never holds every row as Python objects.
            for batch in table.to_batches(max_chunksize=4096):
                for rec in batch.to_pylist():
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{args.out}: {table.num_rows} rows", file=sys.stderr)
    return 0


# -- plot and compare -----------------------------------------------------------------------


def plot_series(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The plotted series, one entry per step (None where a value does not exist)."""
    comps = sorted(k for k in rows[0] if k.startswith("rollout/reward_") and k[15:] not in _STATS)
    keys = [
        "rollout/reward_mean",
        *comps,
        "rollout/response_length",
        "rollout/response_length_max",
        "train/kl",
        *[f"perf/{s}_s" for s in STAGES],
    ]
    # An MoE run's router series (train manifest metrics): a dense run's CSV is unchanged.
    keys += [k for k in MOE_KEYS if any(k in r for r in rows)]
    out: dict[str, list[Any]] = {"step": [r["step"] for r in rows]}
    out.update({k: [r.get(k) for r in rows] for k in keys})
    return out


MOE_KEYS = ("moe/agreement", "moe/load_imbalance")
"""The plotted series of an MoE policy (`rftpipe.stages.routes.routing_metrics`)."""


def plot_moe(ax: Any, steps: list[int], series: dict[str, list[Any]]) -> None:
    """Router agreement (left axis, 0..1) and load imbalance (right axis, 1: even) per step."""
    if "moe/agreement" in series:
        ax.plot(steps, _nan(series["moe/agreement"]), marker="o", ms=3, label="agreement")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("router agreement (replayed selections)")
    right = ax.twinx()
    if "moe/load_imbalance" in series:
        imbalance = _nan(series["moe/load_imbalance"])
        right.plot(steps, imbalance, color="tab:purple", ls="--", label="load imbalance")
    right.set_ylim(bottom=1.0)  # even load; the axis starts there
    right.set_ylabel("load imbalance (busiest / mean)")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _nan(xs: Iterable[Any]) -> list[float]:
    return [math.nan if x is None else float(x) for x in xs]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: login and compute nodes have no display
    import matplotlib.pyplot as plt

    return plt


def cmd_plot(args: argparse.Namespace) -> int:
    run = open_run(args.run_dir)
    series = plot_series(summarize(run))
    plt = _pyplot()
    steps = series["step"]
    moe = any(k in series for k in MOE_KEYS)
    # An MoE run: a third row, one panel across it, for its routers.
    fig, axes = plt.subplots(3 if moe else 2, 2, figsize=(11, 10 if moe else 7))
    if moe:
        grid = axes[2][0].get_gridspec()
        axes[2][0].remove()
        axes[2][1].remove()
        plot_moe(fig.add_subplot(grid[2, :]), steps, series)
        axes = axes[:2]
    ax = axes[0][0]
    ax.plot(steps, _nan(series["rollout/reward_mean"]), marker="o", ms=3, lw=2, label="reward")
    for k in series:
        if k.startswith("rollout/reward_") and k != "rollout/reward_mean":
            ax.plot(steps, _nan(series[k]), marker=".", ls="--", label=k.split("/")[1])
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(steps, _nan(series["rollout/response_length"]), marker="o", ms=3, label="mean")
    ax.plot(steps, _nan(series["rollout/response_length_max"]), ls=":", label="max")
    ax.set_ylabel("response length (tokens)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(steps, _nan(series["train/kl"]), marker="o", ms=3, color="tab:red")
    ax.set_ylabel("train/kl")
    ax = axes[1][1]
    for s in STAGES:
        ax.plot(steps, _nan(series[f"perf/{s}_s"]), marker=".", label=s)
    ax.set_ylabel("stage seconds")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run.rundir.root.name}: {len(steps)} committed steps")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    plt.close(fig)
    print(args.out)
    if args.data_out:
        write_series_csv(args.data_out, series)
        print(args.data_out)
    return 0


def write_series_csv(path: Path, series: dict[str, list[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(series)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for i in range(len(series["step"])):
            # repr round-trips floats exactly; empty cells mean "not committed".
            w.writerow(["" if series[k][i] is None else repr(series[k][i]) for k in keys])


COMPARE_KEYS = [
    "rollout/reward_mean",
    "rollout/pass_rate",
    "rollout/response_length",
    "rollout/stop_frac",
    "advantage/std",
    "train/kl",
    "train/entropy",
    "train/clip_frac",
    "train/grad_norm",
]


def _final_and_mean(rows: Sequence[dict[str, Any]], key: str) -> tuple[Any, Any]:
    vals = [v for r in rows if (v := r.get(key)) is not None]
    return (rows[-1].get(key), sum(vals) / len(vals) if vals else None)


def cmd_compare(args: argparse.Namespace) -> int:
    run_a, run_b = open_run(args.run_dir), open_run(args.run_b)
    rows_a, rows_b = summarize(run_a), summarize(run_b)
    name_a, name_b = run_a.rundir.root.name, run_b.rundir.root.name
    if name_a == name_b:
        name_a, name_b = "A", "B"
    print(f"A = {run_a.rundir.root} ({len(rows_a)} steps, final step {rows_a[-1]['step']})")
    print(f"B = {run_b.rundir.root} ({len(rows_b)} steps, final step {rows_b[-1]['step']})")
    table = []
    for k in COMPARE_KEYS:
        fa, ma = _final_and_mean(rows_a, k)
        fb, mb = _final_and_mean(rows_b, k)
        table.append({"metric": k, "fa": fa, "fb": fb, "ma": ma, "mb": mb})
    cols = [
        ("metric", "metric"),
        ("fa", f"{name_a} final"),
        ("fb", f"{name_b} final"),
        ("ma", f"{name_a} mean"),
        ("mb", f"{name_b} mean"),
    ]
    print(format_table(table, cols))
    if args.out:
        plt = _pyplot()
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for rows, name in ((rows_a, name_a), (rows_b, name_b)):
            steps = [r["step"] for r in rows]
            ax1.plot(steps, _nan(r["rollout/reward_mean"] for r in rows), marker="o", label=name)
            ax2.plot(
                steps, _nan(r["rollout/response_length"] for r in rows), marker="o", label=name
            )
        ax1.set_ylabel("mean reward")
        ax2.set_ylabel("mean response length (tokens)")
        for ax in (ax1, ax2):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=100)
        plt.close(fig)
        print(args.out)
    return 0


# -- routes ---------------------------------------------------------------------------------

EXPERTS_PER_TABLE = 16
"""Expert columns per block of the selections table, so a 64- or 128-expert model's table
stays readable in a terminal."""


def cmd_routes(args: argparse.Namespace) -> int:
    """Per MoE layer of a step: its committed routes' expert load, and what the trainer
    measured (router agreement, load imbalance) from the step's train manifest."""
    run = open_run(args.run_dir)
    step = run.steps[-1] if args.step is None else args.step
    if step not in run.fragments:
        raise InspectError(f"step {step} is not committed (committed: {_spans(run.steps)})")
    try:
        loads = routes.step_load(step, run.fragments[step])
    except ValueError as e:
        raise InspectError(str(e)) from None
    if not loads:
        raise InspectError(
            f"step {step} of {run.rundir.root} has no routes: a dense policy, or an MoE one "
            "that records none (train.router_replay=none)"
        )
    metrics = StageStore(run.rundir).manifest(step, "train").get("metrics", {})
    reports = [routes.step_report(load, metrics) for load in loads]
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    for rep in reports:
        print_routes(rep)
    return 0


def _spans(steps: Sequence[int]) -> str:
    """`1..30` for consecutive steps, else each."""
    if list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ", ".join(map(str, steps))


def print_routes(rep: dict[str, Any]) -> None:
    """`step_report`'s record as text: a header, a row per layer, the selections table."""
    print(
        f"step {rep['step']}, column {rep['column']} ({routes.WHOSE[rep['column']]}): "
        f"{rep['rows']} rows, {rep['tokens']} fed tokens"
    )
    print(
        f"{rep['layers']} MoE layers of {rep['experts']} experts, top-{rep['top_k']}; load "
        f"imbalance {_fmt(rep['imbalance'])} (the trainer's {_fmt(rep['train_imbalance'])}), "
        f"router agreement {_fmt(rep['agreement'])}, train/moe_aux_loss {_fmt(rep['aux_loss'])}"
    )
    layers = rep["per_layer"]
    for layer in layers:
        counts = layer["counts"]
        top = max(range(len(counts)), key=counts.__getitem__)
        share = counts[top] / max(layer["selections"], 1)
        layer["busiest"] = f"e{top} {share:.1%}"
        layer["idle"] = sum(c == 0 for c in counts)
    columns = [
        ("layer", "layer"),
        ("selections", "selections"),
        ("imbalance", "imbalance"),
        ("train_imbalance", "train_imb"),
        ("agreement", "agreement"),
        ("busiest", "busiest"),
        ("idle", "idle"),
    ]
    print(format_table(layers, columns))
    print("selections per expert (top_k per fed token per layer):")
    for lo in range(0, rep["experts"], EXPERTS_PER_TABLE):
        block = range(lo, min(lo + EXPERTS_PER_TABLE, rep["experts"]))
        rows = [{"layer": r["layer"], **{f"e{e}": r["counts"][e] for e in block}} for r in layers]
        print(format_table(rows, [("layer", "layer"), *((f"e{e}", f"e{e}") for e in block)]))


# -- command line ---------------------------------------------------------------------------


def _add_filters(p: argparse.ArgumentParser, default_limit: int | None) -> None:
    p.add_argument("--step", type=int)
    p.add_argument("--prompt-id", type=int)
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--regex", help="RE2 pattern searched for in the response text")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--best", type=int, metavar="K", help="the K highest-reward samples")
    g.add_argument("--worst", type=int, metavar="K", help="the K lowest-reward samples")
    p.add_argument("--limit", type=int, default=default_limit, metavar="N")


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every committed stage, checkpoint and stored image, and that every image a
    committed row references is stored; print each corrupt file and missing image; exit 1
    if any."""
    if not args.run_dir.is_dir():
        raise InspectError(f"no run directory at {args.run_dir}")
    audit = verify_run(args.run_dir)
    checked = {"stages": audit.stages, "checkpoints": audit.checkpoints, "images": audit.images}
    if audit.routes:
        checked["route_shards"] = audit.routes
    if args.json:
        out = {"checked": checked, "corrupt": audit.corrupt, "missing_images": audit.missing_images}
        print(json.dumps(out, indent=1))
    else:
        for b in audit.corrupt:
            print(f"corrupt: {b['path']} ({b['why']})")
        for m in audit.missing_images:
            print(f"missing image: {m['path']} (referenced by step {m['step']} {m['stage']})")
        # An MoE run's routes, said only where there are some: a dense run reads as before.
        with_routes = f" ({audit.routes} shards with routes)" if audit.routes else ""
        print(
            f"checked {audit.stages} committed stages{with_routes}, {audit.checkpoints} "
            f"checkpoints and {audit.images} images: {len(audit.corrupt)} corrupt file(s), "
            f"{len(audit.missing_images)} missing image(s)"
        )
    return 1 if audit.corrupt or audit.missing_images else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rftpipe inspect",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="one row per committed step")
    s.add_argument("--json", action="store_true", help="a JSON list of per-step dicts")
    s.set_defaults(func=cmd_summary)
    s = sub.add_parser("samples", help="pretty-print samples")
    _add_filters(s, default_limit=10)
    s.set_defaults(func=cmd_samples)
    s = sub.add_parser("export", help="write filtered samples as CSV or JSONL")
    s.add_argument("--format", choices=["csv", "jsonl"], required=True)
    s.add_argument("--out", type=Path, required=True)
    _add_filters(s, default_limit=None)
    s.set_defaults(func=cmd_export)
    s = sub.add_parser("html", help="one self-contained HTML page of samples with images")
    s.add_argument(
        "--out", type=Path, help="the page (default: RUN_NAME-samples[-stepN].html here)"
    )
    _add_filters(s, default_limit=64)
    s.set_defaults(func=cmd_html)
    s = sub.add_parser("plot", help="PNG of reward, length, KL and stage timings")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--data-out", type=Path, help="CSV of the plotted series, one row per step")
    s.set_defaults(func=cmd_plot)
    s = sub.add_parser("compare", help="two runs side by side")
    s.add_argument("run_b", type=Path)
    s.add_argument("--out", type=Path, help="PNG overlaying both runs' reward and length")
    s.set_defaults(func=cmd_compare)
    s = sub.add_parser("routes", help="an MoE run's expert load and router agreement per layer")
    s.add_argument("--step", type=int, help="the step (default: the newest committed)")
    s.add_argument("--json", action="store_true", help="a JSON list, one record per column")
    s.set_defaults(func=cmd_routes)
    s = sub.add_parser("verify", help="check every committed file against its manifest")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except InspectError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except NoSpace as e:  # the page or export it writes found no space: the machine's fault
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_NO_SPACE
    except (OSError, pa.ArrowException) as e:
        # An unreadable or concurrently removed file: still one line, not a traceback.
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
