"""Every shipped config loads; every config field is documented; the CLI surface is frozen."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from jobs.submit import parse_args
from rftpipe.algos.variants import AdaptiveKLSettings, IcePopSettings
from rftpipe.config.loader import ConfigError, field_docs, iter_fields, load_config
from rftpipe.config.schema import RunConfig, old_logprobs_source

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted(ROOT.glob("examples/*/config.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    cfg = load_config(RunConfig, path)
    assert cfg.total_steps >= 1


@pytest.mark.parametrize(
    ("engine", "setting", "resolved"),
    [
        ("hf", "auto", "rollout"),
        ("vllm", "auto", "actor"),
        ("sglang", "auto", "actor"),
        ("hf", "actor", "actor"),
        ("vllm", "rollout", "rollout"),
    ],
)
def test_old_logprobs_auto_resolves_by_engine(engine: str, setting: str, resolved: str) -> None:
    cfg = load_config(
        RunConfig, None, [f"rollout.engine={engine}", f"train.old_logprobs={setting}"]
    )
    assert old_logprobs_source(cfg.train, cfg.rollout) == resolved
    assert cfg.train.old_logprobs == setting  # resolved, never rewritten


@pytest.mark.parametrize("old", ["rollout", "auto"])
def test_correction_without_actor_old_logprobs_is_refused(old: str) -> None:
    """On hf, `auto` and `rollout` both mean the rollout's own logprobs: the ratio is 1."""
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["train.rollout_correction=tis", f"train.old_logprobs={old}"])
    msg = str(info.value)
    assert "\n" not in msg and "train.rollout_correction=tis" in msg
    assert "train.old_logprobs=actor" in msg
    # Accepted where the old logprobs come from the actor.
    load_config(RunConfig, None, ["train.rollout_correction=tis", "train.old_logprobs=actor"])
    load_config(RunConfig, None, ["train.rollout_correction=icepop", "rollout.engine=vllm"])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.rollout_correction={type: tis, cap: 0}", "train.rollout_correction': cap"),
        ("train.rollout_correction={type: seq_tis, cap: .inf}", "train.rollout_correction': cap"),
        ("train.rollout_correction={type: icepop, low: -0.1}", "train.rollout_correction"),
        ("train.rollout_correction={type: token_mask, low: 1.5}", "train.rollout_correction"),
        ("train.rollout_correction={type: icepop, high: 0.9}", "train.rollout_correction"),
        ("train.rollout_correction={type: tis, low: 0.5}", "train.rollout_correction.low"),
        ("train.rollout_correction=is", "train.rollout_correction"),
        ("train.correction_cap=3", "train.rollout_correction.cap"),
        ("kl.controller={type: adaptive, horizon: 0}", "kl.controller': horizon"),
        ("kl.controller={type: fixed, target: 0.2}", "kl.controller.target"),
        ("kl.target=0.2", "kl.controller.target"),
    ],
)
def test_bad_correction_and_controller_settings_are_refused(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["train.old_logprobs=actor", override])
    msg = str(info.value)
    assert "\n" not in msg and named in msg, msg


def test_correction_and_controller_settings_reach_their_variant() -> None:
    cfg = load_config(
        RunConfig,
        None,
        [
            "train.old_logprobs=actor",
            "train.rollout_correction={type: icepop, low: 0.25}",
            "kl.mode=loss",
            "kl.controller=adaptive",
            "kl.controller.horizon=64",
        ],
    )
    assert cfg.train.rollout_correction == IcePopSettings(low=0.25, high=2.0)
    assert cfg.kl.controller == AdaptiveKLSettings(target=0.1, horizon=64)
    # A fixed coefficient of 0 with a KL term is refused; an adaptive one may start at 0.
    with pytest.raises(ConfigError, match="controller=fixed"):
        load_config(RunConfig, None, ["kl.mode=loss"])


def test_boolean_model_reference_is_refused_with_its_new_meaning(tmp_path: Path) -> None:
    """`model.reference` was a bool that nothing read; it now names a reference model. A
    bool from the command line or a user YAML gets one line saying so."""
    yaml_file = tmp_path / "user.yaml"
    yaml_file.write_text("model:\n  reference: false\n")
    for load in (
        lambda: load_config(RunConfig, None, ["model.reference=true"]),
        lambda: load_config(RunConfig, yaml_file),
    ):
        with pytest.raises(ConfigError) as info:
            load()
        msg = str(info.value)
        assert "\n" not in msg and "model.reference" in msg
        assert "reference model" in msg and "null" in msg


def test_boolean_model_reference_of_an_old_run_directory_loads(tmp_path: Path) -> None:
    """A run directory's config.yaml written before the change holds `reference: true`
    (the default then): it loads as the policy's initial weights (None), which is what
    such a run used, whatever the bool said."""
    for old in ("true", "false"):
        saved = tmp_path / f"config-{old}.yaml"
        saved.write_text(f"model:\n  path: builtin:tiny\n  reference: {old}\n")
        assert load_config(RunConfig, saved, saved=True).model.reference is None


def test_model_reference_without_a_kl_term_is_refused() -> None:
    """Nothing reads the reference with kl.mode=none: refused rather than silently unused."""
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["model.reference=builtin:tiny"])
    msg = str(info.value)
    assert "\n" not in msg and "model.reference" in msg and "kl.mode" in msg
    cfg = load_config(
        RunConfig, None, ["model.reference=builtin:tiny", "kl.mode=loss", "kl.coef=0.1"]
    )
    assert cfg.model.reference == "builtin:tiny"


def test_every_field_has_a_docstring() -> None:
    missing = []
    for dotted, _hint, _default in iter_fields(RunConfig):
        owner = RunConfig
        *parents, name = dotted.split(".")
        for part in parents:
            # The field's own type: an optional sub-config (`critic`) defaults to None.
            hint = typing.get_type_hints(owner)[part]
            owner = next(a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a))
        if not field_docs(owner).get(name):
            missing.append(dotted)
    assert not missing, missing


def test_cli_flags_are_frozen_and_documented() -> None:
    parser_flags = {a for action in parse_args([])._get_kwargs() for a in [action[0]]}
    assert parser_flags == {
        "cluster",
        "config",
        "run_dir",
        "tasks_per_node",
        "repair",
        "allow_fingerprint_mismatch",
        "create_only",
        "submit_anyway",
        "nodes",
        "gpus_per_node",
        "cpus_per_task",
        "mem",
        "partition",
        "account",
        "qos",
        "time",
        "constraint",
        "exclusive",
        "signal_delay",
        "sbatch",
        "job_name",
        "dry_run",
        "wait",
        "overrides",
    }
    help_text = subprocess.run(
        [sys.executable, "-m", "jobs.submit", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    for flag in parser_flags - {"overrides"}:
        assert "--" + flag.replace("_", "-") in help_text, flag
