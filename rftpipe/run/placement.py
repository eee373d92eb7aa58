"""Which ranks do what (`launch.rollout_ranks` / `launch.rollout_nodes`).

Colocated (the default), every rank runs every stage. Disaggregated, the job's last ranks
form the rollout role, which runs only the generation stages (rollout, score), and the
others the training role (advantage, train, sync, eval). Each role's collectives run on a
process group of its own, so the two roles never meet in a collective: they meet only in
the run directory, through committed stages (the trainers wait for a step's generation)
and the weights the trainers publish under RUN/sync (the rollout ranks wait for a version:
`rftpipe.stages.handoff`). Each role agrees on a stop among its own ranks, at its own
stage boundaries and while it waits.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as tdist

from rftpipe.config.schema import RunConfig
from rftpipe.dist import Dist

Role = Literal["both", "train", "rollout"]


@dataclass(frozen=True, slots=True)
class Placement:
    role: Role
    """This rank's role: both (colocated), train or rollout."""
    dist: Dist
    """This rank within its role's ranks (the whole job when colocated)."""
    job: Dist
    """This rank within the whole job: the one that requeues it, the final barrier."""
    checkpoint_group: Any = None
    """A second group of the training ranks for the checkpoint writer's background
    collectives (None: the writer makes its own over the whole job)."""

    @property
    def disaggregated(self) -> bool:
        return self.role != "both"


def place(cfg: RunConfig, job: Dist) -> Placement:
    """This rank's placement. Every rank calls this, in the same order: it creates the
    roles' process groups (a collective of the whole job)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", job.world))
    rollout = cfg.launch.rollout_rank_count(job.world, per_node)
    if not rollout:
        return Placement("both", job, job)
    trainers = list(range(job.world - rollout))
    generators = list(range(job.world - rollout, job.world))
    groups = {
        "train": tdist.new_group(trainers),
        "rollout": tdist.new_group(generators),
        "checkpoint": tdist.new_group(trainers, backend="gloo"),
    }
    role: Role = "train" if job.rank < len(trainers) else "rollout"
    members = trainers if role == "train" else generators
    dist = dataclasses.replace(
        job, rank=members.index(job.rank), world=len(members), group=groups[role]
    )
    return Placement(role, dist, job, groups["checkpoint"] if role == "train" else None)
