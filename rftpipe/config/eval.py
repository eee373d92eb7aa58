"""The `eval` section: held-out evaluation, a durable stage of its own after a step's sync,
and the steps it follows (`EvalConfig.due`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation, a durable stage of its own (`eval`) after a step's sync."""

    size: int = 0
    """Most held-out problems evaluated (0: no evaluation)."""

    holdout_fraction: float = 0.0
    """Carve the held-out problems out of the training data: a problem (prompt text and
    answer) is held out when a hash of it salted with `seed` falls below this fraction,
    and then it is never trained on. 0: draw them from the data generator under `seed`
    instead (reasoning-gym), dropping any that also occur in the training data."""

    seed: int = 1234
    """Salt of the hold-out hash, or the generator seed of the held-out problems."""

    every: int = 0
    """Evaluate after every `every`-th step, besides before step 1 and after the last
    step (0: only those two)."""

    samples: int = 0
    """Sampled completions per problem (at rollout.temperature and filters) for pass@k,
    besides the greedy one; seeds derive from (run seed, step, "eval", prompt id). With
    `rollout.env` each completion is an episode (greedy: every turn greedy), its turn t
    of sample k seeded from (run seed, step, "eval", prompt id, k, t)."""

    k: tuple[int, ...] = (1,)
    """pass@k reported for each k (unbiased estimator over `samples`; each k <= samples)."""

    problems_per_call: int = 8
    """Problems generated together (greedy and sampled) by an engine that takes a fixed
    number per call (the HF loop; left-padded). Ranks get whole calls of the problems'
    order, so the completions are the same on any world size."""

    metric: str = "accuracy"
    """The reward component (`reward_<metric>` column) that decides whether a completion
    is correct; with `rollout.env`, `env` is the episode's environment return
    (`reward_env`, the sum of its turn rewards)."""

    threshold: float = 1.0
    """A completion is correct when its `metric` component is at least this."""

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.problems_per_call < 1:
            raise ValueError(f"problems_per_call must be >= 1, got {self.problems_per_call}")
        bad = [k for k in self.k if not 1 <= k <= max(self.samples, 1)]
        if self.samples and bad:
            raise ValueError(f"k must be in [1, samples={self.samples}], got {list(self.k)}")

    def due(self, step: int, total_steps: int) -> bool:
        """Whether `step` ends with an evaluation (step 0: the initial weights)."""
        if not self.size:
            return False
        return step in (0, total_steps) or bool(self.every and step % self.every == 0)
