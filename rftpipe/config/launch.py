"""The `launch` section: per-process runtime settings (threads, host memory, requeues, the
device peak behind perf/mfu) and the placement of rollout-only ranks; all may change on a
requeue."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rftpipe.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    threads: int = 0
    """torch intra-op threads per rank (0: all cores divided by ranks on the node)."""

    retain_host_memory: bool = True
    """Keep freed host memory in the process heap for reuse instead of handing it back to
    the OS (glibc: a fixed mmap threshold, no heap trimming): blocks under 16 MiB, and on a
    CPU train device blocks up to the largest parameter's gradient, which recurs at every
    step at exactly its size. Each CPU train step otherwise maps those blocks afresh and
    page-faults them in again: ~330k faults per step for SmolLM2-135M, whose train stage
    took 3.5 s instead of 2.3 s on 2 cores; its 50 and 113 MB blocks alone cost ~140k faults
    and 0.25 s a step. Larger blocks (unchunked logits, which grow with the micro-batch) are
    mapped per use: retained, their varying sizes fragmented the heap, which grew with the
    micro-batches. No effect on other C libraries."""

    max_requeues: int = 20
    """Slurm: how many times the job may requeue itself after a stop signal (time limit,
    preemption); Slurm's own requeues count too (SLURM_RESTART_COUNT)."""

    max_idle_requeues: int = 2
    """Slurm: how many starts of one job may end (time limit, preemption, node failure)
    without committing anything (a stage, an episode's turn, a checkpoint) before the job
    is no longer requeued and ends FAILED, naming the stage that did not finish, how long it
    ran and the job's time limit (`jobs.status`, the `idle_requeues` event). Stops a job
    whose stage outlasts its time limit from requeueing itself `max_requeues` times."""

    peak_tflops: float = 0.0
    """Dense peak TFLOP/s of one rank's device at the train compute dtype: the denominator
    of the train stage's perf/mfu. 0: the GPU's entry in rftpipe/observe/perf.py's table (H100 SXM
    bf16: 989.5); no perf/mfu on the CPU or an unlisted GPU unless set here."""

    rollout_ranks: int = 0
    """Disaggregated placement: the job's last this-many ranks only generate (rollout and
    score stages) and the others only train (advantage, train, sync, eval); the trainers
    hand each version of the weights the rollouts need to them through RUN/sync
    (docs/async.md). 0: every rank does every stage (colocated). May change on a requeue."""

    rollout_nodes: int = 0
    """As `rollout_ranks`, in whole nodes: the last this-many nodes' ranks generate. Set one
    of the two."""

    def __post_init__(self) -> None:
        if self.rollout_ranks < 0 or self.rollout_nodes < 0:
            raise ValueError(
                f"rollout_ranks and rollout_nodes must be >= 0, got {self.rollout_ranks} "
                f"and {self.rollout_nodes}"
            )
        if self.rollout_ranks and self.rollout_nodes:
            raise ValueError(
                f"set rollout_ranks ({self.rollout_ranks}) or rollout_nodes "
                f"({self.rollout_nodes}), not both"
            )
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if not (math.isfinite(self.peak_tflops) and self.peak_tflops >= 0):
            raise ValueError(f"peak_tflops must be a finite number >= 0, got {self.peak_tflops}")
        if self.max_requeues < 0 or self.max_idle_requeues < 0:
            raise ValueError(
                f"max_requeues and max_idle_requeues must be >= 0, got {self.max_requeues} "
                f"and {self.max_idle_requeues}"
            )

    def rollout_rank_count(self, world: int, ranks_per_node: int) -> int:
        """How many of the job's `world` ranks only generate (0: colocated); a count that
        leaves no trainer is refused, naming the field."""
        count = self.rollout_ranks or self.rollout_nodes * ranks_per_node
        if count >= world:
            field = "rollout_ranks" if self.rollout_ranks else "rollout_nodes"
            asked = self.rollout_ranks or self.rollout_nodes
            raise UserError(
                f"launch.{field}={asked} leaves no training rank in a job of {world} ranks "
                f"({ranks_per_node} per node)"
            )
        return count
