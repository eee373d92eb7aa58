"""The `advantage` section: the advantage estimator, an algorithm variant whose settings
class is declared with its registry entry in ``rftpipe.algos.variants``."""

from __future__ import annotations

from dataclasses import dataclass, field

from rftpipe.algos.variants import AdvantageSettings, GRPOSettings
from rftpipe.config.loader import MovedKey


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageConfig:
    estimator: AdvantageSettings = field(
        default_factory=GRPOSettings,
        # Until issue 22 these were settings of the advantage section, read by some estimators.
        metadata={
            "moved": {
                "eps": MovedKey("eps"),
                "gamma": MovedKey("gamma"),
                "lam": MovedKey("lam"),
            }
        },
    )
    """Advantage estimator: its name (`grpo`), or a mapping of its `type` and settings
    (`{type: gae, gamma: 1.0, lam: 0.95}`; see "Variants" below for each one's settings)."""
