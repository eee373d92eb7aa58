"""The HF rollout engine (`rollout.engine=hf`): our KV-cache decode loop over a
transformers model, and its stop-string check (vLLM's rule)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, GenerationConfig

from rftpipe.config.schema import RolloutConfig
from rftpipe.engines import moe
from rftpipe.engines.models import as_causal_lm
from rftpipe.engines.rollout.base import (
    DecodeCounts,
    FinishReason,
    GroupOutput,
    SampleOutput,
    Vision,
    split_groups,
)
from rftpipe.engines.rollout.decode_batch import AUTO, STATIC, CompactRule, DecodeBatch
from rftpipe.engines.vision import VisionInputs, vision_forward_inputs
from rftpipe.seeding import sample_seed

Draw = Callable[[list[int]], torch.Tensor]
"""Uniform draws (len(rows), 1) in float64 for the call's `rows` in the decode batch."""


class HFGenerateEngine:
    """Samples with its own KV-cache decode loop over a transformers model; greedy
    evaluation uses `model.generate`. `rollout.groups_per_call` groups share a call.

    Each group's prompt is prefilled once and its n samples decode against that shared
    cache, the same exact prefix sharing the train forward uses. Sampling follows
    `generate`'s order (EOS masked before min_new_tokens, temperature, top-k, top-p). Each
    sample draws from its own generator, seeded by `sample_seed` of its group's seed and
    its index, so a sample's draws do not depend on which rows share its batch; a row that
    ended leaves the decode batch (`decode_batch`, `rollout.compact_decode`). With
    `compact_decode=off` every row decodes until the call's last row ends and the call
    draws from one generator seeded by its first group's seed, by row position (the loop
    before 2026-12-02, kept bit for bit for runs that started with it).

    Which groups share a call is fixed by the step's global prompt order (see the rollout
    stage), so padding and batch shape, and with them the samples, are the same on any
    world size. The engine shares the trainer's module when colocated on one device, which
    makes a weight sync free.

    A response ends at the tokenizer's EOS or any of `rollout.eos_token_ids` (kept as its
    last token), or at the token that completes one of `rollout.stop` (`decode`, the
    tokenizer's, turns a response prefix into text), as vLLM ends it.

    Prompts with images (a vision-language model, `vision`: each prompt's `VisionInputs`)
    pass their pixels to the prefill forward only, with the 3-D M-RoPE positions of the
    model's `get_rope_index`; a group's image prompt is prefilled once (its vision tower
    runs once) and its cache repeated n-fold, as for text. Decoding needs no pixels: a
    token after the prompt takes, on all three rotary axes, one more than the largest
    position in its prompt, which is not the prompt's length (an image of h x w merged
    patches spans max(h, w) positions, not h * w), as `generate`'s `rope_deltas` give it.
    Text prompts (`vision` None) take exactly the text path.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: RolloutConfig,
        eos_id: int,
        pad_id: int,
        decode: Callable[[list[int]], str] | None = None,
        record_routes: bool = False,
    ) -> None:
        if cfg.stop and decode is None:
            raise ValueError("rollout.stop needs the tokenizer's decode to find stop strings")
        self.model = model
        self._routers = moe.Routers.of(model) if record_routes else None
        """An MoE policy under R3: each sample's routes are recorded (`GroupOutput.routes`)."""
        if record_routes and self._routers is None:
            raise ValueError("record_routes: the policy has no MoE router")
        self.cfg = cfg
        self.eos_id = eos_id
        self.eos_ids = [eos_id, *(t for t in cfg.eos_token_ids if t != eos_id)]
        """Every id that ends a response."""
        self.pad_id = pad_id
        self.decode = decode
        self.weight_version = 0
        self.continue_turns = (cfg.env is None or cfg.env.keep_kv_cache) and (
            cfg.agent is None or cfg.agent.keep_kv_cache
        )
        """False (`rollout.env.keep_kv_cache`, `rollout.agent.keep_kv_cache`): every turn
        prefills its whole history."""
        self._sessions: dict[Hashable, _Session] = {}
        """Each live episode's kept cache (one per call: its rows share it), by key."""
        self.compaction: CompactRule | None = AUTO if cfg.compact_decode == "auto" else None
        """When ended rows leave the decode batch; None: never, and `generate_groups` draws
        by position from one generator per call (`compact_decode=off`)."""
        self.decode_counts = DecodeCounts()
        """Decode forwards and rows fed since the last `take_decode_counts`."""

    @property
    def groups_per_call(self) -> int:
        return self.cfg.groups_per_call

    @property
    def collective(self) -> bool:
        return False

    def generate_group(
        self, prompt_ids: Sequence[int], n: int, seed: int, vision: VisionInputs | None = None
    ) -> GroupOutput:
        return self.generate_groups([prompt_ids], n, [seed], None if vision is None else [vision])[
            0
        ]

    @torch.no_grad()
    def generate_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seeds: Sequence[int],
        vision: Vision = None,
    ) -> list[GroupOutput]:
        device = next(self.model.parameters()).device
        if self.compaction is None:
            # One generator per call, drawn by row position: the call's groups are fixed by
            # the global prompt order, and every row stays in the batch.
            draw = _call_draws(seeds[0], device)
        else:
            draw = _row_draws([sample_seed(s, k) for s in seeds for k in range(n)], device)
        limits = [self.cfg.max_new_tokens] * (len(prompts) * n)
        if self._routers is None:
            tokens, logprobs, reasons = self._decode(prompts, n, draw, limits, vision)
            return split_groups(tokens, logprobs, reasons, n)
        log = _RouteLog()
        with self._routers.recording(seed=seeds[0]):
            tokens, logprobs, reasons = self._decode(prompts, n, draw, limits, vision, log)
        return split_groups(tokens, logprobs, reasons, n, log.rows(tokens))

    @torch.no_grad()
    def generate_rows(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_new: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        vision: Vision = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleOutput]:
        """One sample of each prompt, row r drawn from its own generator seeded `seeds[r]`
        and cut at `max_new[r]` new tokens: a multi-turn episode's next turn, whose draws
        then depend on its own (run seed, step, prompt id, sample, turn) alone.

        With `keys` (each row's episode) the call continues those episodes' KV caches (see
        `continues_turns`): every key new (a first turn, or a resumed stage's first replayed
        turn), or every key held by one earlier call's rows, in their order; rows of that
        call left out have ended and are dropped. A row with `max_new` 0 is only prefilled.

        `vision` (each row's images) is for a first turn only (a call that prefills its
        rows whole): a later turn's appended chunk must be text, as its kept cache already
        holds the images.

        Recording routes (R3), each row's `routes` (its routes so far, over its prompt's
        first tokens) are forced in this call's prefill: a position is routed once, by the
        first forward that feeds it, and every later one (the next turn's prefill, with or
        without a kept cache, a resumed stage's replay, the trainer) replays that selection;
        forcing the selection a live forward makes changes nothing, bit for bit. The output
        routes cover each row's prompt and its sampled tokens but the last.
        """
        if not prompts:
            return []
        known: list[torch.Tensor | None] = [None] * len(prompts) if routes is None else list(routes)
        log = _RouteLog() if self._routers is not None else None
        draw = _row_draws(seeds, next(self.model.parameters()).device)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._recording(seeds[0]):
                if keys is not None and self.continue_turns:
                    tokens, logprobs, reasons = self._continue(
                        prompts, list(keys), draw, max_new, vision, known, log
                    )
                else:
                    # A group's first turn: n consecutive rows of one prompt, prefilled once
                    # and its cache shared, as `generate_groups` does (the draws stay each
                    # row's own).
                    n = _run_length(prompts, vision, known)
                    first = self._prefill(
                        prompts[::n], n, None if vision is None else vision[::n], log, known[::n]
                    )
                    tokens, logprobs, reasons = self._sample_loop(first, draw, max_new, log)
        finally:
            self.model.train(was_training)
        fed = [None] * len(tokens) if log is None else log.rows(tokens)
        return [
            SampleOutput(tokens=t, logprobs=lp, finish_reason=r, routes=f)
            for t, lp, r, f in zip(tokens, logprobs, reasons, fed, strict=True)
        ]

    def _recording(self, seed: int) -> contextlib.AbstractContextManager[None]:
        return (
            contextlib.nullcontext()
            if self._routers is None
            else self._routers.recording(seed=seed)
        )

    @contextlib.contextmanager
    def _forcing(self, known: Sequence[torch.Tensor | None], slots: moe.Slots) -> Iterator[None]:
        """Force the rows' `known` routes in the forward this wraps, laid out by `slots`
        (rows without routes, and positions past them, route live)."""
        if self._routers is None or all(r is None for r in known):
            yield
            return
        self._routers.set_plan(moe.lay_out(known, slots.rows, slots.pos, self._routers.shape))
        try:
            yield
        finally:
            self._routers.clear()

    @torch.no_grad()
    def greedy_rows(
        self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], vision: Vision = None
    ) -> list[SampleOutput]:
        """The greedy continuation of each prompt (a greedy evaluation episode's next turn),
        cut at `max_new[r]` new tokens, through the sampling loop with the most likely
        token in place of a draw: it ends on an EOS (kept) or a stop string as a sample
        does. No draws, so nothing depends on a seed; logprobs are 0 (evaluation reads
        none). It re-prefills each turn's whole history (evaluation keeps no caches)."""
        if not prompts:
            return []
        tokens, _, reasons = self._decode(prompts, 1, None, max_new, vision)
        return [
            SampleOutput(tokens=t, logprobs=[0.0] * len(t), finish_reason=r)
            for t, r in zip(tokens, reasons, strict=True)
        ]

    @property
    def continues_turns(self) -> bool:
        """Whether `generate_rows(keys=...)` keeps each episode's KV cache between its turns.

        Re-prefilling an episode's whole history at every turn costs a prefill that grows
        with the turn; instead each episode's cache holds its history's prefilled positions
        and the next turn prefills only what was appended since (the last turn's sampled
        tokens and the environment's tokens), as one chunk, on top of it.

        A resumed stage must sample the same turns bitwise, so the cache at the start of a
        turn is a deterministic function of the committed tokens and of which episodes were
        live at each earlier turn:

        - Only prefill forwards write the kept cache. After a turn's decode its K/V for the
          sampled tokens (computed one token at a time) are cropped off; the next turn
          prefills those tokens again within its chunk. Keeping them would spare that
          (at most `max_new_tokens` a row a turn), but a replay would then have to redo
          every decode step in its batch, ended rows' pad steps included.
        - Per-row results depend on the batch: on the tiny model on CPU (2026-11-26) a row
          prefilled alone or beside 1 or 3 others of its width was bitwise the same, but
          left-padded by 17 positions (beside a longer row) its logits moved by up to
          9e-8, and padding follows the batch's longest row. So one cache is one call's
          rows, batched as the call batched them (left padding; each chunk left-padded to
          the call's longest, its pad columns masked), and ended rows are dropped by exact
          row selection (the kept rows' values unchanged).
        - A resumed stage (its caches empty) replays the committed turns through the same
          calls with `max_new` 0 (`stages.episodes`): the same prefills in the same batches,
          so the same cache bit for bit, before it decodes the next turn.

        Against the trainer's forward over the whole sequence, the logprobs differ by float
        rounding only, as re-prefilled ones do (tests/test_multiturn_engines.py bounds both).

        Memory: the caches hold every live episode of the stage's calls at once (all calls
        take each turn in order), each row as wide as its call's longest prompt plus each
        earlier turn's longest chunk, at 2 x layers x KV heads x head dim values a position
        (SmolLM2-135M in fp32: 45 KiB); re-prefilling holds one call's rows at a time. An
        episode's row is freed when it ends (`end_episodes`), and all at the stage's end,
        on `sleep` and on new weights. `rollout.env.keep_kv_cache=false` (for agents,
        `rollout.agent.keep_kv_cache=false`) turns it off.
        """
        return self.continue_turns

    def end_episodes(self, keys: Iterable[Hashable] | None = None) -> None:
        """Free the kept caches of the episodes `keys` (None: all)."""
        if keys is None:
            self._sessions.clear()
            return
        gone = set(keys)
        for sess in {id(s): s for k in gone if (s := self._sessions.get(k))}.values():
            sess.keep([k not in gone for k in sess.keys])
        for k in gone:
            self._sessions.pop(k, None)

    def _continue(
        self,
        prompts: Sequence[Sequence[int]],
        keys: list[Hashable],
        draw: Draw,
        limits: Sequence[int],
        vision: Vision,
        known: list[torch.Tensor | None],
        log: _RouteLog | None,
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        """`generate_rows` on the kept caches of `keys`' episodes."""
        if len(set(keys)) != len(keys):
            raise ValueError("generate_rows: a key appears twice in one call")
        held = {id(s): s for k in keys if (s := self._sessions.get(k)) is not None}
        if not held:
            n = _run_length(prompts, vision, known)
            first = self._prefill(
                prompts[::n], n, None if vision is None else vision[::n], log, known[::n]
            )
            sess = _Session(
                keys=list(keys),
                cache=first.cache,
                mask=first.mask,
                next_pos=first.pos[:, -1] + 1,
                tokens=[list(p) for p in prompts],
                routes=None if log is None else log.prefix_rows(len(prompts)),
            )
        else:
            if vision is not None and any(v is not None for v in vision):
                raise ValueError(
                    "generate_rows: images in a later turn (the kept cache is text-only "
                    "past its first turn)"
                )
            sess = next(iter(held.values()))
            if len(held) > 1 or any(k not in sess.keys for k in keys):
                raise ValueError("generate_rows: the keys are not one earlier call's episodes")
            where = [sess.keys.index(k) for k in keys]
            if where != sorted(where):
                raise ValueError("generate_rows: the keys are not in their earlier call's order")
            sess.keep([k in set(keys) for k in sess.keys])
            first = self._prefill_chunk(sess, prompts, known, log)
        for k in keys:
            self._sessions[k] = sess
        # Only prefilled positions stay: the decode steps' K/V are computed one token at a
        # time, which a resumed stage's replay would not reproduce.
        return self._sample_loop(first, draw, limits, log, hold=first.mask.shape[1])

    def _prefill_chunk(
        self,
        sess: _Session,
        prompts: Sequence[Sequence[int]],
        known: list[torch.Tensor | None],
        log: _RouteLog | None,
    ) -> _Prefilled:
        """Prefill what each row's prompt adds to its kept tokens, on top of `sess`."""
        chunks = []
        for r, (held, prompt) in enumerate(zip(sess.tokens, prompts, strict=True)):
            if len(prompt) <= len(held) or list(prompt[: len(held)]) != list(held):
                raise ValueError(
                    f"generate_rows: row {r}'s prompt does not extend its episode's earlier "
                    "turns (the same key, another conversation)"
                )
            chunks.append(prompt[len(held) :])
        device = next(self.model.parameters()).device
        ids, cmask = (t.to(device) for t in _left_pad(chunks, self.pad_id))
        # Chunk padding sits between the kept positions and the chunk, masked out; a pad's
        # position is its row's previous one (never attended, any value would do).
        pos = sess.next_pos[:, None] + cmask.cumsum(-1) - 1
        mask = torch.cat([sess.mask, cmask], dim=1)
        with self._forcing(known, _chunk_slots(cmask, [len(t) for t in sess.tokens])):
            logits = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=sess.cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        if log is not None and self._routers is not None:
            assert sess.routes is not None, "a recording engine's session keeps its routes"
            for r, (kept, mine) in enumerate(zip(sess.routes, known, strict=True)):
                n = min(len(kept), 0 if mine is None else len(mine))
                if mine is not None and not torch.equal(kept[:n], mine[:n].to(kept.dtype)):
                    raise ValueError(
                        f"generate_rows: row {r}'s routes differ from those its kept cache "
                        "was computed with"
                    )
            log.prefilled(self._routers.take(), cmask, heads=sess.routes)
            sess.routes = log.prefix_rows(len(prompts))
        sess.mask, sess.next_pos = mask, pos[:, -1] + 1
        sess.tokens = [list(p) for p in prompts]
        return _Prefilled(sess.cache, mask, pos[:, -1:], logits)

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        vision: Vision = None,
        log: _RouteLog | None = None,
        known: Sequence[torch.Tensor | None] | None = None,
    ) -> _Prefilled:
        """Prefill each prompt once (left padding) and repeat its cache n-fold, row-major:
        prefill costs one row per group instead of n. `vision`: each prompt's images;
        `known`: each prompt's routes to force (`generate_rows`)."""
        device = next(self.model.parameters()).device
        # Left padding; a single group has none, so its numerics never see padding.
        ids, mask = (t.to(device) for t in _left_pad(prompts, self.pad_id))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        images: dict[str, torch.Tensor] = {}
        if vision is not None:
            width = ids.shape[1]
            for r, (p, v) in enumerate(zip(prompts, vision, strict=True)):
                if v is not None:
                    v.check(len(p), f"prompt {r}")
            images = (
                vision_forward_inputs(
                    self.model, ids, mask, vision, [width - len(p) for p in prompts]
                )
                or {}
            )
        if images:
            # The decode positions continue from each row's largest M-RoPE position (its
            # last text token's, on all three axes), not from its length; pads hold 0.
            pos = images["position_ids"].amax(dim=(0, 2))[:, None].expand_as(mask)
        cache = DynamicCache(config=as_causal_lm(self.model).config)
        with self._forcing(known or [None], moe.padded_slots(mask)):
            logits = self.model(
                input_ids=ids,
                attention_mask=mask,
                **({"position_ids": pos} | images),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        if log is not None and self._routers is not None:
            log.prefilled(self._routers.take(), mask, share=n)
        if n > 1:
            cache.batch_repeat_interleave(n)
        return _Prefilled(
            cache,
            mask.repeat_interleave(n, dim=0),
            pos[:, -1:].repeat_interleave(n, dim=0),
            logits.repeat_interleave(n, dim=0),
        )

    def _decode(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        draw: Draw | None,
        limits: Sequence[int],
        vision: Vision = None,
        log: _RouteLog | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        """n samples of each prompt, row-major; `draw(rows)` gives each decode step's
        uniform draws (None: the most likely token, unfiltered: greedy), and row r stops
        with "length" after `limits[r]` new tokens. `log`: record the routes."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self._sample_loop(self._prefill(prompts, n, vision, log), draw, limits, log)
        finally:
            self.model.train(was_training)

    def _sample_loop(
        self,
        first: _Prefilled,
        draw: Draw | None,
        limits: Sequence[int],
        log: _RouteLog | None = None,
        hold: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        """Decode from a prefill's next-token logits: `draw(rows)` gives each step's uniform
        draws for the rows in the batch, and row r stops with "length" after `limits[r]` new
        tokens. Ended rows leave the batch by `self.compaction`. `hold`: a kept session
        cache's width, which the cache is cropped back to, every row in place."""
        cfg = self.cfg
        device = first.logits.device
        logits = first.logits
        rows = logits.shape[0]
        batch = DecodeBatch.of(first.cache, first.mask, first.pos, hold)
        rule = self.compaction if self.compaction is not None and batch.can_leave() else STATIC
        limit = torch.tensor(list(limits), device=device)
        # A row with no budget is done before its first token.
        done = limit <= 0
        eos = torch.tensor(self.eos_ids, device=device)
        # Per row, its length once it ended (EOS or stop string), None while it runs.
        ends: list[int | None] = [None] * rows
        texts = None
        if cfg.stop and self.decode is not None:  # `__init__` refuses stop without decode
            texts = _StopText(self.decode, cfg.stop, rows)
        steps = max(limits, default=0)
        out_tok = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=device)
        out_lp = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        for t in range(steps):
            live = batch.rows
            ended = done[live]
            scaled = logits.float() / cfg.temperature
            if draw is None:
                tok = logits.argmax(dim=-1)
            else:
                tok = _sample(torch.softmax(self._filter(scaled, t), dim=-1), draw(live.tolist()))
            tok = torch.where(ended, self.pad_id, tok)
            out_tok[live, t] = tok
            out_lp[live, t] = torch.log_softmax(scaled, dim=-1).gather(-1, tok[:, None])[:, 0]
            hit = torch.isin(tok, eos) & ~ended
            if texts is not None:
                # Greedy decoding ignores min_new_tokens, as `greedy` (generate) does.
                check = draw is None or t >= cfg.min_new_tokens
                running = (~ended).tolist()
                hit |= texts.completed(live.tolist(), tok.tolist(), running, check).to(device)
            for i in hit.nonzero().flatten().tolist():
                ends[int(live[i])] = t + 1
            # A row at its own limit stops with "length" (its end stays None).
            ended |= hit | (limit[live] <= t + 1)
            done[live] = ended
            if bool(done.all()) or t == steps - 1:
                break
            if rule.due(int(ended.sum()), len(ended)):
                batch.leave(~ended)
                tok = tok[~ended]
            batch.advance()
            logits = self.model(
                input_ids=tok[:, None],
                attention_mask=batch.mask,
                position_ids=batch.pos,
                past_key_values=batch.cache,
                use_cache=True,
            ).logits[:, -1]
            if log is not None and self._routers is not None:
                log.decode(self._routers.take(), batch.rows, rows)
        if hold is not None:
            batch.restore()
        self.decode_counts.add(batch.forwards, batch.row_steps, rows)
        return _cut_rows(out_tok, out_lp, ends, limits)

    def take_decode_counts(self) -> DecodeCounts:
        """The decode counts since the last call (the rollout stage's metrics)."""
        out, self.decode_counts = self.decode_counts, DecodeCounts()
        return out

    def _filter(self, scaled: torch.Tensor, t: int) -> torch.Tensor:
        """What sampling draws from at new-token index t: EOS masked before min_new_tokens,
        then top-k, then top-p (the recorded logprobs are of `scaled`, before all three)."""
        cfg = self.cfg
        if t < cfg.min_new_tokens:
            scaled = scaled.clone()
            scaled[:, self.eos_ids] = -torch.inf
        if 0 < cfg.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, cfg.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, -torch.inf)
        if cfg.top_p < 1.0:
            srt, idx = torch.sort(scaled, dim=-1, descending=True)
            probs = torch.softmax(srt, dim=-1)
            # Drop a token once the tokens ranked above it already hold top_p of the mass;
            # the most likely token always stays.
            drop = (probs.cumsum(-1) - probs) > cfg.top_p
            scaled = scaled.scatter(-1, idx, srt.masked_fill(drop, -torch.inf))
        return scaled

    @torch.no_grad()
    def greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        batch: int = 32,
        vision: Vision = None,
    ) -> list[list[int]]:
        """Greedy completions, left-padded batches (for evaluation, not for training rows);
        `vision`: each prompt's images (`generate` computes their M-RoPE positions)."""
        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            ids, mask = (t.to(device) for t in _left_pad(chunk, self.pad_id))
            width = ids.shape[1]
            images: dict[str, torch.Tensor] = {}
            if vision is not None:
                starts = [width - len(p) for p in chunk]
                found = vision_forward_inputs(self.model, ids, mask, vision[i : i + batch], starts)
                # `generate` derives the positions (and its decode deltas) itself.
                images = {k: v for k, v in (found or {}).items() if k != "position_ids"}
            seq = as_causal_lm(self.model).generate(
                input_ids=ids, attention_mask=mask, generation_config=cfg, **images
            )
            for row in seq[:, width:].tolist():
                end = next((i for i, t in enumerate(row) if t in self.eos_ids), len(row))
                row = row[:end]
                if self.cfg.stop and self.decode is not None:
                    # Greedy rows do not depend on each other, so cutting a row after its
                    # stop string equals having stopped it there.
                    row = row[: stop_length(self.decode, row, self.cfg.stop)]
                outs.append(row)
        self.model.train(was_training)
        return outs

    def update_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor] | Path, version: int
    ) -> None:
        """Take new weights: free when they are this engine's own module (colocated); a
        directory holds them as `rftpipe.stages.sync.write_weights` wrote them (separate
        rollout ranks: `rftpipe.run.handoff`)."""
        if isinstance(weights, Path):
            load_weights_dir(self.model, weights)
        elif weights is not self.model:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            self.model.load_state_dict(state)
        self.weight_version = version
        self.end_episodes()  # caches of the old weights

    def close(self) -> None:
        """Nothing of its own to end: the model goes with the process."""
        self.end_episodes()

    def sleep(self) -> None:
        """Free the kept episode caches (`continues_turns`); the weights are the trainer's
        own memory."""
        self.end_episodes()

    def wake(self) -> None:
        """See `sleep`."""


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """A prefill forward's result, where decoding starts."""

    cache: DynamicCache
    mask: torch.Tensor
    """(rows, width): 1 on the cached positions that are tokens, 0 on padding."""
    pos: torch.Tensor
    """(rows, 1): each row's last position."""
    logits: torch.Tensor
    """(rows, vocab): the next token's."""


@dataclass(kw_only=True, slots=True)
class _RouteLog:
    """One call's recorded routes (R3): each prefilled row's, then each decode forward's.
    Decode forward t fed every row's response token t (a row that had ended fed a pad,
    whose route is dropped)."""

    heads: list[torch.Tensor] | None = None
    """Per row, the routes of the positions its kept cache held before this call's
    prefill (None: the prefill fed whole prompts)."""
    prompts: list[torch.Tensor] = field(default_factory=list)
    """Per prefilled row (P, L, k): the routes of what it prefilled (left padding
    dropped)."""
    share: int = 1
    """Rows per prefilled row (a group's n samples share its prompt's prefill)."""
    decoded: list[torch.Tensor] = field(default_factory=list)
    """Per decode forward (batch rows, L, k)."""
    decoded_at: list[torch.Tensor] = field(default_factory=list)
    """Per decode forward, each call row's index in its batch (-1: it had left)."""

    def decode(self, recorded: torch.Tensor, batch_rows: torch.Tensor, rows: int) -> None:
        """Take a decode forward's selection over the call's rows `batch_rows`."""
        at = torch.full((rows,), -1, dtype=torch.long)
        at[batch_rows.cpu()] = torch.arange(len(batch_rows))
        self.decoded.append(recorded)
        self.decoded_at.append(at)

    def prefilled(
        self,
        recorded: torch.Tensor,
        mask: torch.Tensor,
        share: int = 1,
        heads: list[torch.Tensor] | None = None,
    ) -> None:
        """Take a left-padded prefill's (G * W, L, k) selection."""
        width = mask.shape[1]
        per_row = recorded.view(mask.shape[0], width, *recorded.shape[1:])
        self.prompts = [per_row[g, width - int(m.sum()) :] for g, m in enumerate(mask.cpu())]
        self.share, self.heads = share, heads

    def prefix_rows(self, rows: int) -> list[torch.Tensor]:
        """Each row's routes over its whole prompt (what its kept cache holds)."""
        return [self._prefix(r) for r in range(rows)]

    def _prefix(self, r: int) -> torch.Tensor:
        mine = self.prompts[r // self.share].to(torch.uint8)
        return mine if self.heads is None else torch.cat([self.heads[r], mine])

    def rows(self, tokens: list[list[int]]) -> list[torch.Tensor]:
        """Row r's (P + R - 1, L, k) uint8 routes: its prompt's (a group's shared by its n
        samples), then its response's tokens but the last (never fed)."""
        out = []
        for r, toks in enumerate(tokens):
            # A row's token t was fed at forward t, while the row still ran (in the batch).
            fed = [
                self.decoded[t][int(self.decoded_at[t][r])][None]
                for t in range(max(0, len(toks) - 1))
            ]
            out.append(torch.cat([self._prefix(r), *fed]).to(torch.uint8))
        return out


@dataclass(kw_only=True, slots=True)
class _Session:
    """One call's episodes' kept cache between turns: prefilled positions only."""

    keys: list[Hashable]
    """The rows' episodes, in the call's order."""
    cache: DynamicCache
    mask: torch.Tensor
    """(rows, width) over the cached positions: 1 on tokens, 0 on padding."""
    next_pos: torch.Tensor
    """(rows,): the position the row's next token takes."""
    tokens: list[list[int]]
    """Each row's tokens in the cache (its prompt at the last call)."""
    routes: list[torch.Tensor] | None = None
    """Each row's routes over those tokens (a recording engine's; else None)."""

    def keep(self, rows: list[bool]) -> None:
        """Drop the rows not kept (exact row selection: the kept rows' values are
        unchanged)."""
        if all(rows):
            return
        idx = torch.tensor(
            [r for r, k in enumerate(rows) if k], dtype=torch.long, device=self.mask.device
        )
        self.cache.batch_select_indices(idx)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        self.keys = [k for k, kept in zip(self.keys, rows, strict=True) if kept]
        self.tokens = [t for t, kept in zip(self.tokens, rows, strict=True) if kept]
        if self.routes is not None:
            self.routes = [t for t, kept in zip(self.routes, rows, strict=True) if kept]


def completes_stop(before: str, after: str, stop: Sequence[str]) -> bool:
    """Whether `after` (a response's text, one token longer than `before`) holds a stop
    string that ends in the new token's text: vLLM's rule, which looks for stop strings
    only where they could end in the text a token added."""
    return any(after.find(s, max(0, len(before) - len(s) + 1)) != -1 for s in stop)


def last_token_stops(
    decode: Callable[[list[int]], str], tokens: list[int], stop: Sequence[str]
) -> bool:
    """Whether the last of `tokens` completes a stop string.

    Only a window of the last tokens is decoded, so the check costs the same at any
    length (2.2 ms per step for 32 rows with SmolLM2's tokenizer on one CPU core;
    decoding whole responses grew with their length, 3.4 ms per step on average over
    256 tokens). Decoding a window can garble only its first characters (a UTF-8
    sequence cut in two, SentencePiece's leading space), never its end; a token is at
    least one byte, so the window's exact tail is longer than any stop string plus the
    newest token's own text.
    """
    window = 16 + 4 * max(len(s.encode()) for s in stop)
    start = max(0, len(tokens) - window)
    return completes_stop(decode(tokens[start:-1]), decode(tokens[start:]), stop)


def stop_length(decode: Callable[[list[int]], str], tokens: list[int], stop: Sequence[str]) -> int:
    """Length of `tokens` up to and including the first token that completes a stop string
    (all of them if none does)."""
    for i in range(len(tokens)):
        if last_token_stops(decode, tokens[: i + 1], stop):
            return i + 1
    return len(tokens)


class _StopText:
    """Each running row's tokens so far, to find the token that completes a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], rows: int):
        self.decode = decode
        self.stop = stop
        self.tokens: list[list[int]] = [[] for _ in range(rows)]

    def completed(
        self, rows: list[int], toks: list[int], running: list[bool], check: bool
    ) -> torch.Tensor:
        """Which of the batch's `rows` (the call's indices) complete a stop string with
        their new tokens `toks` (only when `check`: before min_new_tokens no stop string
        counts, as in vLLM)."""
        hits = torch.zeros(len(toks), dtype=torch.bool)
        for i, (r, tok, alive) in enumerate(zip(rows, toks, running, strict=True)):
            if alive:
                self.tokens[r].append(tok)
                hits[i] = check and last_token_stops(self.decode, self.tokens[r], self.stop)
        return hits


def _run_length(
    rows: Sequence[Sequence[int]],
    vision: Vision = None,
    routes: Sequence[torch.Tensor | None] | None = None,
) -> int:
    """n if `rows` are runs of n equal rows one after another (n > 1), else 1; with
    `vision`, a run's rows also hold the same images, and with `routes` the same routes."""
    for n in range(len(rows), 1, -1):
        if len(rows) % n == 0 and all(
            list(rows[i]) == list(rows[i - i % n])
            and (vision is None or _same_images(vision[i], vision[i - i % n]))
            and (routes is None or _same_routes(routes[i], routes[i - i % n]))
            for i in range(len(rows))
        ):
            return n
    return 1


def _same_routes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b)


def _chunk_slots(cmask: torch.Tensor, held: Sequence[int]) -> moe.Slots:
    """The `Slots` of a kept-cache chunk: slot (r, j) holds token `held[r]` + j - (its
    left padding) of row r's sequence, -1 on padding."""
    real = cmask.bool().cpu()
    pos = real.long().cumsum(-1) - 1 + torch.tensor(list(held))[:, None]
    rows = torch.arange(real.shape[0])[:, None].expand_as(real)
    return moe.Slots(rows=torch.where(real, rows, -1).reshape(-1), pos=pos.clamp(min=0).reshape(-1))


def _same_images(a: VisionInputs | None, b: VisionInputs | None) -> bool:
    if a is None or b is None or a is b:
        return a is b
    return (
        a.mm_token_type_ids == b.mm_token_type_ids
        and torch.equal(a.image_grid_thw, b.image_grid_thw)
        and torch.equal(a.pixel_values, b.pixel_values)
    )


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (len(prompts), longest), prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _cut_rows(
    out_tok: torch.Tensor, out_lp: torch.Tensor, ends: list[int | None], limits: Sequence[int]
) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
    """Each row's tokens and logprobs up to its end (EOS or stop string: "stop") or its
    limit ("length"), from the (rows, steps) tensors of the decode loop."""
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    reasons: list[FinishReason] = []
    for row, row_lp, end, lim in zip(out_tok.tolist(), out_lp.tolist(), ends, limits, strict=True):
        cut = lim if end is None else end
        tokens.append(row[:cut])
        logprobs.append(row_lp[:cut])
        reasons.append("length" if end is None else "stop")
    return tokens, logprobs, reasons


def _call_draws(seed: int, device: torch.device) -> Draw:
    """The call's rows in the batch draw, in row order, from one generator seeded `seed`."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(rows: list[int]) -> torch.Tensor:
        return torch.rand(len(rows), 1, generator=gen, dtype=torch.float64, device=device)

    return draw


def _row_draws(seeds: Sequence[int], device: torch.device) -> Draw:
    """Each call row draws from its own generator seeded `seeds[r]`: a row's k-th draw is
    its k-th token's, whichever rows share the batch."""
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def draw(rows: list[int]) -> torch.Tensor:
        return torch.cat(
            [torch.rand(1, 1, generator=gens[r], dtype=torch.float64, device=device) for r in rows]
        )

    return draw


def _sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse-CDF sampling from `u`, one uniform draw per row (rows, 1).

    `torch.multinomial` on CPU draws an exponential per vocabulary entry (rows x 49k per
    token), about a seventh of the whole decode loop on the benchmark batch. The cumulative
    sum is in float64 so the tail of a 49k-entry vocabulary keeps its mass.
    """
    cdf = probs.double().cumsum(dim=-1)
    # The first index whose cumulative mass exceeds u * total: never a zero-probability
    # (filtered) token, because the cdf does not rise there.
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return tok.clamp_(max=probs.shape[-1] - 1)


def load_weights_dir(model: torch.nn.Module, path: Path) -> None:
    """`model`'s weights from `path`/model.safetensors, as `rftpipe.stages.sync.write_weights`
    wrote them (a tied lm_head, when written, loads into the embedding's storage; when
    absent, through the name kept for it). The rollout ranks' read of a hand-over
    (`rftpipe.run.handoff`), and what `python -m tools.bench handoff` times."""
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors", device=str(next(model.parameters()).device))
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    kept = {own[k].untyped_storage().data_ptr() for k in state if k in own}
    untied = [k for k in result.missing_keys if own[k].untyped_storage().data_ptr() not in kept]
    if untied or result.unexpected_keys:
        raise ValueError(
            f"{path}: weights that do not fit the rollout model (missing {untied[:3]}, "
            f"unexpected {result.unexpected_keys[:3]})"
        )
