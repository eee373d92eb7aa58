"""Bounded staleness by schedule (`rollout.staleness`, k): which weights sample each step's
rollouts, and in which step they are generated.

The rollout of step s samples from the weights after train step s-1-k (the initial weights
while that is below 1). Step s starts with the weights of train step s-1, so besides its own
generation (committed in an earlier step when k >= 1) it generates that of step s+k, before
its advantage stage; step 1 generates steps 1..1+k, all from the initial weights. Nothing
here depends on timing, so a run is a function of its config at any k, and a resume redoes
only what did not commit. k = 0 is the synchronous run: each step generates its own.
Torch-free, like everything the run-directory tools read.
"""

from __future__ import annotations


def weights_of(step: int, staleness: int) -> int:
    """The train step whose weights sample step `step`'s rollouts (0: the initial ones)."""
    return max(0, step - 1 - staleness)


def generated_in(step: int, staleness: int, total_steps: int) -> range:
    """The steps after `step` whose generation step `step` runs, in order: those that
    sample from the weights `step` starts with. Steps past `total_steps` are not generated
    (a run extended later samples its first k new steps from fresher weights, which their
    `weight_version` shows)."""
    first = step + 1 if step == 1 else step + max(1, staleness)
    return range(first, min(step + staleness, total_steps) + 1)
