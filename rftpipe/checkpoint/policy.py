"""When to checkpoint: the Young/Daly interval, its expected costs, and a run's preemption rate.

Pure and torch-free (standard library only), so it can be tested and used on a login node.

Cost model. A checkpoint adds ``C`` seconds to the step it overlaps (the write itself runs
in the background; ``C`` is what the step loses to it). With a checkpoint every ``k`` steps
of ``s`` seconds, checkpoints take the share ``C / (k s)`` of step time. A preemption loses
the train updates committed since the last checkpoint: a resume replays them, running only
the train stage (``t`` seconds, about 40 % of a step) from committed inputs, so it costs on
average ``k / 2`` replayed train steps, ``k t / 2`` seconds. With preemptions every ``M``
seconds of run time on average, replay takes the share ``k t / (2 M)``. Young's and Daly's
intervals balance the two; :func:`young_daly_interval` gives them in steps.

Only *when* checkpoints happen depends on measured times. Results do not: a replayed train
step is bitwise identical to the original, so a run's committed rows are the same whatever
this policy decides.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CheckpointController",
    "FixedSchedule",
    "YoungDalySchedule",
    "make_schedule",
    "IntervalCosts",
    "RunHistory",
    "daly_period_s",
    "interval_costs",
    "pooled_mtbf_s",
    "read_history",
    "young_daly_interval",
    "young_period_s",
]

HOUR_S = 3600.0


# ------------------------------------------------------------------------ the interval


def young_period_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal compute time between checkpoints: ``sqrt(2 C M)``.

    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9):530-531, 1974.
    """
    _check_cost(ckpt_cost_s)
    _check_positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


def daly_period_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints.

    ``sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + (C / (2 M)) / 9) - C`` for ``C < 2 M``, and
    ``M`` otherwise (a checkpoint costing two MTBFs or more: checkpoint once per MTBF).
    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
    dumps", Future Generation Computer Systems 22(3):303-312, 2006. For ``C << M``
    it tends to Young's ``sqrt(2 C M)`` minus ``C``: at C = 2.3 s and M = 1 h Daly's period is
    1.2 % shorter (127.2 s against 128.7 s).
    """
    _check_cost(ckpt_cost_s)
    _check_positive("mtbf_s", mtbf_s)
    c, m = ckpt_cost_s, mtbf_s
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def young_daly_interval(
    ckpt_cost_s: float,
    step_s: float,
    mtbf_s: float,
    *,
    replay_step_s: float | None = None,
    order: Literal["daly", "young"] = "daly",
    min_interval: int = 1,
    max_interval: int | None = None,
) -> int:
    """The optimal checkpoint interval in steps, clamped to ``[min_interval, max_interval]``.

    Args:
        ckpt_cost_s: ``C``, seconds a checkpoint adds to the step it overlaps (>= 0).
        step_s: ``s``, seconds of a step without a checkpoint (> 0).
        mtbf_s: ``M``, mean run time between preemptions in seconds (> 0).
        replay_step_s: ``t``, seconds to redo one lost step (> 0). ``None`` is the classic
            model of Young and Daly, where lost work is redone at full cost (``t = s``).
            rftpipe replays only the train stage, so pass the train-stage seconds: lost
            work then costs ``t / s`` of what it took, exactly as if preemptions came
            ``s / t`` times less often, so the formula runs with ``M' = M s / t``. The
            first-order (Young) optimum is exact under this substitution; Daly's
            correction terms are applied to ``M'`` as an approximation (together they change
            the result by about 1 % at these figures, C of 2 s and M of an hour).
        order: ``"daly"`` (default, :func:`daly_period_s`) or ``"young"``
            (:func:`young_period_s`).
        min_interval: Lower bound in steps (>= 1).
        max_interval: Upper bound in steps (``None``: unbounded).

    Returns:
        The period in seconds divided by ``step_s``, rounded to the nearest step (halves
        up); the cost curve is flat near its minimum, so rounding costs little.
    """
    _check_positive("step_s", step_s)
    if min_interval < 1:
        raise ValueError(f"min_interval must be >= 1, got {min_interval}")
    if max_interval is not None and max_interval < min_interval:
        raise ValueError(f"max_interval must be >= min_interval={min_interval}, got {max_interval}")
    m = _effective_mtbf(mtbf_s, step_s, replay_step_s)
    if order == "daly":
        period = daly_period_s(ckpt_cost_s, m)
    elif order == "young":
        period = young_period_s(ckpt_cost_s, m)
    else:
        raise ValueError(f"order must be 'daly' or 'young', got {order!r}")
    steps = math.floor(period / step_s + 0.5)
    steps = max(steps, min_interval)
    if max_interval is not None:
        steps = min(steps, max_interval)
    return steps


def _effective_mtbf(mtbf_s: float, step_s: float, replay_step_s: float | None) -> float:
    _check_positive("mtbf_s", mtbf_s)
    if replay_step_s is None:
        return mtbf_s
    _check_positive("replay_step_s", replay_step_s)
    return mtbf_s * step_s / replay_step_s


# -------------------------------------------------------------------- expected costs


@dataclass(frozen=True, slots=True)
class IntervalCosts:
    """Expected costs of checkpointing every ``interval`` steps (shares are fractions)."""

    interval: int
    """Steps between checkpoints."""
    checkpoint_share: float
    """Checkpoint seconds amortised over the interval, as a share of step time: C / (k s)."""
    commit_share: float
    """Per-step commit seconds as a share of step time (0 when not given)."""
    replay_s: float
    """Expected replay per preemption in seconds: k / 2 train steps of t seconds."""
    replay_share: float
    """Expected replay per second of run time: replay_s / M."""

    @property
    def durability_share(self) -> float:
        """What durability costs a run without preemptions: commits plus checkpoints."""
        return self.commit_share + self.checkpoint_share

    @property
    def total_share(self) -> float:
        """Durability share plus the expected replay share."""
        return self.durability_share + self.replay_share


def interval_costs(
    interval: int,
    *,
    ckpt_cost_s: float,
    step_s: float,
    replay_step_s: float,
    mtbf_s: float,
    commit_s: float = 0.0,
) -> IntervalCosts:
    """The expected costs of ``interval`` (see :class:`IntervalCosts`).

    The replay estimate is the continuous model's ``k / 2`` train steps per preemption,
    the one Young's interval minimises. With preemptions uniform in time and steps of
    equal length the committed steps since the last checkpoint average ``(k - 1) / 2``, so
    this overstates replay by half a train step; the stage in flight at the preemption is
    lost as well, whatever the interval.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    _check_cost(ckpt_cost_s)
    _check_positive("step_s", step_s)
    _check_positive("replay_step_s", replay_step_s)
    _check_positive("mtbf_s", mtbf_s)
    if not (math.isfinite(commit_s) and commit_s >= 0):
        raise ValueError(f"commit_s must be a finite number >= 0, got {commit_s}")
    replay_s = interval / 2.0 * replay_step_s
    return IntervalCosts(
        interval=interval,
        checkpoint_share=ckpt_cost_s / (interval * step_s),
        commit_share=commit_s / step_s,
        replay_s=replay_s,
        replay_share=replay_s / mtbf_s,
    )


# ------------------------------------------------------------------ preemption rate


@dataclass(frozen=True, slots=True)
class RunHistory:
    """What a run's event log says about its interruptions."""

    sessions: int
    """Process starts (``start`` events)."""
    interruptions: int
    """Sessions that ended before the run finished, other than by refusing their input."""
    run_s: float
    """Run time observed: the sum over sessions of (last event - start), queue time excluded."""


def read_history(events_path: Path) -> RunHistory:
    """Count a run's interruptions and run time from ``RUN/events.jsonl``.

    The log is cut into sessions at each ``start`` event (rank 0 writes one per process
    start, in ``resume.prepare``); events before the first start are ignored. A session
    counts as interrupted when

    - it logged ``stop`` (a stop signal: preemption, time limit, ``scancel``) or ``fault``
      (a test's self-kill); or
    - another session follows it and it neither logged ``user_error`` (the process refused
      its input and exited) nor ended complete. It ended complete when its newest
      ``checkpoint`` event is at or past every step it worked on (``commit``,
      ``stage_begin``, ``replay``): the last step of a run always checkpoints, and any
      later step would show up as work. A session that did no step at all ended complete
      only if the one before it did and was not interrupted (a finished run started
      again); otherwise it died while loading. A hard kill (node failure, OOM, SIGKILL) logs nothing, so it is recognised
      only by the next start.

    The newest session is interrupted only if it logged ``stop`` or ``fault``: whether it
    is still running, finished, or was killed is unknown until the next start. Its run
    time still counts (right-censored exposure).

    A session's run time runs from its ``start`` to its last event of any kind; the model
    load before ``start`` and the seconds between the last event and a hard kill are not
    seen. Lines that are not JSON objects with a numeric ``t`` and a string ``event`` (a
    line torn by a kill) are skipped. A missing file is an empty history.
    """
    sessions: list[list[dict[str, Any]]] = []
    try:
        text = events_path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return RunHistory(sessions=0, interruptions=0, run_s=0.0)
    for line in text.splitlines():
        rec = _parse_event(line)
        if rec is None:
            continue
        if rec["event"] == "start":
            sessions.append([rec])
        elif sessions:
            sessions[-1].append(rec)
    interruptions = 0
    run_s = 0.0
    prev_complete = False
    for i, session in enumerate(sessions):
        run_s += max(0.0, max(r["t"] for r in session) - session[0]["t"])
        names = {r["event"] for r in session}
        work = _max_step(session, ("commit", "stage_begin", "replay"))
        ckpt = _max_step(session, ("checkpoint",))
        # A session that did no step ended complete only if the run already was.
        complete = prev_complete if work is None else (ckpt is not None and ckpt >= work)
        last = i == len(sessions) - 1
        cut = bool(names & {"stop", "fault"}) or not (last or "user_error" in names or complete)
        interruptions += cut
        prev_complete = complete and not cut
    return RunHistory(sessions=len(sessions), interruptions=interruptions, run_s=run_s)


def _parse_event(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    t, event = rec.get("t"), rec.get("event")
    if not isinstance(event, str) or isinstance(t, bool) or not isinstance(t, int | float):
        return None
    if not math.isfinite(t):
        return None
    return rec


def _max_step(session: list[dict[str, Any]], names: tuple[str, ...]) -> int | None:
    steps = [
        r["step"]
        for r in session
        if r["event"] in names
        and isinstance(r.get("step"), int)
        and not isinstance(r["step"], bool)
    ]
    return max(steps) if steps else None


def pooled_mtbf_s(history: RunHistory, prior_mtbf_s: float, prior_weight: float = 1.0) -> float:
    """MTBF pooled from a prior and the run's history: ``(w P + T) / (w + n)``.

    ``P`` is the prior MTBF, ``w`` its weight in pseudo-interruptions, ``T`` the observed
    run time and ``n`` the observed interruptions. This is the reciprocal of the posterior
    mean rate when preemptions are a Poisson process with rate ``r``, the prior on ``r`` is
    Gamma(shape ``w``, rate ``w P``) (mean ``1 / P``: as if ``w`` interruptions had been
    seen in ``w P`` hours) and the history is ``n`` events in exposure ``T``: the posterior
    is Gamma(``w + n``, ``w P + T``). The *rate* is what is averaged because the expected
    replay per hour is linear in it (and the Young/Daly interval depends on it alone). With
    little history (``T << w P``, ``n`` small) the result stays near ``P``; with much, it
    tends to ``T / n``. A run that has not been interrupted raises its estimate as it goes:
    ``P + T`` with ``w = 1``.
    """
    _check_positive("prior_mtbf_s", prior_mtbf_s)
    _check_positive("prior_weight", prior_weight)
    return (prior_weight * prior_mtbf_s + history.run_s) / (prior_weight + history.interruptions)


# ------------------------------------------------------------------------ controller


class CheckpointController:
    """Decides after which steps to checkpoint, from measured step and checkpoint seconds.

    Fed the seconds of each step (:meth:`observe_step`: the step's wall seconds and its
    train stage's) and of each checkpoint (:meth:`observe_checkpoint`: the seconds it added
    to the step it overlapped, e.g. that step minus :attr:`step_s`), it keeps the running
    *median* of the last ``step_window`` step and train figures and of the last
    ``ckpt_window`` checkpoint costs. Medians rather than EMAs because the measurements
    have one-sided outliers an EMA would carry for many steps: the first step of a process
    (warm-up: 7.6 s against 5.3 s in the TRL benchmark), the step a checkpoint overlaps
    (+C, if the caller feeds it), an evaluation or a stall. A median over a window ignores
    them while they are fewer than half of it, follows a real change (a requeue onto a
    slower node) within half a window, and is exactly reproducible from the window.

    :meth:`interval` is :func:`young_daly_interval` of those medians (replay-aware: lost
    work is redone at the train stage's cost), clamped to ``[min_interval, max_interval]``;
    until a step and a checkpoint cost have been measured it is ``initial_interval``
    (clamped too). :meth:`due` answers whether to checkpoint after ``step``: when at least
    :meth:`interval` steps have passed since the last checkpoint (:meth:`mark_checkpoint`;
    step 0, the initial weights, before the first). So consecutive checkpoints are never
    fewer than ``min_interval`` steps apart, and never more than ``max_interval`` as long as
    the caller asks after every step. The run's last step is the caller's business.

    Every decision is a function of the inputs alone (no clock is read). The MTBF is an
    input, not state: recompute it at each process start from the run's history
    (:func:`read_history`, :func:`pooled_mtbf_s`) and set :attr:`mtbf_s`. The state
    (:meth:`state_dict`) is plain floats and lists of floats, no torch. Replayed steps after
    a resume run only the train stage: do not feed them as step measurements.
    """

    def __init__(
        self,
        *,
        mtbf_s: float,
        initial_interval: int,
        min_interval: int = 1,
        max_interval: int | None = None,
        step_window: int = 15,
        ckpt_window: int = 5,
        order: Literal["daly", "young"] = "daly",
    ) -> None:
        _check_positive("mtbf_s", mtbf_s)
        if min_interval < 1:
            raise ValueError(f"min_interval must be >= 1, got {min_interval}")
        if max_interval is not None and max_interval < min_interval:
            raise ValueError(
                f"max_interval must be >= min_interval={min_interval}, got {max_interval}"
            )
        if initial_interval < 1:
            raise ValueError(f"initial_interval must be >= 1, got {initial_interval}")
        if step_window < 1 or ckpt_window < 1:
            raise ValueError("step_window and ckpt_window must be >= 1")
        self.mtbf_s = float(mtbf_s)
        self.initial_interval = initial_interval
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.step_window = step_window
        self.ckpt_window = ckpt_window
        self.order = order
        self._step_s: list[float] = []
        self._train_s: list[float] = []
        self._ckpt_s: list[float] = []
        self._last_checkpoint = 0

    # -- measurements

    def observe_step(self, step_s: float, train_s: float | None = None) -> None:
        """One step's wall seconds and (if known) its train stage's seconds.

        Non-finite or non-positive figures are ignored: a timing glitch must not stop a run.
        """
        if _usable(step_s) and step_s > 0:
            _push(self._step_s, float(step_s), self.step_window)
        if train_s is not None and _usable(train_s) and train_s > 0:
            _push(self._train_s, float(train_s), self.step_window)

    def observe_checkpoint(self, cost_s: float) -> None:
        """Seconds one checkpoint added to its step; a negative difference (noise) counts as 0."""
        if _usable(cost_s):
            _push(self._ckpt_s, max(0.0, float(cost_s)), self.ckpt_window)

    def mark_checkpoint(self, step: int) -> None:
        """A checkpoint was taken after ``step`` (call before capturing :meth:`state_dict`)."""
        self._last_checkpoint = max(self._last_checkpoint, int(step))

    # -- estimates and decisions

    @property
    def step_s(self) -> float | None:
        """Median step seconds over the window (None before the first)."""
        return statistics.median(self._step_s) if self._step_s else None

    @property
    def train_s(self) -> float | None:
        """Median train-stage seconds over the window (None before the first)."""
        return statistics.median(self._train_s) if self._train_s else None

    @property
    def ckpt_cost_s(self) -> float | None:
        """Median checkpoint cost over the window (None before the first)."""
        return statistics.median(self._ckpt_s) if self._ckpt_s else None

    @property
    def last_checkpoint(self) -> int:
        """Step of the last checkpoint marked (0: none yet)."""
        return self._last_checkpoint

    def interval(self) -> int:
        """Steps between checkpoints that the current measurements call for."""
        step_s, cost_s = self.step_s, self.ckpt_cost_s
        if step_s is None or cost_s is None:
            return self._clamp(self.initial_interval)
        return young_daly_interval(
            cost_s,
            step_s,
            self.mtbf_s,
            replay_step_s=self.train_s,
            order=self.order,
            min_interval=self.min_interval,
            max_interval=self.max_interval,
        )

    def due(self, step: int) -> bool:
        """Whether a checkpoint should be written after ``step``; changes no state."""
        return step - self._last_checkpoint >= self.interval()

    def costs(self) -> IntervalCosts | None:
        """Expected costs of the current interval (None until step and cost are measured)."""
        step_s, cost_s = self.step_s, self.ckpt_cost_s
        if step_s is None or cost_s is None:
            return None
        return interval_costs(
            self.interval(),
            ckpt_cost_s=cost_s,
            step_s=step_s,
            replay_step_s=self.train_s or step_s,
            mtbf_s=self.mtbf_s,
        )

    def _clamp(self, steps: int) -> int:
        steps = max(steps, self.min_interval)
        return steps if self.max_interval is None else min(steps, self.max_interval)

    # -- state

    def state_dict(self) -> dict[str, Any]:
        """Measurement windows and the last checkpoint step, as plain floats."""
        return {
            "step_s": list(self._step_s),
            "train_s": list(self._train_s),
            "ckpt_cost_s": list(self._ckpt_s),
            "last_checkpoint": float(self._last_checkpoint),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; windows longer than this controller's keep their tail."""
        self._step_s = [float(x) for x in state["step_s"]][-self.step_window :]
        self._train_s = [float(x) for x in state["train_s"]][-self.step_window :]
        self._ckpt_s = [float(x) for x in state["ckpt_cost_s"]][-self.ckpt_window :]
        self._last_checkpoint = int(state["last_checkpoint"])


# ------------------------------------------------------------------------ schedules


class FixedSchedule:
    """Checkpoint after every multiple of `interval` (policy ``fixed``)."""

    def __init__(self, interval: int) -> None:
        self.interval_steps = interval

    def record(self, step: int, step_s: float, train_s: float) -> None:
        """Nothing to learn from measurements."""

    def due(self, step: int) -> bool:
        return step % self.interval_steps == 0

    def interval(self) -> int:
        return self.interval_steps

    def mark_checkpoint(self, step: int) -> None:
        """Nothing to remember: the decision is a function of the step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateless."""


class YoungDalySchedule(CheckpointController):
    """:class:`CheckpointController` fed one record per newly computed step (policy
    ``young_daly``): the step right after a checkpoint measures that checkpoint's cost (its
    seconds minus the median step), every other step measures a plain step."""

    def record(self, step: int, step_s: float, train_s: float) -> None:
        if self.last_checkpoint and step == self.last_checkpoint + 1:
            if self.step_s is not None:
                self.observe_checkpoint(step_s - self.step_s)
            return
        self.observe_step(step_s, train_s)


def make_schedule(cfg: Any, events_path: Path) -> FixedSchedule | YoungDalySchedule:
    """The configured schedule (`cfg`: a `CheckpointConfig`); the MTBF is the prior pooled
    with this run's own interruptions so far."""
    if cfg.policy == "fixed":
        return FixedSchedule(cfg.interval)
    mtbf = pooled_mtbf_s(read_history(events_path), cfg.mtbf_hours * HOUR_S)
    return YoungDalySchedule(
        mtbf_s=mtbf,
        initial_interval=cfg.interval,
        min_interval=cfg.min_interval,
        max_interval=cfg.max_interval,
    )


# ------------------------------------------------------------------------- helpers


def _push(window: list[float], value: float, size: int) -> None:
    window.append(value)
    del window[:-size]


def _usable(x: float) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_positive(name: str, x: float) -> None:
    if not (_usable(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x}")


def _check_cost(x: float) -> None:
    if not (_usable(x) and x >= 0):
        raise ValueError(f"ckpt_cost_s must be a finite number >= 0, got {x}")
