"""The five stages of a step (and the held-out evaluation), one module each with one public `run`.

`ORDER` is the pipeline's order of stage names; the last one marks a step complete. It lives
here, free of torch, so that launch tools (``jobs.status``) and the run-directory tools can
read progress without importing the stages themselves.
"""

from typing import Literal

StageName = Literal["rollout", "score", "advantage", "train", "sync", "eval"]
ORDER: tuple[StageName, ...] = ("rollout", "score", "advantage", "train", "sync")
FINAL: StageName = ORDER[-1]
# `eval` follows sync on the steps `eval.due` names; it is not part of a step's chain (a
# step is complete at sync), so a restart that finds it missing runs it on its own.
