"""Tests for rftpipe.config.loader on a small toy config tree defined here."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from rftpipe.config.loader import (
    ConfigError,
    diff_keys,
    dump_yaml,
    field_docs,
    fingerprint,
    from_dict,
    iter_fields,
    load_config,
    to_dict,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ toy schema


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimToy:
    """Second nesting level: optimizer settings."""

    lr: float = 1e-5
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    clip_norm: float | None = 1.0
    """Gradient-norm clip;
    null disables clipping."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainToy:
    """First nesting level with a cross-field check."""

    optim: OptimToy = field(default_factory=OptimToy)
    """Optimizer settings."""
    batch_size: int = 8
    """Rollouts per optimizer step."""
    mini_batch_size: int = 4
    """Rollouts per forward/backward pass."""
    use_kl: bool = False
    """Whether to add a KL penalty."""

    def __post_init__(self) -> None:
        """Reject a mini batch that does not tile the batch."""
        if self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size {self.mini_batch_size} does not divide batch_size {self.batch_size}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class DataToy:
    """Dataset settings with collection-typed fields."""

    name: str = "arith"
    """Generator name."""
    stop: tuple[str, ...] = ("</answer>",)
    """Stop strings."""
    seeds: tuple[int, ...] = (0,)
    """Generator seeds."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form generator keyword arguments."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RootToy:
    """Root of the toy tree."""

    run_name: str
    """Required run name."""
    train: TrainToy = field(default_factory=TrainToy)
    """Training settings."""
    data: DataToy = field(default_factory=DataToy)
    """Data settings."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartlyDocumented:
    """A class with one undocumented field."""

    documented: int = 0
    """Has a docstring."""
    undocumented: int = 0
    # A comment is not a docstring.
    also_undocumented: int = 0

    def method(self) -> str:
        """A method docstring is not a field docstring."""
        return "x"


# --------------------------------------------------------------------------- helpers


def _load(*overrides: str, path: Path | None = None) -> RootToy:
    """Load the toy tree with the required run name filled in."""
    return load_config(RootToy, path, ["run_name=test", *overrides])


def _error(fn: Callable[[], object], *fragments: str) -> str:
    """Assert ``fn`` raises a one-line ConfigError containing every fragment."""
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------- loading and types


def test_defaults() -> None:
    cfg = _load()
    assert cfg.run_name == "test"
    assert cfg.train.optim == OptimToy()
    assert cfg.train.batch_size == 8
    assert cfg.data.stop == ("</answer>",)
    assert cfg.data.kwargs == {}


def test_yaml_load(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
run_name: from-yaml
train:
  batch_size: 16
  optim:
    lr: 1e-4          # YAML 1.1 reads this as a string; float fields accept it
    schedule: cosine
    clip_norm: null
data:
  stop: ["\\n\\n", "</s>"]
  seeds: [1, 2]
  kwargs: {min_terms: 2, ops: [add, mul]}
""",
    )
    cfg = load_config(RootToy, path)
    assert cfg.run_name == "from-yaml"
    assert cfg.train.batch_size == 16
    assert cfg.train.mini_batch_size == 4
    assert cfg.train.optim.lr == pytest.approx(1e-4)
    assert isinstance(cfg.train.optim.lr, float)
    assert cfg.train.optim.schedule == "cosine"
    assert cfg.train.optim.clip_norm is None
    assert cfg.data.stop == ("\n\n", "</s>")
    assert cfg.data.seeds == (1, 2)
    assert cfg.data.kwargs == {"min_terms": 2, "ops": ["add", "mul"]}


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = _load(path=_write(tmp_path, "# only a comment\n"))
    assert cfg == RootToy(run_name="test")


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    path = _write(tmp_path, "- a\n- b\n")
    _error(lambda: load_config(RootToy, path), "top level", "cfg.yaml")


def test_missing_file(tmp_path: Path) -> None:
    _error(lambda: load_config(RootToy, tmp_path / "nope.yaml"), "not found", "nope.yaml")


def test_overrides_of_each_type() -> None:
    cfg = _load(
        "train.optim.lr=1e-5",
        "train.optim.warmup_steps=10",
        "train.optim.schedule=cosine",
        "train.optim.clip_norm=null",
        "train.use_kl=true",
        "train.batch_size=12",
        "train.mini_batch_size=6",
        "data.stop=[a, b]",
        "data.seeds=[3,4]",
        "data.kwargs={x: 1}",
    )
    assert cfg.train.optim.lr == pytest.approx(1e-5)
    assert cfg.train.optim.warmup_steps == 10
    assert cfg.train.optim.schedule == "cosine"
    assert cfg.train.optim.clip_norm is None
    assert cfg.train.use_kl is True
    assert (cfg.train.batch_size, cfg.train.mini_batch_size) == (12, 6)
    assert cfg.data.stop == ("a", "b")
    assert cfg.data.seeds == (3, 4)
    assert cfg.data.kwargs == {"x": 1}


def test_float_accepts_int_and_numeric_string() -> None:
    cfg = _load("train.optim.lr=3")
    assert cfg.train.optim.lr == 3.0
    assert type(cfg.train.optim.lr) is float
    cfg = from_dict(RootToy, {"run_name": "x", "train": {"optim": {"clip_norm": "2.5e-1"}}})
    assert cfg.train.optim.clip_norm == 0.25


def test_str_override_keeps_typed_text() -> None:
    # YAML would read these as int and date; a str field gets the text as written.
    assert _load("run_name=2024").run_name == "2024"
    assert _load("run_name=2024-01-31").run_name == "2024-01-31"


def test_overrides_apply_on_top_of_yaml_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: a\ntrain: {batch_size: 16}\n")
    cfg = load_config(RootToy, path, ["train.batch_size=4", "train.batch_size=32"])
    assert cfg.run_name == "a"
    assert cfg.train.batch_size == 32


def test_override_creates_key_inside_dict_field(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: a\ndata:\n  kwargs: {min_terms: 1}\n")
    cfg = load_config(RootToy, path, ["data.kwargs.min_terms=2", "data.kwargs.new.deep=[1, 2]"])
    assert cfg.data.kwargs == {"min_terms": 2, "new": {"deep": [1, 2]}}


def test_override_into_empty_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: a\ntrain:\n")
    assert (
        load_config(
            RootToy, path, ["train.batch_size=2", "train.mini_batch_size=1"]
        ).train.batch_size
        == 2
    )


def test_override_does_not_mutate_input() -> None:
    data: dict[str, Any] = {"run_name": "a", "data": {"kwargs": {"k": 1}}}
    from_dict(RootToy, data, ["data.kwargs.k=2"])
    assert data == {"run_name": "a", "data": {"kwargs": {"k": 1}}}


def test_override_without_equals() -> None:
    _error(lambda: _load("train.lr"), "train.lr", "key=value")


def test_override_through_scalar() -> None:
    _error(lambda: _load("run_name.x=1"), "run_name", "not a mapping")


def test_unknown_top_level_key_suggests() -> None:
    msg = _error(lambda: _load("trian.batch_size=2"), "unknown config key 'trian'")
    assert msg.endswith("did you mean 'train'?")


def test_unknown_nested_key_suggests(tmp_path: Path) -> None:
    _error(
        lambda: _load("train.optim.lrr=1"),
        "unknown config key 'train.optim.lrr'; did you mean 'train.optim.lr'?",
    )
    path = _write(tmp_path, "run_name: a\ntrain:\n  batch_sise: 4\n")
    _error(
        lambda: load_config(RootToy, path), "'train.batch_sise'", "did you mean 'train.batch_size'?"
    )


def test_unknown_key_without_close_match_lists_keys() -> None:
    _error(
        lambda: _load("data.zzzzzz=1"),
        "'data.zzzzzz'",
        "valid keys here: name, stop, seeds, kwargs",
    )


def test_bad_literal_lists_allowed_values() -> None:
    _error(
        lambda: _load("train.optim.schedule=linear"),
        "train.optim.schedule",
        "'constant', 'cosine'",
        "'linear'",
    )
    # ``on`` is a YAML 1.1 bool; the message shows what was typed on the command line.
    _error(lambda: _load("train.optim.schedule=on"), "train.optim.schedule", "got 'on'")


def test_literal_from_yaml_suggests_quoting(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: a\ntrain: {optim: {schedule: yes}}\n")
    _error(lambda: load_config(RootToy, path), "train.optim.schedule", "bool True", "quote it")


def test_int_rejects_float_and_bool() -> None:
    _error(lambda: _load("train.batch_size=8.0"), "train.batch_size", "expects an int", "float")
    _error(lambda: _load("train.batch_size=true"), "train.batch_size", "expects an int", "bool")


def test_float_rejects_bad_values() -> None:
    _error(lambda: _load("train.optim.lr=abc"), "train.optim.lr", "expects a float", "'abc'")
    _error(lambda: _load("train.optim.lr=false"), "train.optim.lr", "expects a float", "bool")


def test_bool_rejects_non_bool() -> None:
    _error(lambda: _load("train.use_kl=1"), "train.use_kl", "expects a bool")
    _error(lambda: _load("train.use_kl='true'"), "train.use_kl", "expects a bool")


def test_str_rejects_non_str_from_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: 12\n")
    _error(lambda: load_config(RootToy, path), "run_name", "expects a str", "quote it")


def test_null_only_where_optional() -> None:
    assert _load("train.optim.clip_norm=null").train.optim.clip_norm is None
    _error(lambda: _load("train.optim.lr=null"), "train.optim.lr", "must not be null")
    _error(lambda: _load("data=null"), "'data'", "must not be null")


def test_tuple_fields_validate_items() -> None:
    _error(lambda: _load("data.stop=abc"), "data.stop", "expects a list")
    _error(lambda: _load("data.seeds=[1, x]"), "data.seeds[1]", "expects an int")


def test_section_and_dict_need_mappings() -> None:
    _error(lambda: _load("train=5"), "'train'", "must be a mapping")
    _error(lambda: _load("data.kwargs=[1]"), "data.kwargs", "expects a mapping")


def test_missing_required_field() -> None:
    _error(lambda: load_config(RootToy), "missing required config field 'run_name'")


def test_malformed_yaml_reports_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: a\ntrain:\n  batch_size: [1, 2\n  lr: 3\n")
    _error(lambda: load_config(RootToy, path), "cfg.yaml", "line 4")
    path = _write(tmp_path, "run_name: a\ntrain:\n  batch_size: 1\n   bad: : x\n")
    _error(lambda: load_config(RootToy, path), "cfg.yaml", "line 4", "column")


def test_malformed_override_value() -> None:
    _error(lambda: _load("data.stop=[a, b"), "data.stop=[a, b", "not valid YAML")


def test_post_init_error_is_prefixed_with_path() -> None:
    msg = _error(
        lambda: _load("train.batch_size=6"), "mini_batch_size 4 does not divide batch_size 6"
    )
    assert msg.startswith("config error in 'train': ")


def test_result_is_frozen() -> None:
    cfg = _load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.batch_size = 3  # type: ignore[misc]


# --------------------------------------------------------------- dumping and hashing


def test_to_dict_and_dump_yaml_round_trip(tmp_path: Path) -> None:
    cfg = _load("data.kwargs.k=[1, 2]", "train.optim.clip_norm=null")
    plain = to_dict(cfg)
    assert plain["data"]["stop"] == ["</answer>"]
    assert plain["train"]["optim"]["clip_norm"] is None
    assert list(plain) == ["run_name", "train", "data"]
    text = dump_yaml(cfg)
    assert yaml.safe_load(text) == plain
    assert load_config(RootToy, _write(tmp_path, text)) == cfg
    assert from_dict(RootToy, plain) == cfg


def test_fingerprint_stable_and_exclude() -> None:
    a = _load()
    assert fingerprint(a) == fingerprint(_load())
    assert fingerprint(a) == fingerprint(to_dict(a))
    assert len(fingerprint(a)) == 64
    b = _load("train.optim.lr=2e-5")
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a, exclude=["train.optim.lr"]) == fingerprint(b, exclude=["train.optim.lr"])
    # A prefix removes the whole subtree.
    assert fingerprint(a, exclude=["train"]) == fingerprint(b, exclude=["train"])
    assert fingerprint(a, exclude=["train.optim"]) == fingerprint(b, exclude=["train.optim"])
    assert fingerprint(a, exclude=["data"]) != fingerprint(b, exclude=["data"])
    # Excluding a prefix of a name must not exclude the longer name.
    assert fingerprint(a, exclude=["train.optim.l"]) != fingerprint(b, exclude=["train.optim.l"])


def test_diff_keys() -> None:
    a = to_dict(_load())
    b = to_dict(_load("train.optim.lr=2e-5", "run_name=other", "data.kwargs.extra=1"))
    assert diff_keys(a, a) == []
    assert diff_keys(a, b) == ["data.kwargs", "data.kwargs.extra", "run_name", "train.optim.lr"]
    assert diff_keys(a, b, exclude=["run_name", "data"]) == ["train.optim.lr"]
    # Values Python finds equal but that hash differently are reported.
    assert diff_keys({"x": 1}, {"x": 1.0}) == ["x"]


# --------------------------------------------------------------------- introspection


def test_field_docs() -> None:
    docs = field_docs(OptimToy)
    assert docs["lr"] == "Peak learning rate."
    assert docs["clip_norm"] == "Gradient-norm clip;\nnull disables clipping."
    assert set(docs) == {f.name for f in dataclasses.fields(OptimToy)}
    assert field_docs(PartlyDocumented) == {"documented": "Has a docstring."}


def test_every_toy_field_is_documented() -> None:
    # The same pattern the real schema's test uses: walk the tree, look up each
    # field in its owning class.
    for cls in (RootToy, TrainToy, OptimToy, DataToy):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__}: {missing}"


def test_iter_fields() -> None:
    items = {name: (hint, default) for name, hint, default in iter_fields(RootToy)}
    assert list(items)[:3] == ["run_name", "train", "train.optim"]
    assert items["run_name"][1] is dataclasses.MISSING
    assert items["train"] == (TrainToy, TrainToy())
    assert items["train.optim.schedule"] == (Literal["constant", "cosine"], "constant")
    assert items["train.optim.clip_norm"] == (float | None, 1.0)
    assert items["data.seeds"] == (tuple[int, ...], (0,))
    assert items["data.kwargs"] == (dict[str, Any], {})
    assert len(items) == 15
    assert next(iter_fields(OptimToy, prefix="x"))[0] == "x.lr"


def test_import_does_not_load_ml_libraries() -> None:
    code = (
        "import sys, rftpipe.config.loader\n"
        "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------- retired values


@dataclass(frozen=True, kw_only=True, slots=True)
class RetiredToy:
    """A field whose type changed: bools are its old, retired values."""

    ref: str | None = field(default=None, metadata={"retired": {bool: "now names a model"}})
    """A model name (null: none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RetiredRootToy:
    """Root holding the retired field one level down."""

    model: RetiredToy = field(default_factory=RetiredToy)
    """Model settings."""


def test_retired_value_from_user_input_is_explained(tmp_path: Path) -> None:
    """A retired value in a user's YAML or on the command line gets the field's own
    explanation, not a type error."""
    path = _write(tmp_path, "model:\n  ref: true\n")
    _error(lambda: load_config(RetiredRootToy, path), "'model.ref'", "now names a model")
    _error(
        lambda: load_config(RetiredRootToy, None, ["model.ref=false"]),
        "'model.ref'",
        "now names a model",
    )
    assert load_config(RetiredRootToy, None, ["model.ref=m"]).model.ref == "m"


def test_retired_value_of_a_saved_config_is_dropped(tmp_path: Path) -> None:
    """`saved=True` (a run directory's own config, written by an older version): the file's
    retired value is dropped, so the field takes its default; overrides are still user
    input and still refused. The caller's mapping is not modified."""
    path = _write(tmp_path, "model:\n  ref: true\n")
    assert load_config(RetiredRootToy, path, saved=True).model.ref is None
    assert load_config(RetiredRootToy, path, ["model.ref=m"], saved=True).model.ref == "m"
    _error(
        lambda: load_config(RetiredRootToy, path, ["model.ref=false"], saved=True),
        "'model.ref'",
        "now names a model",
    )
    data = {"model": {"ref": False}}
    assert from_dict(RetiredRootToy, data, saved=True).model.ref is None
    assert data == {"model": {"ref": False}}
