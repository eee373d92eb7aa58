"""One place per variant (issue 22): a variant is its function, its registry entry (with its
own settings class) and its reference numbers.

- A policy loss defined entirely in this file (function, entry, settings class) is selected
  by a YAML config with a custom setting and trained through the real train stage.
- Every entry of the five variant registries has a documented frozen settings class, a
  function, a row in docs/algorithms.md naming its keys, and reference numbers.
- The config shape: a name or `{type, ...settings}`, nested overrides, one-line errors, and
  old flat keys (refused from users, migrated in a run's saved config, where the migrated
  config equals its new form for the resume checks).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

# The reference numbers, by registered name (tests/ is on sys.path, as for `helpers`).
from test_algos_reference import (
    ADVANTAGE_CASES,
    CONTROLLER_CASES,
    CORRECTION_CASES,
    KL_CASES,
    LOSS_CASES,
)
from torch import Tensor

from jobs.submit import parse_args, resolve_config
from rftpipe.algos import advantage as _advantage_functions  # noqa: F401 (attaches them)
from rftpipe.algos import correction as _correction_functions  # noqa: F401 (attaches them)
from rftpipe.algos import kl_controller as _controller_functions  # noqa: F401 (attaches them)
from rftpipe.algos import losses as _loss_functions  # noqa: F401 (attaches them)
from rftpipe.algos.losses import PolicyLossOutputs
from rftpipe.algos.registry import Registry
from rftpipe.algos.variants import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdaptiveKLSettings,
    ClipCovSettings,
    FixedKLSettings,
    GAESettings,
    GRPOSettings,
    K2Settings,
    KLCovSettings,
    NoCorrectionSettings,
    OptimalTokenBaselineSettings,
    PolicyLossSettings,
    PPOClipSettings,
    SAPOSettings,
    SeqTISSettings,
    TokenMaskSettings,
)
from rftpipe.config.loader import (
    ConfigError,
    MovedKey,
    diff_keys,
    dump_yaml,
    field_docs,
    fingerprint,
    load_config,
    to_dict,
)
from rftpipe.config.reference import render
from rftpipe.config.schema import (
    RESUME_SAFE_KEYS,
    AdvantageConfig,
    KLConfig,
    RunConfig,
    TrainConfig,
)
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.errors import UserError
from rftpipe.stages import batching, train

ROOT = Path(__file__).resolve().parent.parent
OLD_RUN = ROOT / "tests" / "fixtures" / "run_v2_sapo"

# ---------------------------------------------------------------------------------------------
# A policy loss defined here and nowhere else
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyLossSettings(PolicyLossSettings):
    """A test's own loss: the unclipped surrogate, scaled."""

    scale: float = 1.0
    """Factor on the surrogate -A r."""

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


#: The settings instances the toy loss was called with.
TOY_CALLS: list[ToyLossSettings] = []


def toy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: Any
) -> PolicyLossOutputs:
    TOY_CALLS.append(settings)
    ratio = torch.exp(torch.where(mask, logprobs - old_logprobs, 0.0))
    loss = torch.where(mask, -settings.scale * advantages * ratio, 0.0)
    none = torch.zeros_like(mask)
    return PolicyLossOutputs(loss=loss, clipped=none, dual_clipped=none, ratio=ratio)


@pytest.fixture
def toy() -> Iterator[None]:
    POLICY_LOSSES.register("toy", settings=ToyLossSettings)
    POLICY_LOSSES.implements("toy")(toy_loss)
    TOY_CALLS.clear()
    try:
        yield
    finally:
        POLICY_LOSSES.unregister("toy")


def _inputs(engine: SingleDeviceEngine) -> batching.TrainInputs:
    """2 prompts x 2 responses of the tiny model's vocabulary; behaviour logprobs a little off
    the model's own, advantages of both signs."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (6,), generator=gen).tolist() for _ in range(2)]
    rows = [
        (p, torch.randint(5, 200, (n,), generator=gen).tolist()) for p in prompts for n in (3, 5)
    ]
    own = engine.compute_logprobs([p for p, _ in rows], [r for _, r in rows], 1.0)
    table = pa.table(
        {
            "prompt_id": [i // 2 for i in range(4)],
            "sample_idx": [i % 2 for i in range(4)],
            "prompt_token_ids": [p for p, _ in rows],
            "response_token_ids": [r for _, r in rows],
            "logprobs": pa.array(
                [[x + 0.1 * (-1) ** t for t, x in enumerate(lp)] for lp in own],
                pa.list_(pa.float32()),
            ),
            "advantages": pa.array(
                [[a] * len(r) for a, (_, r) in zip((1.0, -0.5, 0.7, -1.2), rows, strict=True)],
                pa.list_(pa.float32()),
            ),
            "response_length": [len(r) for _, r in rows],
        }
    )
    return batching.TrainInputs(
        step=1,
        run_seed=0,
        table=table,
        global_samples=[(i // 2, i % 2) for i in range(4)],
        kl_coef=0.0,
        temperature=1.0,
        response_budget=8,
    )


def _train_step(cfg: RunConfig) -> tuple[dict[str, float], float]:
    """One real train stage on the tiny model: its metrics and how far the weights moved."""
    model = load_causal_lm(prepare_tiny(), "float32")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = SingleDeviceEngine(model, cfg.train, Dist())
    metrics = train.run(cfg.train, cfg.kl, engine, Dist(), _inputs(engine))
    moved = sum(float((v - initial[k]).abs().sum()) for k, v in model.state_dict().items())
    return metrics, moved


@pytest.mark.kernels
def test_a_policy_loss_defined_in_a_test_trains(toy: None, tmp_path: Path) -> None:
    """Selected from YAML with its own setting, the toy loss gets exactly the settings the
    config built, and the step moves the weights; its setting visibly scales the loss."""
    path = tmp_path / "toy.yaml"
    path.write_text(
        "model:\n  path: builtin:tiny\n"
        "train:\n  lr: 1.0e-3\n  micro_batch_size: 2\n"
        "  policy_loss: {type: toy, scale: 2.5}\n"
    )
    cfg = load_config(RunConfig, path)
    assert cfg.train.policy_loss == ToyLossSettings(scale=2.5)
    assert to_dict(cfg)["train"]["policy_loss"] == {"type": "toy", "scale": 2.5}
    metrics, moved = _train_step(cfg)
    assert TOY_CALLS and all(s is cfg.train.policy_loss for s in TOY_CALLS)
    assert moved > 0 and math.isfinite(metrics["train/pg_loss"])
    # One mini-batch: pg_loss is measured before the update, so it is linear in `scale`.
    base, _ = _train_step(load_config(RunConfig, path, ["train.policy_loss.scale=1.0"]))
    assert metrics["train/pg_loss"] == pytest.approx(2.5 * base["train/pg_loss"], rel=1e-6)
    assert base["train/pg_loss"] != 0
    # The config reference documents it like a built-in, and its keys are checked.
    assert "`train.policy_loss.scale`" in render()
    with pytest.raises(ConfigError, match=r"did you mean 'train.policy_loss.scale'"):
        load_config(RunConfig, path, ["train.policy_loss.scal=2"])
    with pytest.raises(ConfigError, match="scale must be > 0"):
        load_config(RunConfig, path, ["train.policy_loss.scale=0"])


def test_registering_refuses_a_shared_or_unusable_settings_class(toy: None) -> None:
    """The settings class tells which variant a config holds: one class per variant, and a
    bare name must build it (every setting has a default)."""
    with pytest.raises(ValueError, match="already"):
        POLICY_LOSSES.register("toy2", settings=ToyLossSettings)
    with pytest.raises(ValueError, match="already"):
        POLICY_LOSSES.register("toy3", settings=SAPOSettings)

    @dataclass(frozen=True, kw_only=True, slots=True)
    class NoDefault(PolicyLossSettings):
        """Required setting."""

        x: float
        """Required."""

    with pytest.raises(TypeError):
        POLICY_LOSSES.register("no_default", settings=NoDefault)
    assert "no_default" not in POLICY_LOSSES
    with pytest.raises(TypeError, match="PolicyLossSettings"):
        POLICY_LOSSES.register("wrong_family", settings=GAESettings)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Every entry: settings class, function, docs row, reference numbers
# ---------------------------------------------------------------------------------------------

#: registry, its heading row in docs/algorithms.md's table, its reference cases
FAMILIES: dict[str, tuple[Registry, str, dict[str, Any]]] = {
    "advantage estimators": (ADVANTAGE_ESTIMATORS, "advantage estimators", ADVANTAGE_CASES),
    "policy losses": (POLICY_LOSSES, "policy losses", LOSS_CASES),
    "KL estimators": (KL_ESTIMATORS, "KL estimators", KL_CASES),
    "KL controllers": (KL_CONTROLLERS, "KL controllers", CONTROLLER_CASES),
    "rollout corrections": (ROLLOUT_CORRECTIONS, "rollout corrections", CORRECTION_CASES),
}


def _table_rows(heading: str) -> dict[str, list[str]]:
    """The rows of docs/algorithms.md's table under ``| **heading** |``, by name."""
    lines = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| **{heading}**"))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def _entries() -> list[tuple[str, str]]:
    return [(family, name) for family, (reg, _, _) in FAMILIES.items() for name in reg]


@pytest.mark.parametrize(("family", "name"), _entries())
def test_every_variant_is_documented_and_referenced(family: str, name: str) -> None:
    registry, heading, cases = FAMILIES[family]
    entry = registry[name]
    cls = entry.settings
    assert dataclasses.is_dataclass(cls) and issubclass(cls, registry.base)
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"  # type: ignore[attr-defined]
    fields = dataclasses.fields(cls)
    assert all(f.kw_only for f in fields), f"{cls.__name__}: every setting is keyword-only"
    docs = field_docs(cls)
    undocumented = [f.name for f in fields if not docs.get(f.name)]
    assert not undocumented, f"{cls.__name__}: undocumented settings {undocumented}"
    assert cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("), cls.__name__
    assert entry.fn is not None, f"{family} {name!r} has no function"
    assert cases.get(name), f"{family} {name!r} has no reference numbers"
    row = _table_rows(heading).get(name)
    assert row is not None, f"docs/algorithms.md has no row for {family} {name!r}"
    keys_cell = row[2]
    missing = [f.name for f in fields if not re.search(rf"[`.]{f.name}`", keys_cell)]
    assert not missing, f"docs/algorithms.md, {name!r}: config keys lack {missing}"


def test_the_docs_table_lists_no_unregistered_variant() -> None:
    for registry, heading, _ in FAMILIES.values():
        assert set(_table_rows(heading)) == set(registry), heading


# ---------------------------------------------------------------------------------------------
# Config shape and errors
# ---------------------------------------------------------------------------------------------


def test_a_name_is_the_variant_with_default_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  policy_loss: sapo\n")
    by_name = load_config(RunConfig, path)
    assert by_name.train.policy_loss == SAPOSettings()
    for overrides in (["train.policy_loss=sapo"], ["train.policy_loss.type=sapo"]):
        assert load_config(RunConfig, None, overrides) == by_name
    # A name in the file, its settings on the command line (the name becomes {type: ...}).
    cfg = load_config(RunConfig, path, ["train.policy_loss.tau_pos=1.2"])
    assert cfg.train.policy_loss == SAPOSettings(tau_pos=1.2)
    # Without a type a mapping keeps the default's: the common clip-higher tweak.
    cfg = load_config(RunConfig, None, ["train.policy_loss.clip_high=0.28"])
    assert cfg.train.policy_loss == PPOClipSettings(clip_high=0.28)
    cfg = load_config(RunConfig, None, ["kl.estimator=k2", "advantage.estimator.eps=0.5"])
    assert cfg.kl.estimator == K2Settings() and cfg.advantage.estimator == GRPOSettings(eps=0.5)
    # Dumped as {type, ...settings}, and read back equal.
    text = dump_yaml(cfg)
    assert "policy_loss:\n    type: ppo_clip\n" in text
    again = tmp_path / "again.yaml"
    again.write_text(text)
    assert load_config(RunConfig, again) == cfg


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["train.policy_loss=ppo"], ["train.policy_loss", "unknown policy loss 'ppo'", "ppo_clip"]),
        (["advantage.estimator=rlo"], ["advantage.estimator", "did you mean 'rloo'"]),
        (["kl.estimator.type=k4"], ["kl.estimator", "unknown KL estimator 'k4'", "k3"]),
        # Another variant's setting: the message names the variants that have it.
        (["train.policy_loss.tau_pos=1.2"], ["train.policy_loss.tau_pos", "ppo_clip", "sapo"]),
        (
            ["train.policy_loss=sapo", "train.policy_loss.tau_po=1.2"],
            ["did you mean 'train.policy_loss.tau_pos'"],
        ),
        (["train.policy_loss=kl_cov", "train.policy_loss.coef=-1"], ["train.policy_loss", "coef"]),
        (["train.policy_loss.clip_low=1.5"], ["train.policy_loss", "clip_low must be in [0, 1)"]),
        (["advantage.estimator={type: gae, lam: 2}"], ["advantage.estimator", "lam must be in"]),
        (["train.policy_loss=[1, 2]"], ["train.policy_loss", "policy loss name"]),
        (["train.policy_loss.type=geo_mean"], ["geo_mean", "seq-mean-token-mean"]),
        (["critic.lr=1e-3"], ["critic", "advantage.estimator=grpo", "gae"]),
    ],
)
def test_bad_variant_input_is_one_line_naming_the_field(
    overrides: list[str], needles: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, overrides)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


# ---------------------------------------------------------------------------------------------
# Old flat keys
# ---------------------------------------------------------------------------------------------


def _moved(section: type) -> list[tuple[str, str, MovedKey]]:
    """(old key, variant field, rule) for every key that moved into ``section``'s variants."""
    return [
        (old, f.name, rule)
        for f in dataclasses.fields(section)
        for old, rule in f.metadata.get("moved", {}).items()
    ]


OLD_KEYS = [
    *[("train", *m) for m in _moved(TrainConfig)],
    *[("advantage", *m) for m in _moved(AdvantageConfig)],
    *[("kl", *m) for m in _moved(KLConfig)],
]


@pytest.mark.parametrize(
    ("section", "old", "field", "rule"), OLD_KEYS, ids=[k[1] for k in OLD_KEYS]
)
def test_an_old_key_from_the_user_names_its_new_key(
    section: str, old: str, field: str, rule: MovedKey, tmp_path: Path
) -> None:
    yaml_file = tmp_path / "user.yaml"
    yaml_file.write_text(f"{section}:\n  {old}: 0.5\n")
    for load in (
        lambda: load_config(RunConfig, None, [f"{section}.{old}=0.5"]),
        lambda: load_config(RunConfig, yaml_file),
        # In a resume's overrides too: only the run's own file is migrated.
        lambda: load_config(
            RunConfig, OLD_RUN / "config.yaml", [f"{section}.{old}=0.5"], saved=True
        ),
    ):
        with pytest.raises(ConfigError) as info:
            load()
        msg = str(info.value)
        assert "\n" not in msg
        assert f"'{section}.{old}' was moved: use {section}.{field}.{rule.into}" in msg, msg
        assert f"{section}.{field}.type" in msg and (not rule.variants or rule.variants[0] in msg)


def test_the_old_run_config_migrates_to_its_new_form(tmp_path: Path) -> None:
    """The fixture (sapo, sapo_tau_pos 1.2, dual_clip 4.0, k2) written before issue 22: each old
    key lands in the settings of the variant that read it, the others are dropped, and the
    result equals the same run configured in the new shape, for the resume checks too."""
    old = load_config(RunConfig, OLD_RUN / "config.yaml", saved=True)
    assert old.train.policy_loss == SAPOSettings(tau_pos=1.2, tau_neg=1.05)  # no dual clip
    assert old.advantage.estimator == GRPOSettings(eps=1e-6)  # gamma and lam: not grpo's
    assert old.kl.estimator == K2Settings()
    assert old.kl.controller == FixedKLSettings()  # target and horizon: not fixed's
    assert old.train.rollout_correction == NoCorrectionSettings()  # cap, low, high dropped
    new = tmp_path / "new.yaml"
    new.write_text(
        (OLD_RUN / "config.yaml")
        .read_text()
        .replace("  policy_loss: sapo\n", "  policy_loss: {type: sapo, tau_pos: 1.2}\n")
    )
    text = new.read_text()
    for key in ("clip_low", "clip_high", "dual_clip", "sapo_tau_pos", "sapo_tau_neg"):
        text = re.sub(rf"\n  {key}: .*", "", text)
    text = re.sub(r"\n  (clip_cov|kl_cov)_\w+: .*", "", text)
    text = re.sub(r"\n  (eps|gamma|lam|target|horizon|correction_\w+): .*", "", text)
    new.write_text(text)
    # Keys added since, whose default changes what a run computes, resume as before they
    # existed (`before_it_existed`): the same run in the new shape says so.
    fresh = load_config(
        RunConfig, new, ["train.skip_zero_advantage=off", "rollout.compact_decode=off"]
    )
    assert fresh == old
    assert fingerprint(fresh) == fingerprint(old)
    assert diff_keys(to_dict(old), to_dict(fresh), exclude=RESUME_SAFE_KEYS) == []


def test_migration_keeps_each_old_key_only_for_the_variant_that_read_it(tmp_path: Path) -> None:
    old = (OLD_RUN / "config.yaml").read_text()
    cases = {
        "ppo_clip": PPOClipSettings(dual_clip=4.0),
        "clip_cov": ClipCovSettings(dual_clip=4.0, ratio=0.0002, lb=1.0, ub=5.0),
        "kl_cov": KLCovSettings(ratio=0.0002, coef=1.0),
    }
    for name, want in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(old.replace("  policy_loss: sapo\n", f"  policy_loss: {name}\n"))
        assert load_config(RunConfig, path, saved=True).train.policy_loss == want, name
    path = tmp_path / "gae.yaml"
    path.write_text(
        old.replace("  estimator: grpo\n", "  estimator: gae\n")
        .replace("  lam: 1.0\n", "  lam: 0.9\n")
        .replace("critic: null\n", "critic:\n  lr: 1.0e-5\n")
    )
    assert load_config(RunConfig, path, saved=True).advantage.estimator == GAESettings(lam=0.9)
    path = tmp_path / "controller.yaml"
    path.write_text(
        old.replace("  controller: fixed\n", "  controller: adaptive\n")
        .replace("  horizon: 10000\n", "  horizon: 64\n")
        .replace("  rollout_correction: none\n", "  rollout_correction: seq_tis\n")
        .replace("  correction_cap: 2.0\n", "  correction_cap: 3.0\n")
        .replace("  old_logprobs: auto\n", "  old_logprobs: actor\n")
    )
    migrated = load_config(RunConfig, path, saved=True)
    assert migrated.kl.controller == AdaptiveKLSettings(horizon=64)
    assert migrated.train.rollout_correction == SeqTISSettings(cap=3.0)
    path.write_text(
        path.read_text().replace(
            "  rollout_correction: seq_tis\n", "  rollout_correction: token_mask\n"
        )
    )
    migrated = load_config(RunConfig, path, saved=True)
    assert migrated.train.rollout_correction == TokenMaskSettings(low=0.5, high=2.0)


def test_resuming_the_old_run_sees_no_config_change(tmp_path: Path) -> None:
    """jobs.submit's resume check compares the run's (migrated) config with the resumed one:
    unchanged, it passes; a changed variant setting is named by its new key."""
    run = tmp_path / "run"
    # The whole run: a directory with nothing committed would take any config afresh.
    shutil.copytree(OLD_RUN, run)
    cfg, fresh = resolve_config(parse_args(["--run-dir", str(run)]), run)
    assert not fresh
    assert cfg.train.policy_loss == SAPOSettings(tau_pos=1.2)
    with pytest.raises(UserError, match=r"train\.policy_loss\.tau_pos changed"):
        resolve_config(parse_args(["--run-dir", str(run), "train.policy_loss.tau_pos=1.3"]), run)


@pytest.mark.parametrize(
    ("old_text", "new_text", "want"),
    [
        # the flat layout: dual_clip 4.0 in the fixture, 3.0 (the old default) here
        (
            "  policy_loss: sapo\n  clip_low: 0.2\n  clip_high: 0.2\n  dual_clip: 4.0\n",
            "  policy_loss: clip_cov\n  clip_low: 0.2\n  clip_high: 0.2\n  dual_clip: 3.0\n",
            ("train", "policy_loss", ClipCovSettings(dual_clip=3.0)),
        ),
        # the variant layout as written before 2026-11-27, every setting spelled out
        (
            "  policy_loss: sapo\n",
            "  policy_loss: {type: clip_cov, clip_low: 0.2, clip_high: 0.2, dual_clip: 3.0,"
            " ratio: 0.0002, lb: 1.0, ub: 5.0}\n",
            ("train", "policy_loss", ClipCovSettings(dual_clip=3.0)),
        ),
        (
            "  estimator: grpo\n",
            "  estimator: optimal_token_baseline\n",
            ("advantage", "estimator", OptimalTokenBaselineSettings(eps=1e-6)),
        ),
    ],
)
def test_changed_verl_defaults_leave_a_started_run_as_it_was(
    tmp_path: Path, old_text: str, new_text: str, want: tuple[str, str, Any]
) -> None:
    """clip_cov's dual clip (3.0 -> off) and the optimal token baseline's eps (1e-6 -> 1e-8)
    took verl's defaults: a run started before resumes with the values it was started
    with, and the resume check sees no change."""
    run = tmp_path / "run"
    run.mkdir()
    text = (OLD_RUN / "config.yaml").read_text()
    assert old_text in text
    (run / "config.yaml").write_text(text.replace(old_text, new_text))
    cfg, fresh = resolve_config(parse_args(["--run-dir", str(run)]), run)
    assert not fresh  # its own config again: a restart, not a fresh start
    section, key, settings = want
    assert getattr(getattr(cfg, section), key) == settings
