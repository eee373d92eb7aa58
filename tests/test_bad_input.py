"""Bad input: exit code 2, exactly one stderr line naming the culprit, committed files untouched."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import NEEDS_VLLM, ROOT, submit

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent


def committed_files(run: Path) -> dict[str, str]:
    """sha256 of every committed artefact (stages, trajectories, checkpoints, run config)."""
    out = {}
    for sub in ("stages", "trajectories", "checkpoints"):
        for p in sorted((run / sub).rglob("*")) if (run / sub).exists() else []:
            if p.is_file():
                out[str(p.relative_to(run))] = hashlib.sha256(p.read_bytes()).hexdigest()
    for name in ("config.yaml", "run.json"):
        if (run / name).exists():
            out[name] = hashlib.sha256((run / name).read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("bad") / "base"
    out = submit(run, "total_steps=2")
    assert out.returncode == 0, out.stderr
    return run


def _expect_error(res, *needles: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _fresh(
    tmp_path: Path,
    *overrides: str,
    config: Path | None = None,
    env: dict | None = None,
    needles: tuple[str, ...] = (),
) -> None:
    run = tmp_path / "new"
    kwargs = {"config": config} if config else {}
    res = submit(run, *overrides, env=env, **kwargs)
    _expect_error(res, *needles)
    assert committed_files(run).keys() <= {"config.yaml", "run.json"}


def _resumed(
    base_run: Path,
    tmp_path: Path,
    *overrides: str,
    extra: tuple[str, ...] = (),
    needles: tuple[str, ...] = (),
    env: dict | None = None,
    mutate=None,
    accepted: bool = False,
) -> None:
    """`accepted`: the resume passed its checks (its config is now the run's) and failed later."""
    run = tmp_path / "resume"
    shutil.copytree(base_run, run)
    if mutate:
        mutate(run)
    before = committed_files(run)
    res = submit(run, *overrides, config=None, extra=extra, env=env)
    _expect_error(res, *needles)
    after = committed_files(run)
    if accepted:
        assert after.pop("config.yaml") != before.pop("config.yaml")
    assert {k: after.get(k) for k in before} == before


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


FRESH_CASES = {
    "unknown_key": (("train.lrr=1e-5",), ("train.lrr", "train.lr")),
    "unknown_nested_section": (("rollouts.n=4",), ("rollouts", "rollout")),
    "bad_literal": (("advantage.estimator=ppo",), ("advantage.estimator", "grpo")),
    "bad_int": (("rollout.n=abc",), ("rollout.n",)),
    "float_for_int": (("rollout.n=2.5",), ("rollout.n",)),
    "batch_does_not_divide": (("train.mini_batches=3",), ("train.mini_batches", "16")),
    "negative_lr": (("train.lr=-1",), ("train", "lr")),
    "min_above_max_tokens": (("rollout.min_new_tokens=99",), ("rollout", "min_new_tokens")),
    "dual_clip_below_one": (("train.policy_loss.dual_clip=0.5",), ("train", "dual_clip")),
    "unknown_policy_loss_setting": (
        ("train.policy_loss=sapo", "train.policy_loss.tau_po=1.2"),
        ("train.policy_loss.tau_po", "train.policy_loss.tau_pos"),
    ),
    "moved_variant_setting": (
        ("train.sapo_tau_pos=1.2",),
        ("train.sapo_tau_pos", "train.policy_loss.tau_pos", "train.policy_loss.type=sapo"),
    ),
    "override_without_equals": (("train.lr",), ("train.lr",)),
    "kl_on_without_coef": (("kl.mode=loss",), ("kl", "coef")),
    "reward_weights_length": (("reward.weights=[1.0,2.0]",), ("reward", "weights")),
    "missing_model_dir": (("model.path=/nonexistent/model",), ("model.path", "/nonexistent/model")),
    "unknown_reward": (("reward.functions=[nosuch]",), ("reward.functions", "nosuch")),
    "reward_import_fails": (
        ("reward.functions=[nosuch_mod:fn]",),
        ("reward.functions", "nosuch_mod:fn"),
    ),
    "reward_model_missing": (
        ("reward.functions=[{path: reward_model, model: {path: /nonexistent/rm}}]",),
        ("reward.functions", "/nonexistent/rm"),
    ),
    "reward_model_not_a_classifier": (
        ("reward.functions=[{path: reward_model, model: {path: 'builtin:tiny'}}]",),
        ("reward.functions", "builtin:tiny", "sequence-classification"),
    ),
    "ema_on_deepspeed": (
        ("train.backend=deepspeed", "train.ema_decay=0.9"),
        ("train", "ema_decay", "deepspeed"),
    ),
    "ema_decay_one": (("train.ema_decay=1.0",), ("train", "ema_decay", "[0, 1)")),
    "prompt_too_long": (("data.max_prompt_tokens=5",), ("data.max_prompt_tokens", "row 0")),
    "bad_generator_kwargs": (("data.reasoning_gym.kwargs.min_terms=0",), ("data.reasoning_gym",)),
    "unknown_zero_stage": (
        ("train.backend=deepspeed", "train.zero_stage=4"),
        ("train", "zero_stage", "2 or 3"),
    ),
    "zero_stage_without_deepspeed": (("train.zero_stage=3",), ("zero_stage=3", "deepspeed")),
    "zero2_cannot_offload_params": (
        ("train.backend=deepspeed", "train.cpu_offload=all"),
        ("cpu_offload=all", "ZeRO-2", "zero_stage=3"),
    ),
    "offload_on_single": (("train.cpu_offload=optimizer",), ("cpu_offload", "backend=single")),
    "sp_without_fsdp2": (("train.sp_size=2",), ("train", "sp_size=2", "backend=fsdp2")),
    "sp_with_packing": (
        ("train.backend=fsdp2", "train.sp_size=2"),
        ("sp_size=2", "packing=true", "train.packing=false"),
    ),
    "sp_not_dividing_the_world": (
        ("train.backend=fsdp2", "train.sp_size=2", "train.packing=false"),
        ("train.sp_size=2", "world size 1"),
    ),
    "sp_with_a_critic": (
        (
            "train.backend=fsdp2",
            "train.sp_size=2",
            "train.packing=false",
            "advantage.estimator=gae",
            "critic.lr=1e-5",
        ),
        ("train.sp_size=2", "critic"),
    ),
    "fsdp2_optimizer_only_offload": (
        ("train.backend=fsdp2", "train.cpu_offload=optimizer"),
        ("cpu_offload=optimizer", "fsdp2", "all"),
    ),
    "offload_between_stages_under_cpu_offload": (
        ("train.backend=fsdp2", "train.cpu_offload=all", "train.offload_between_stages=true"),
        ("train", "offload_between_stages", "cpu_offload=all"),
    ),
    "unknown_backend": (("train.backend=megatron",), ("train.backend", "deepspeed")),
    "gae_without_critic": (("advantage.estimator=gae",), ("advantage.estimator=gae", "critic")),
    "correction_on_rollout_logprobs": (
        ("train.rollout_correction=tis", "train.old_logprobs=rollout"),
        ("train.rollout_correction", "train.old_logprobs=actor"),
    ),
    "disk_weight_sync_on_hf": (
        ("rollout.inference.weight_sync=disk",),
        ("rollout", "weight_sync=disk", "hf"),
    ),
    "negative_staleness": (("rollout.staleness=-1",), ("rollout", "staleness must be >= 0")),
    "overlap_without_staleness": (("rollout.overlap=true",), ("rollout", "overlap", "staleness")),
    "overlap_on_vllm": (
        ("rollout.overlap=true", "rollout.staleness=1", "rollout.engine=vllm"),
        ("rollout", "overlap", "engine=hf"),
    ),
    # Separate rollout ranks: one rank is the whole local job, so none would train.
    "rollout_ranks_take_every_rank": (
        ("launch.rollout_ranks=1",),
        ("launch.rollout_ranks=1", "no training rank", "1 ranks"),
    ),
    "rollout_ranks_with_overlap": (
        ("launch.rollout_ranks=1", "rollout.staleness=1", "rollout.overlap=true"),
        ("launch.rollout_ranks", "rollout.overlap", "not built"),
    ),
    "rollout_ranks_and_nodes": (
        ("launch.rollout_ranks=1", "launch.rollout_nodes=1"),
        ("launch", "rollout_ranks", "rollout_nodes", "not both"),
    ),
    "group_estimator_with_one_sample": (("rollout.n=1",), ("rollout.n=1", "grpo")),
    "sequence_loss_needs_seq_mean": (
        ("train.policy_loss=geo_mean",),
        ("geo_mean", "seq-mean-token-mean"),
    ),
    "overlong_without_buffer": (
        ("reward.functions=[accuracy,overlong]",),
        ("reward", "overlong_buffer"),
    ),
    "overlong_buffer_past_budget": (
        ("reward.functions=[accuracy,overlong]", "reward.overlong_buffer=999"),
        ("reward.overlong_buffer=999", "rollout.max_new_tokens"),
    ),
    "entropy_mask_out_of_range": (("train.entropy_mask_top=0",), ("train", "entropy_mask_top")),
    "ptx_negative_coef": (("train.ptx.coef=-0.5",), ("train.ptx", "coef", ">= 0")),
    "ptx_without_data": (("train.ptx.coef=0.1",), ("train.ptx", "coef=0.1", "data")),
    # DAPO: 1 round of 2 prompts can never fill a batch of 4 groups.
    "dynamic_sampling_impossible_bound": (
        (
            "rollout.dynamic_sampling.enabled=true",
            "rollout.dynamic_sampling.max_rounds=1",
            "rollout.dynamic_sampling.prompts_per_round=2",
        ),
        ("rollout.dynamic_sampling.max_rounds=1", "prompts_per_round=2", "prompts_per_step=4"),
    ),
    "dynamic_sampling_unknown_metric": (
        ("rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.metric=accuracy"),
        ("rollout.dynamic_sampling.metric='accuracy'", "dense_even_tokens"),
    ),
    "dynamic_sampling_round_past_the_data": (
        ("rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.prompts_per_round=40"),
        ("rollout.dynamic_sampling.prompts_per_round=40", "20 training prompts"),
    ),
    "step_past_the_data": (("data.prompts_per_step=24",), ("data.prompts_per_step=24", "20")),
}


@pytest.mark.parametrize("case", sorted(FRESH_CASES))
def test_bad_fresh_input(case: str, tmp_path: Path) -> None:
    overrides, needles = FRESH_CASES[case]
    _fresh(tmp_path, *overrides, needles=needles)


@pytest.mark.tier1
def test_malformed_yaml(tmp_path: Path) -> None:
    cfg = _write(tmp_path, "bad.yaml", "train:\n  lr: 1e-5\n   micro_batch_size: 4\n")
    _fresh(tmp_path, config=cfg, needles=("bad.yaml", "line 3"))


def test_missing_config_file(tmp_path: Path) -> None:
    _fresh(tmp_path, config=tmp_path / "absent.yaml", needles=("absent.yaml",))


@pytest.mark.tier1
def test_missing_data_column(tmp_path: Path) -> None:
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"question": ["1+1?", "2+2?"], "answer": ["2", "4"]}), data)
    _fresh(
        tmp_path,
        "data.source=file",
        f"data.file.path={data}",
        "data.prompts_per_step=2",
        needles=("data.file.prompt_column", "'prompt'"),
    )


#: PTX file problems: (overrides beyond the file's, text naming the culprit).
PTX_CASES = {
    "missing_file": (("train.ptx.data.path=/nonexistent/ptx.jsonl",), ("train.ptx.data.path",)),
    "missing_column": (
        ("train.ptx.data.answer_column=completion",),
        ("train.ptx.data.answer_column", "'completion'"),
    ),
    "batch_larger_than_data": (("train.ptx.batch_size=3",), ("train.ptx.batch_size", "2 examples")),
}


@pytest.mark.parametrize("case", sorted(PTX_CASES))
def test_bad_ptx_data(case: str, tmp_path: Path) -> None:
    data = tmp_path / "ptx.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    overrides, needles = PTX_CASES[case]
    ptx = ("train.ptx.coef=0.1", f"train.ptx.data={{path: '{data}'}}", "train.ptx.batch_size=2")
    _fresh(tmp_path, *ptx, *overrides, needles=needles)


def test_missing_data_file(tmp_path: Path) -> None:
    _fresh(
        tmp_path,
        "data.source=file",
        f"data.file.path={tmp_path / 'nope.jsonl'}",
        needles=("data.file.path", "nope.jsonl"),
    )


def test_resume_with_changed_config(base_run: Path, tmp_path: Path) -> None:
    _resumed(
        base_run, tmp_path, "rollout.n=8", needles=("rollout.n", "--allow-fingerprint-mismatch")
    )


def test_resume_with_changed_staleness(base_run: Path, tmp_path: Path) -> None:
    """It changes which weights sample every later step (docs/async.md)."""
    _resumed(
        base_run,
        tmp_path,
        "rollout.staleness=1",
        needles=("rollout.staleness", "--allow-fingerprint-mismatch"),
    )


def test_resume_below_committed_steps(base_run: Path, tmp_path: Path) -> None:
    _resumed(base_run, tmp_path, "total_steps=1", needles=("total_steps", "2 steps"))


def test_resume_with_changed_model(base_run: Path, tmp_path: Path) -> None:
    def swap_model(run: Path) -> None:
        import json

        info = json.loads((run / "run.json").read_text())
        info["model_fingerprint"] = "0" * 64
        (run / "run.json").write_text(json.dumps(info))

    _resumed(base_run, tmp_path, "total_steps=3", mutate=swap_model, needles=("model", "differs"))


@pytest.mark.parametrize(
    ("function", "needles"),
    [
        ("bad_rewards:boom", ("boom",)),
        ("reward_fns:not_a_number", ("reward_fns:not_a_number", "returned str 'high'")),
    ],
    ids=["raises", "wrong_return_type"],
)
def test_reward_function_that_fails(
    function: str, needles: tuple[str, ...], base_run: Path, tmp_path: Path
) -> None:
    _resumed(
        base_run,
        tmp_path,
        "total_steps=3",
        f"reward.functions=[{function}]",
        extra=("--allow-fingerprint-mismatch",),
        env={"PYTHONPATH": f"{TESTS}:{ROOT}"},
        needles=(*needles, "prompt_id", "sample_idx", "step 3"),
        accepted=True,
    )


def test_corrupt_older_file_that_replay_reads_refuses(base_run: Path, tmp_path: Path) -> None:
    def corrupt(run: Path) -> None:
        # Without the step-2 checkpoint the restart replays steps 1-2 from their advantage rows.
        shutil.rmtree(run / "checkpoints" / "step=2")
        shard = run / "stages" / "step=1" / "advantage" / "part-r0.parquet"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    _resumed(
        base_run,
        tmp_path,
        "total_steps=3",
        mutate=corrupt,
        needles=("step=1/advantage/part-r0.parquet", "--repair"),
    )


def test_resume_that_would_stretch_a_decaying_lr_schedule(tmp_path: Path) -> None:
    """A cosine schedule spans total_steps, so extending such a run would change every
    update's LR (replays included): refused before anything is written."""
    run = tmp_path / "cos"
    # Killed right after its first commit: a directory that committed nothing would take
    # any config as a new run.
    made = submit(
        run,
        "total_steps=2",
        "train.lr_schedule=cosine",
        env={"RFTPIPE_FAULT": "stage_after_commit"},
    )
    assert made.returncode != 0 and (run / "stages/step=1/rollout/MANIFEST.json").exists()
    before = (run / "config.yaml").read_bytes()
    res = submit(run, "total_steps=4", config=None, extra=("--create-only",))
    _expect_error(res, "total_steps", "lr_schedule=cosine", "2 -> 4")
    assert (run / "config.yaml").read_bytes() == before
    assert not (run / "config.next.yaml").exists()


def test_worker_refuses_a_stretched_lr_schedule_too(tmp_path: Path) -> None:
    """The same rule at the worker, which every launch path starts (a plain sbatch of
    rftpipe.sbatch, submitit, the local launcher): a pending config with another
    total_steps is refused before anything runs, whoever wrote it."""
    run = tmp_path / "cos"
    made = submit(run, "total_steps=2", "train.lr_schedule=cosine", extra=("--create-only",))
    assert made.returncode == 0, made.stderr
    before = (run / "config.yaml").read_bytes()
    assert b"\ntotal_steps: 2\n" in before
    (run / "config.next.yaml").write_bytes(
        before.replace(b"\ntotal_steps: 2\n", b"\ntotal_steps: 4\n")
    )
    res = subprocess.run(
        [sys.executable, "-m", "rftpipe.run.worker", str(run)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    _expect_error(res, "total_steps", "train.lr_schedule=cosine", "2 -> 4")
    assert (run / "config.yaml").read_bytes() == before
    assert not (run / "stages").exists()


def _without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment where `package` fails to import, standing in for a missing one."""
    shadow = tmp_path / "shadow" / package
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError('No module named {package}')\n")
    return {"PYTHONPATH": f"{shadow.parent}:{ROOT}"}


def test_deepspeed_not_installed(tmp_path: Path) -> None:
    _fresh(
        tmp_path,
        "train.backend=deepspeed",
        env=_without(tmp_path, "deepspeed"),
        needles=("train.backend=deepspeed", "DS_BUILD_OPS=0", "[deepspeed]"),
    )


def test_vllm_not_installed(tmp_path: Path) -> None:
    _fresh(
        tmp_path,
        "rollout.engine=vllm",
        env=_without(tmp_path, "vllm"),
        needles=("rollout.engine=vllm", "tools/setup.sh", ".[vllm]", "rollout.engine=hf"),
    )
    assert not (tmp_path / "new" / "run.json").exists()


@NEEDS_VLLM
def test_vllm_cannot_load_architecture(tmp_path: Path) -> None:
    """A causal LM transformers loads but vLLM does not (XLNet): refused before any write."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    from rftpipe.engines.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model_dir = tmp_path / "xlnet"
    cfg = XLNetConfig(
        vocab_size=len(tok), d_model=32, n_layer=1, n_head=2, d_inner=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    XLNetLMHeadModel(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    _fresh(
        tmp_path,
        "rollout.engine=vllm",
        f"model.path={model_dir}",
        needles=("model.path", "XLNetLMHeadModel", "rollout.engine=hf"),
    )
    assert not (tmp_path / "new" / "run.json").exists()


def _verl_parquet(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _verl_row(i: int, source: str = "openai/gsm8k") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{i} + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }


def test_dataset_missing_the_routed_column(tmp_path: Path) -> None:
    rows = [{k: v for k, v in _verl_row(i).items() if k != "data_source"} for i in range(4)]
    path = _verl_parquet(tmp_path, rows)
    _fresh(
        tmp_path,
        "data.source=datasets",
        f"data.datasets=[{{path: {path}, format: verl}}]",
        needles=("data.datasets[0].data_source_column", "'data_source'", "verl.parquet"),
    )


def test_data_source_no_reward_function_covers(tmp_path: Path) -> None:
    path = _verl_parquet(tmp_path, [_verl_row(0), _verl_row(1), _verl_row(2, "math"), _verl_row(3)])
    _fresh(
        tmp_path,
        "data.source=datasets",
        f"data.datasets=[{{path: {path}, format: verl}}]",
        "reward.functions=[{path: dense_even_tokens, data_sources: [openai/gsm8k]}]",
        needles=("reward.functions", "no function scores data source 'math'"),
    )


def test_malformed_chat_messages(tmp_path: Path) -> None:
    rows = [_verl_row(i) for i in range(4)]
    rows[2]["prompt"] = [{"role": "user", "content": ""}]
    path = _verl_parquet(tmp_path, rows)
    _fresh(
        tmp_path,
        "data.source=datasets",
        f"data.datasets=[{{path: {path}, format: verl}}]",
        needles=("data.datasets[0]", "row 2", "malformed chat messages", "'prompt'"),
    )


def test_math_verify_not_installed(tmp_path: Path) -> None:
    _fresh(
        tmp_path,
        "reward.functions=[math_verify]",
        env=_without(tmp_path, "math_verify"),
        needles=("reward.functions", "'math_verify'", "pip install math-verify"),
    )


def test_packing_with_a_sliding_window_model(tmp_path: Path) -> None:
    """train.packing (on by default) with a model whose sliding window a block-diagonal
    mask would drop: refused when the engine is built, before any stage commits."""
    from transformers import MistralConfig, MistralForCausalLM

    from rftpipe.engines.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model_dir = tmp_path / "mistral"
    cfg = MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    MistralForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    _fresh(
        tmp_path,
        "train.backend=fsdp2",
        f"model.path={model_dir}",
        needles=("train.packing=true", "sliding-window", "train.packing=false"),
    )


ENV_PATH = {"PYTHONPATH": str(TESTS)}
"""The runs import the test environments (tests/envs_toy.py)."""

ENV_CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "env_path_that_does_not_import": (
        ("rollout.env.path=no_such_pkg.envs:Env",),
        ("rollout.env.path", "no_such_pkg"),
    ),
    "env_class_without_step": (
        ("rollout.env.path=envs_toy:Task",),
        ("rollout.env.path", "envs_toy:Task", "step"),
    ),
    "env_max_turns_below_1": (
        ("rollout.env.path=envs_toy:EvenChars", "rollout.env.max_turns=0"),
        ("rollout.env", "max_turns"),
    ),
    "env_unknown_tool_parser": (
        ("rollout.env.path=envs_toy:EvenChars", "rollout.env.tool_parser=xml"),
        ("rollout.env.tool_parser", "hermes"),
    ),
    "env_step_returning_the_wrong_types": (
        ("rollout.env.path=envs_toy:WrongTypes", "reward.functions=[]"),
        ("rollout.env.path", "WrongTypes.step", "reward"),
    ),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_bad_environment_input(case: str, tmp_path: Path) -> None:
    overrides, needles = ENV_CASES[case]
    run = tmp_path / "new"
    res = submit(run, *overrides, env=ENV_PATH)
    _expect_error(res, *needles)
    # Nothing was committed (the rollout stage of step 1 never committed).
    assert not (run / "stages").exists() or not any((run / "stages").rglob("MANIFEST.json"))
