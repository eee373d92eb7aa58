"""A bad config's one-line message at load time is the one recorded before the config schema
(`rftpipe/config/schema.py`) became a module per section.

Each case of tests/test_bad_input.py's tables (`*_CASES`, run there end to end through
`jobs.submit`, slowly), two of its config-file tests and the cases of `SECTION_CASES` below
are loaded here in-process as `jobs.submit` loads a new run's config: `load_config` of
`RunConfig` with the file and the overrides, then the launch check that lives in the config
(`LaunchConfig.rollout_rank_count` on one local rank). The fixture
tests/fixtures/config_messages_before_split.json holds each case (file, overrides) and the
message it got from the code before the split; null for a case that passes the config load
and fails later, at run time (it must still pass the load).

Recording (only to add cases; a message that differs from the recorded one is the change
this test exists to catch): ``PYTHONPATH=<checkout> python tests/test_config_messages.py``
records with the `rftpipe` that the interpreter imports, so run it from the checkout of the
code whose messages it should hold.
"""

from __future__ import annotations

import ast
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

import rftpipe
from rftpipe.config.loader import load_config
from rftpipe.config.schema import RunConfig
from rftpipe.errors import UserError

#: The checkout whose code runs (the recorder reads that checkout's tables and configs).
ROOT = Path(rftpipe.__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "config_messages_before_split.json"
#: tests/helpers.py's `submit` runs this config unless a test gives another.
TINY = "configs/tiny_dense.yaml"
#: Stands for the case's own temporary directory in the fixture (configs and data written
#: there, and any message naming them).
TMP = "TMP"

PTX_DATA = '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n'
#: What test_bad_ptx_data gives before each PTX case's own overrides.
PTX_PREFIX = (
    "train.ptx.coef=0.1",
    f"train.ptx.data={{path: '{TMP}/ptx.jsonl'}}",
    "train.ptx.batch_size=2",
)

#: Checks of each section and of `RunConfig`'s cross-section rules that tests/test_bad_input.py
#: leaves out; `rollout.env`/`rollout.agent` paths name tests/ modules, never imported here.
SECTION_CASES: dict[str, tuple[str, ...]] = {
    "lora_rank_zero": ("model.lora.r=0",),
    "lora_no_targets": ("model.lora.target_modules=[]",),
    "lora_vision_tower_frozen": ("model.lora.vision_tower=true", "train.freeze_vision=true"),
    "reference_empty": ("model.reference=''",),
    "reference_without_kl": ("model.reference=builtin:tiny",),
    "reference_retired_bool": ("model.reference=true",),
    "source_file_without_path": ("data.source=file",),
    "source_datasets_empty": ("data.source=datasets",),
    "datasets_without_source": ("data.datasets=[{path: x.parquet}]",),
    "dataset_weight_zero": ("data.source=datasets", "data.datasets=[{path: x.parquet, weight: 0}]"),
    "images_min_above_max": ("data.images.min_pixels=9", "data.images.max_pixels=4"),
    "images_none_per_prompt": ("data.images.max_per_prompt=0",),
    "inference_memory_fraction": ("rollout.inference.memory_fraction=0",),
    "inference_tp_on_hf": ("rollout.inference.tensor_parallel_size=2",),
    "stop_on_sglang": ("rollout.engine=sglang", "rollout.stop=[x]"),
    "top_p_zero": ("rollout.top_p=0",),
    "temperature_zero": ("rollout.temperature=0",),
    "dynamic_sampling_one_sample": ("rollout.dynamic_sampling.enabled=true", "rollout.n=1"),
    "dynamic_sampling_no_rounds": ("rollout.dynamic_sampling.max_rounds=0",),
    "dynamic_sampling_groups_of_one": (
        "rollout.dynamic_sampling.enabled=true",
        "rollout.n=1",
        "advantage.estimator=reinforce_pp",
    ),
    "env_bad_path": ("rollout.env.path=not a path",),
    "env_and_agent": ("rollout.env.path=envs_toy:EvenChars", "rollout.agent.path=agents_toy:echo"),
    "env_on_sglang": ("rollout.env.path=envs_toy:EvenChars", "rollout.engine=sglang"),
    "env_on_tensor_parallel_vllm": (
        "rollout.env.path=envs_toy:EvenChars",
        "rollout.engine=vllm",
        "rollout.inference.tensor_parallel_size=2",
    ),
    "env_zero_timeout": ("rollout.env.path=envs_toy:EvenChars", "rollout.env.timeout_s=0"),
    "env_without_rewards": ("rollout.env.path=envs_toy:EvenChars", "reward.functions=[]"),
    "no_rewards": ("reward.functions=[]",),
    "agent_bad_path": ("rollout.agent.path=agents_toy",),
    "agent_on_vllm": ("rollout.agent.path=agents_toy:echo", "rollout.engine=vllm"),
    "agent_branches_with_gae": (
        "rollout.agent.path=agents_toy:echo",
        "advantage.estimator=gae",
        "critic.lr=1e-5",
    ),
    "agent_branches_with_kl_reward": (
        "rollout.agent.path=agents_toy:echo",
        "kl.mode=reward",
        "kl.coef=0.1",
    ),
    "agent_with_staleness": ("rollout.agent.path=agents_toy:echo", "rollout.staleness=1"),
    "agent_empty_model": ("rollout.agent.path=agents_toy:echo", "rollout.agent.model=''"),
    "reward_model_without_model": ("reward.functions=[reward_model]",),
    "reward_bad_name": ("reward.functions=[{path: accuracy, name: a-b}]",),
    "reward_shared_column": ("reward.functions=[accuracy, accuracy]",),
    "remote_without_url": ("reward.functions=[remote]",),
    "remote_url_with_credentials": (
        "reward.functions=[remote]",
        "reward.remote.url=https://u:p@host/score",
    ),
    "reward_workers_zero": ("reward.workers=0",),
    "eval_unknown_metric": ("eval.size=4", "eval.metric=accuracy"),
    "eval_k_past_samples": ("eval.samples=2", "eval.k=[3]"),
    "kl_negative_coef": ("kl.coef=-1",),
    "critic_without_gae": ("critic.lr=1e-5",),
    "critic_zero_lr": ("advantage.estimator=gae", "critic.lr=0"),
    "betas_three": ("train.betas=[0.9, 0.99, 0.999]",),
    "deepspeed_ema_and_offload": (
        "train.backend=deepspeed",
        "train.ema_decay=0.5",
        "train.cpu_offload=all",
    ),
    "checkpoint_interval_outside_bounds": ("checkpoint.policy=young_daly", "checkpoint.interval=5"),
    "checkpoint_max_below_min": ("checkpoint.max_interval=5",),
    "launch_negative_threads": ("launch.threads=-1",),
    "rollout_ranks_with_lora": ("launch.rollout_ranks=1", "model.lora.r=4"),
    "rollout_ranks_on_deepspeed": ("launch.rollout_ranks=1", "train.backend=deepspeed"),
    "rollout_ranks_with_agent": ("launch.rollout_ranks=1", "rollout.agent.path=agents_toy:echo"),
    "zero_total_steps": ("total_steps=0",),
}


def _case_tables(source: Path) -> dict[str, dict[str, tuple[tuple[str, ...], Any]]]:
    """test_bad_input.py's module-level `*_CASES` literals, read without importing the module
    (it imports torch through tests/helpers.py)."""
    tables = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id.endswith("_CASES"):
            tables[target.id] = ast.literal_eval(value)
    return tables


def _cases(tables: dict[str, dict[str, tuple[tuple[str, ...], Any]]]) -> dict[str, dict]:
    """Every case as the fixture holds it: `config` (relative to the checkout, or under TMP),
    `files` to write under TMP first, and `overrides`."""
    cases: dict[str, dict] = {}
    for table, rows in sorted(tables.items()):
        prefix = PTX_PREFIX if table == "PTX_CASES" else ()
        files = {"ptx.jsonl": PTX_DATA} if table == "PTX_CASES" else {}
        for name, (overrides, _needles) in sorted(rows.items()):
            cases[f"{table}/{name}"] = {
                "config": TINY,
                "files": files,
                "overrides": [*prefix, *overrides],
            }
    # test_malformed_yaml, test_missing_config_file and test_missing_data_file.
    bad_yaml = "train:\n  lr: 1e-5\n   micro_batch_size: 4\n"
    cases["file/malformed_yaml"] = {
        "config": f"{TMP}/bad.yaml",
        "files": {"bad.yaml": bad_yaml},
        "overrides": [],
    }
    cases["file/missing_config_file"] = {
        "config": f"{TMP}/absent.yaml",
        "files": {},
        "overrides": [],
    }
    cases["file/missing_data_file"] = {
        "config": TINY,
        "files": {},
        "overrides": ["data.source=file", f"data.file.path={TMP}/nope.jsonl"],
    }
    for name, overrides in sorted(SECTION_CASES.items()):
        cases[f"section/{name}"] = {"config": TINY, "files": {}, "overrides": list(overrides)}
    return cases


def config_load_message(case: dict, tmp: Path) -> str | None:
    """The message `case` gets when `jobs.submit` loads it as a new run's config on one
    local rank, with the checkout's root as ROOT and `tmp` as TMP; None if it loads."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in case["files"].items():
        (tmp / name).write_text(text)

    def here(text: str) -> str:
        return text.replace(TMP, str(tmp))

    config = Path(here(case["config"]))
    try:
        cfg = load_config(RunConfig, ROOT / config, [here(o) for o in case["overrides"]])
        cfg.launch.rollout_rank_count(1, 1)
    except UserError as exc:
        return str(exc).replace(str(tmp), TMP).replace(str(ROOT), "ROOT")
    return None


def _recorded() -> dict[str, dict]:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.parametrize("name", sorted(_recorded()))
def test_config_load_message_is_unchanged(name: str, tmp_path: Path) -> None:
    case = _recorded()[name]
    assert config_load_message(case, tmp_path / "case") == case["message"]


def test_fixture_holds_every_kind_of_case() -> None:
    """The fixture's cases span the bad-input tables, the file cases and each section's own."""
    kinds = {name.split("/")[0] for name in _recorded()}
    assert {"FRESH_CASES", "PTX_CASES", "ENV_CASES", "file", "section"} <= kinds
    assert sum(case["message"] is not None for case in _recorded().values()) >= 90


def record() -> dict[str, dict]:
    """Every case with the message this checkout's code gives it, written to FIXTURE."""
    cases = _cases(_case_tables(ROOT / "tests" / "test_bad_input.py"))
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases.values()):
            case["message"] = config_load_message(case, Path(tmp) / str(i))
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(cases, indent=1, sort_keys=True) + "\n")
    return cases


if __name__ == "__main__":
    recorded = record()
    refused = sum(c["message"] is not None for c in recorded.values())
    print(f"{FIXTURE}: {len(recorded)} cases from {ROOT}, {refused} refused at load")
