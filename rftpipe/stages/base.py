"""What every stage works with: the run's parts (`Runtime`), a step's plan, and the
contract of a durable stage (`Stage`) that the executor (`rftpipe.run.executor`) runs.

`Runtime` is a plain record of already-constructed parts (no behaviour of its own), built
once per process by `rftpipe.run.runtime.build`, so each stage receives exactly the pieces
it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from rftpipe.checkpoint import writer
from rftpipe.checkpoint.policy import FixedSchedule, YoungDalySchedule
from rftpipe.config.schema import RunConfig
from rftpipe.data.prompts import PromptSet
from rftpipe.data.ptx import PTXExample
from rftpipe.dist import Dist
from rftpipe.engines.moe import ReplayMode
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.critic import Critic
from rftpipe.engines.vision import VisionEncoder
from rftpipe.rewards.types import RewardComponent
from rftpipe.storage.layout import RunDir
from rftpipe.storage.routes import RouteShape
from rftpipe.storage.stage_store import StageStore


class StopCheck(Protocol):
    """The stop flag a stage boundary checks (`rftpipe.run.preemption`)."""

    def check(self, dist: Dist, where: str) -> None:
        """Raise on every rank if any rank was asked to stop."""
        ...


@dataclass(kw_only=True, slots=True)
class Runtime:
    cfg: RunConfig
    run: RunDir
    store: StageStore
    """Commits and reads of the run's stages."""
    dist: Dist
    tokenizer: Any
    prompts: PromptSet
    """The training prompts."""
    held_out: PromptSet | None
    """The held-out problems of `eval` (None: no evaluation); disjoint from `prompts`."""
    rewards: dict[str, RewardComponent]
    """Column name -> reward function (`reward.functions`), ready to score rows."""
    trainer: TrainEngine | None
    """The actor; None on the ranks that only generate (`launch.rollout_ranks`)."""
    reference: TrainEngine | None
    """The KL term's frozen reference (`model.reference`, else the initial policy), on the
    actor's backend; None without a KL term."""
    rollout_engine: RolloutEngine
    kl_ctrl: Any
    model_dir: Path
    stop: StopCheck
    """Checked collectively at every stage boundary (signals under Slurm)."""
    ckpt_writer: writer.Writer
    """Background checkpoint writes, overlapped with the next step's rollout."""
    ckpt_schedule: FixedSchedule | YoungDalySchedule
    """When to checkpoint (`checkpoint.policy`); saved with each checkpoint."""
    critic: Critic | None = None
    """The value model (`critic`), on the actor's backend; None without one."""
    ptx: tuple[PTXExample, ...] = ()
    """The supervised examples of `train.ptx` (empty with it off)."""
    vision: VisionEncoder | None = None
    """The policy's image encoding (a vision-language model); None for a text model."""
    replay: ReplayMode = "none"
    """`train.router_replay` resolved for the policy (`moe.replay_mode`)."""
    route_shape: RouteShape | None = None
    """An MoE policy's route shape (None: a dense policy)."""
    generation_dist: Dist | None = None
    """The collectives of generation running beside training (`rollout.overlap`): the
    ranks on a process group of their own; None: `dist`."""
    replays: list[ReplayCheck] = field(default_factory=list)
    """This process's replayed train steps against their committed metrics, in order."""
    handoff: Callable[[Runtime, int], None] | None = None
    """After a sync, hand the weights of that version to the ranks that only generate
    (`rftpipe.run.handoff.publish`); None: no such ranks."""

    @property
    def train_engine(self) -> TrainEngine:
        """The actor, on the ranks that train."""
        if self.trainer is None:
            raise RuntimeError("a rank of the rollout role holds no actor")
        return self.trainer

    @train_engine.setter
    def train_engine(self, engine: TrainEngine) -> None:
        self.trainer = engine


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayCheck:
    """A replayed train step against the update it committed (`rftpipe.stages.train`)."""

    step: int
    identical: bool
    """Every update metric equal bitwise: same inputs, seeds and platform give this."""
    max_rel_diff: float
    """The largest |replayed - committed| / max(|replayed|, |committed|) over them."""
    platform_changed: dict[str, list[Any]] | None
    """Identity key -> [committed, now] where they differ (`rftpipe.observe.machine`);
    None when the committed step recorded none (written by an older rftpipe)."""


Rows = Callable[[], pa.Table]
"""The newest rows of the step so far (read back and verified on first call if committed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """Which prompts a step uses: the global window and this rank's share of it."""

    step: int
    global_ids: list[int]
    """Prompt ids of the whole step, in the global (world-size independent) order."""
    mine: list[Any]
    """This rank's prompts (`rftpipe.data.prompts.Prompt`), whole groups."""
    sampler: dict[str, int]
    """Consumed-sample counts before and after this step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOutput:
    rows: pa.Table | None
    """This rank's shard of the stage; None for a stage that commits only its manifest."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields for the manifest (e.g. the train metrics, the sampler state)."""


class Stage(Protocol):
    """One durable stage of a step."""

    @property
    def name(self) -> str:
        """Its directory under the step (a `StageName`, or a generation round's `STAGE.rR`)."""
        ...

    @property
    def publish(self) -> bool:
        """Its shards become the step's user-facing dataset (``RUN/trajectories/step=N``)."""
        ...

    @property
    def replay_reads_rows(self) -> bool:
        """Its `replay` reads the step's rows (what a restart must verify before replaying)."""
        ...

    @property
    def engine_awake(self) -> bool:
        """It uses the rollout engine; the engine sleeps through the others, freeing the
        accelerator memory it holds for the trainer's forwards and updates."""
        ...

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        """Compute the stage for the first time."""
        ...

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        """Re-apply what a committed stage did outside the run directory (often nothing)."""
        ...


@dataclass(kw_only=True, slots=True)
class StepState:
    """What flows between the stages of one step."""

    rows: Rows
    timings: dict[str, float]
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each stage's manifest, as committed (or as found committed)."""


def no_rows() -> pa.Table:
    raise RuntimeError("the first stage of a step has no input rows")


@dataclass(frozen=True, slots=True)
class NoSideEffects:
    """A stage whose whole result is its committed rows: a committed one is only read."""

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        return None
