"""A thin view of torch.distributed that also works with a single process.

Every decision that ranks must agree on goes through these collectives, so a rank never
takes a branch the others do not (which would deadlock the next collective).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from rftpipe.atomic import atomic_write_bytes


@dataclass(frozen=True, slots=True)
class Dist:
    """Rank and world of this process; collectives are no-ops when world == 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None
    """The process group of the collectives (None: the default one); another keeps a
    second stream of collectives in order beside it (`rollout.overlap`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """This rank's compute device: ``cuda:<local_rank>`` where CUDA is available (the
        device `init_from_env` binds NCCL to), else the CPU.

        Every model a rank runs (actor, reference, rollout copy) computes here; engines that
        place their own parameters (FSDP2, DeepSpeed) still feed their inputs here. The
        local rank is taken modulo the visible devices: a task bound to a GPU of its own
        sees it as device 0.
        """
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier(group=self.group)

    def _all_reduce(self, t: torch.Tensor, op: tdist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.world == 1:
            return t.clone()
        # NCCL reduces only device tensors; callers keep their small CPU tensors.
        nccl = tdist.get_backend() == "nccl"
        out = t.to(f"cuda:{torch.cuda.current_device()}") if nccl else t.clone()
        tdist.all_reduce(out, op=op, group=self.group)
        return out.to(t.device) if nccl else out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks (returns a new tensor; float64 sums are order-stable per world)."""
        return self._all_reduce(t, tdist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, tdist.ReduceOp.MAX)

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on at least one."""
        if self.world == 1:
            return flag
        return bool(self.all_reduce_sum(torch.tensor([float(flag)])).item() > 0)

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[object] = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.group)
        return out


def init_from_env(require_group: bool = False) -> Dist:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR (gloo on CPU).

    One rank needs no group unless a sharded backend asks for one (`require_group`).
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(slurm_env(os.environ))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not require_group:
        return Dist()
    dist = Dist(
        rank=int(os.environ.get("RANK", "0")),
        world=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(dist.device)
        tdist.init_process_group(
            backend=backend, store=_store(dist), rank=dist.rank, world_size=world
        )
    return dist


def _store(dist: Dist) -> tdist.Store | None:
    """The rendezvous store; None: torch's env:// (MASTER_ADDR and MASTER_PORT).

    One rank needs no port at all. Ranks launched on this machine by `jobs.submit` (or the
    tests' launcher) are handed RFTPIPE_RENDEZVOUS, a file path in a directory made for the
    launch: rank 0 binds its store to a port the OS picks and publishes the port there.
    A port chosen by the launcher and bound seconds later by rank 0 (after the imports)
    could be taken in between by any other process on the machine, e.g. a second run."""
    if dist.world == 1:
        # Libraries that check for a launcher's variables (DeepSpeed) find them; none is
        # used for a group of one.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "0")
        return tdist.HashStore()
    path = os.environ.get("RFTPIPE_RENDEZVOUS")
    if not path:
        return None
    timeout = timedelta(seconds=_RENDEZVOUS_TIMEOUT_S)
    if dist.rank == 0:
        store = tdist.TCPStore(
            "127.0.0.1", 0, dist.world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        # The others never read a half-written port.
        atomic_write_bytes(Path(path), str(store.port).encode())
        os.environ["MASTER_PORT"] = str(store.port)
        return store
    deadline = time.monotonic() + _RENDEZVOUS_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {dist.rank}: rank 0 published no port in {path}")
        time.sleep(0.05)
    with open(path) as f:
        port = int(f.read())
    os.environ["MASTER_PORT"] = str(port)
    return tdist.TCPStore("127.0.0.1", port, dist.world, is_master=False, timeout=timeout)


# As long as torch's default for a process group's store (30 minutes): rank 0 may take
# long to import on a loaded machine, and the others wait for it.
_RENDEZVOUS_TIMEOUT_S = 1800


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables from an srun task's Slurm environment.

    The master is the allocation's first node (its `NodeAddr`, which may differ from the
    node name), and the port derives from the job id, so both are stable across requeues.
    """
    job = int(env.get("SLURM_ARRAY_JOB_ID", env["SLURM_JOB_ID"]))
    first = _first_node(env["SLURM_JOB_NODELIST"])
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        # SLURM_TASKS_PER_NODE reads like "2(x3)" or "2,1"; this node's count comes first.
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE")
        or env.get("SLURM_TASKS_PER_NODE", "1").split("(")[0].split(",")[0],
        "MASTER_ADDR": _node_addr(first),
        "MASTER_PORT": str(20000 + job % 20000 + int(env.get("SLURM_ARRAY_TASK_ID", "0"))),
    }


def _first_node(nodelist: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.split()[0]


def _node_addr(node: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "node", "-o", node],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    for token in out.stdout.split():
        if token.startswith("NodeAddr="):
            return token.split("=", 1)[1]
    return node
