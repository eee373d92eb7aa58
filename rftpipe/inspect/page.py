"""`rftpipe inspect RUN html`: one self-contained HTML page of samples.

Per group of samples (a prompt of a step, as `rollout.n` samples it) the page shows the
prompt and the images it showed, embedded as ``data:`` URIs read from the run's image
store; per sample its reward and each reward column, its advantage (per turn on a
multi-turn row) and its response, or its turns (the model's message, the environment's
answer, tokens by role, the turn's reward). A missing, altered or undecodable image is a
visible error box in the image's place.

The page loads nothing: no external URL, stylesheet or script. All recorded text
(prompts, responses, messages, reward errors) is untrusted and escaped. One inline
script runs when the page has loaded: it marks each <img> with ``data-loaded`` (``yes``
when the browser decoded it, with ``data-natural-size`` WxH) and the body with
``data-images-loaded`` / ``data-images-total``, and shows a banner if an image failed; the
browser test reads those attributes.

On an MoE run with routes (`rftpipe.inspect.routes`) each sample has a folded strip of its
response tokens (their ids: no tokenizer is loaded), each titled with the experts it was
routed to per layer when fed, ``L0: 1,3 · L1: 0,2``; the last token, never fed, has none.
A page holds at most `ROUTE_BUDGET` characters of them.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rftpipe.inspect import images
from rftpipe.inspect.episodes import content_text, episode_turns, printable, role, sequence_text
from rftpipe.storage.layout import IMAGES_COLUMN
from rftpipe.storage.routes import RouteShape, fed_tokens

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #111; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
.meta { color: #555; margin-bottom: 1.5em; }
section.group { border: 1px solid #bbb; border-radius: 6px; margin: 0 0 1.5em; padding: .8em; }
section.group > h2 { font-size: 1.05em; margin: 0 0 .5em; }
.images { display: flex; flex-wrap: wrap; gap: .8em; margin: .5em 0; }
figure { margin: 0; }
figure img { display: block; height: auto; min-width: 112px; max-width: 384px; image-rendering: pixelated;
  border: 1px solid #888; }
figcaption { font: 11px monospace; color: #444; max-width: 384px; overflow-wrap: anywhere; }
.img-error { border: 2px solid #c00; background: #fee; color: #900; padding: .5em;
  font: 12px monospace; max-width: 384px; overflow-wrap: anywhere; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f6f6; padding: .4em;
  margin: .2em 0; font: 12px/1.35 monospace; }
article.sample { border-top: 1px dashed #ccc; padding-top: .5em; margin-top: .6em; }
article.sample > h3 { font-size: 1em; margin: 0 0 .3em; }
table.rewards { border-collapse: collapse; font-size: 12px; margin: .2em 0; }
table.rewards td, table.rewards th { border: 1px solid #ccc; padding: 1px 6px;
  text-align: right; }
.turn { margin-left: 1em; border-left: 3px solid #9bd; padding-left: .6em; margin-top: .4em; }
.label { font-weight: 600; color: #333; }
details.routes { margin: .3em 0; }
.toks { font: 12px/1.8 monospace; overflow-wrap: anywhere; }
.toks i { font-style: normal; border-bottom: 1px dotted #66a; margin-right: .3em; cursor: help; }
#image-failures { display: none; background: #fee; color: #900; border: 2px solid #c00;
  padding: .5em; margin-bottom: 1em; }
"""

SCRIPT = """
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  let ok = 0;
  for (const img of imgs) {
    const loaded = img.complete && img.naturalWidth > 0;
    img.dataset.loaded = loaded ? "yes" : "no";
    if (loaded) { ok += 1; img.dataset.naturalSize = img.naturalWidth + "x" + img.naturalHeight; }
  }
  document.body.dataset.imagesLoaded = String(ok);
  document.body.dataset.imagesTotal = String(imgs.length);
  if (ok < imgs.length) {
    const banner = document.getElementById("image-failures");
    banner.textContent = (imgs.length - ok) + " of " + imgs.length +
      " embedded images did not decode in this browser";
    banner.style.display = "block";
  }
});
"""


CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    f"script-src 'sha256-{base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()}'"
)
"""The page's Content-Security-Policy: nothing is fetched (images only from data URIs),
and the one script that runs is `SCRIPT`, by its hash, so markup that escaped the escaping
could neither load anything nor run."""


def esc(s: Any) -> str:
    """Text as HTML: control bytes made visible, then every markup character escaped
    (quotes too, so the same function serves attribute values)."""
    return html.escape(printable(str(s)), quote=True)


def num(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def advantage_text(adv: Sequence[float] | None, mask: Sequence[int] | None = None) -> str:
    """A sample's (or a turn's) advantage: the value when every trained token has the same
    (GRPO, RLOO), else mean, min and max over the trained tokens (loss_mask 1 on a
    multi-turn row; the environment's tokens carry 0 and are not trained on)."""
    if adv is None:
        return "not computed"
    vals = [a for i, a in enumerate(adv) if mask is None or (i < len(mask) and mask[i])]
    if not vals:
        return "no trained tokens"
    lo, hi = min(vals), max(vals)
    if lo == hi:
        return f"{num(lo)} on each of {len(vals)} token(s)"
    return (
        f"mean {num(sum(vals) / len(vals))}, min {num(lo)}, max {num(hi)} over {len(vals)} token(s)"
    )


ROUTE_BUDGET = 4_000_000
"""Characters of token-route markup a page holds (about 4 MB): a 48-layer top-8 model's
title is about 1.3 KB a token. Past it a sample says its routes are not shown."""


class RouteMarkup:
    """Each sample's response tokens with their routes, from one routes column, within
    the page's `ROUTE_BUDGET`."""

    def __init__(self, column: str, shape: RouteShape, budget: int = ROUTE_BUDGET) -> None:
        self.column = column
        self.shape = shape
        self.left = budget

    def titles(self, r: dict[str, Any]) -> list[str] | str:
        """Each response token's title, or why the row's cell cannot give them."""
        prompt, response = len(r["prompt_token_ids"]), len(r["response_token_ids"])
        fed, s = fed_tokens(prompt, response, r.get("loss_mask")), self.shape
        cell = r[self.column]
        if len(cell) != fed * s.per_token:
            return f"its routes hold {len(cell)} bytes, not {fed * s.per_token}"
        routes = np.frombuffer(cell, np.uint8).reshape(fed, s.layers, s.top_k).tolist()
        # Route j is the token fed at position j: response token t was fed at prompt + t,
        # and the last one (of a multi-turn row, the last sampled one) never was.
        return [
            " · ".join(f"L{i}: {','.join(map(str, ids))}" for i, ids in enumerate(routes[j]))
            if j < fed
            else "never fed: no route"
            for j in range(prompt, prompt + response)
        ]

    def html(self, r: dict[str, Any]) -> str:
        if r.get(self.column) is None:
            return '<p class="routes-none">no routes recorded for this row</p>'
        titles = self.titles(r)
        if isinstance(titles, str):
            return (
                f'<div class="img-error" role="alert">routes: {esc(titles)} (the shard is '
                "corrupt or was edited; see `rftpipe inspect RUN verify`)</div>"
            )
        toks = "".join(
            f'<i title="{esc(t)}">{tok}</i>'
            for t, tok in zip(titles, r["response_token_ids"], strict=True)
        )
        if len(toks) > self.left:
            return (
                '<p class="routes-cut">routes not shown: the page holds at most '
                f"{ROUTE_BUDGET} characters of them (--step, --limit: fewer samples)</p>"
            )
        self.left -= len(toks)
        return (
            '<details class="routes"><summary>routes: the experts each response token was '
            f"routed to when fed, per layer, top-{self.shape.top_k} of {self.shape.experts} "
            f"(column {esc(self.column)}); hover a token id</summary>"
            f'<div class="toks">{toks}</div></details>'
        )


class ImageCache:
    """Each stored image read, checked and encoded once per page however many samples
    show it."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        self.seen: dict[str, images.StoredImage] = {}

    def get(self, relpath: str) -> images.StoredImage:
        if relpath not in self.seen:
            self.seen[relpath] = images.load(self.run_root, relpath)
        return self.seen[relpath]


def image_html(im: images.StoredImage, k: int) -> str:
    if im.error is not None or im.data_uri is None:
        return (
            f'<div class="img-error" role="alert" data-relpath="{esc(im.relpath)}">'
            f"image {k}: {esc(im.relpath)}<br>{esc(im.error)}</div>"
        )
    return (
        f'<figure><img src="{im.data_uri}" alt="image {k}" width="{im.width}" '
        f'height="{im.height}" data-relpath="{esc(im.relpath)}">'
        f"<figcaption>image {k}: {esc(im.describe())}<br>{esc(im.relpath)}</figcaption></figure>"
    )


def images_html(relpaths: Sequence[str], cache: ImageCache) -> str:
    if not relpaths:
        return '<p class="images-none">no images</p>'
    figs = "".join(image_html(cache.get(p), k) for k, p in enumerate(relpaths, 1))
    return f'<div class="images">{figs}</div>'


def message_html(m: dict[str, Any]) -> str:
    return f'<pre class="msg">[{esc(role(m))}] {esc(content_text(m.get("content")))}</pre>'


def rewards_html(r: dict[str, Any], components: Sequence[str]) -> str:
    cells = [("reward", r.get("reward")), *((c, r.get(c)) for c in components)]
    head = "".join(f"<th>{esc(name)}</th>" for name, _ in cells)
    body = "".join(f'<td data-col="{esc(name)}">{esc(num(v))}</td>' for name, v in cells)
    out = f'<table class="rewards"><tr>{head}</tr><tr>{body}</tr></table>'
    if r.get("reward_error"):
        out += f'<pre class="reward-error">{esc(r.get("reward_status"))}: {esc(r["reward_error"])}</pre>'
    return out


def sample_html(
    r: dict[str, Any],
    components: Sequence[str],
    multi_turn: bool,
    routes: RouteMarkup | None = None,
) -> str:
    head = (
        f"sample {esc(r['sample_idx'])}{esc(sequence_text(r, ', '))}: "
        f"reward {esc(num(r.get('reward')))}, "
        f"finish {esc(r.get('finish_reason'))} ({esc(r.get('response_length'))} tokens)"
    )
    parts = [
        f'<article class="sample" data-step="{esc(r["step"])}" '
        f'data-prompt-id="{esc(r["prompt_id"])}" data-sample="{esc(r["sample_idx"])}" '
        f'data-branch="{esc(r.get("branch", 0))}">'
        f"<h3>{head}</h3>",
        rewards_html(r, components),
    ]
    adv = r.get("advantages")
    if multi_turn and r.get("num_turns") is not None:
        mask = r["loss_mask"]
        model = sum(mask)
        parts.append(
            f'<p class="advantage"><span class="label">advantage</span> '
            f"{esc(advantage_text(adv, mask))}</p>"
            f'<p class="episode">episode {esc(r["episode_status"])}: {esc(r["num_turns"])} '
            f"turn(s), return {esc(num(r['env_reward']))}, {model} model + "
            f"{len(mask) - model} environment tokens</p>"
        )
        prompt, turns = episode_turns(r)
        if r.get("branch"):
            # A later sequence of an agent episode starts from a conversation of its own
            # (a rewritten history), not from the group's prompt shown above.
            parts.append('<div class="label">this sequence\'s prompt</div>')
            parts.extend(message_html(m) for m in prompt)
        for t, turn in enumerate(turns, 1):
            span_adv = adv[turn.start : turn.end] if adv is not None else None
            parts.append(
                f'<div class="turn" data-turn="{t}"><span class="label">turn {t}</span>: '
                f"reward {esc(num(turn.reward))}, {turn.model_tokens} model + "
                f"{turn.env_tokens} environment tokens, advantage "
                f"{esc(advantage_text(span_adv, mask[turn.start : turn.end]))}"
            )
            if turn.action is not None:
                parts.append(message_html(turn.action))
            parts.extend(message_html(m) for m in turn.observations)
            if turn.info not in (None, "{}"):
                parts.append(f'<pre class="info">info {esc(turn.info)}</pre>')
            parts.append("</div>")
    else:
        parts.append(
            f'<p class="advantage"><span class="label">advantage</span> '
            f"{esc(advantage_text(adv))}</p>"
            '<div class="label">response</div>'
            f'<pre class="response">{esc(r.get("response") or "")}</pre>'
        )
    if routes is not None:
        parts.append(routes.html(r))
    parts.append("</article>")
    return "".join(parts)


def _groups(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Consecutive rows of one prompt of one step (the default order keeps a group's
    samples together; --best/--worst may split them)."""
    group: list[dict[str, Any]] = []
    for r in rows:
        if group and (r["step"], r["prompt_id"]) != (group[0]["step"], group[0]["prompt_id"]):
            yield group
            group = []
        group.append(r)
    if group:
        yield group


def group_html(
    rows: list[dict[str, Any]],
    components: Sequence[str],
    multi_turn: bool,
    cache: ImageCache,
    routes: RouteMarkup | None = None,
) -> str:
    first = rows[0]
    parts = [
        f'<section class="group" data-step="{esc(first["step"])}" '
        f'data-prompt-id="{esc(first["prompt_id"])}">'
        f"<h2>step {esc(first['step'])} · prompt_id {esc(first['prompt_id'])} · "
        f"{len(rows)} sample(s)</h2>"
    ]
    if multi_turn and first.get("num_turns") is not None:
        prompt, _ = episode_turns(first)
        parts.append('<div class="label">prompt</div>')
        parts.extend(message_html(m) for m in prompt)
    else:
        parts.append(
            f'<div class="label">prompt</div><pre class="prompt">{esc(first["prompt"])}</pre>'
        )
    # Samples of one prompt show the same images; a row that differs shows its own.
    shown = first.get(IMAGES_COLUMN)
    if shown is not None:
        parts.append(images_html(shown, cache))
    for r in rows:
        mine = r.get(IMAGES_COLUMN)
        if mine is not None and mine != shown:
            parts.append(images_html(mine, cache))
        parts.append(sample_html(r, components, multi_turn, routes))
    parts.append("</section>")
    return "".join(parts)


def render(
    run_root: Path,
    rows: list[dict[str, Any]],
    *,
    components: Sequence[str],
    multi_turn: bool,
    title: str,
    subtitle: str,
    routes: RouteMarkup | None = None,
) -> str:
    """The page of `rows` (as `select_samples` returns them, as Python dicts); with
    `routes`, each sample's tokens with their routes (the rows then hold the routes
    column and the token ids)."""
    cache = ImageCache(run_root)
    body = "".join(group_html(g, components, multi_turn, cache, routes) for g in _groups(rows))
    if not rows:
        body = "<p>no samples match</p>"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>"
        f'<body><h1>{esc(title)}</h1><div class="meta">{esc(subtitle)}</div>'
        '<div id="image-failures" role="alert"></div>'
        f"{body}<script>{SCRIPT}</script></body></html>\n"
    )
