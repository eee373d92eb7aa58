"""Multi-turn episodes (`rollout.env`, issue 24): token-exact sequences on the tiny model
through the real HF engine and chat template; the loss mask; budgets; errors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from envs_toy import (
    Drifts,
    EndsFourWays,
    EvenChars,
    HangsOnBadAnswer,
    Raises,
    ReadsAnswer,
    Remembers,
    ResetsBadly,
    StopsOnA,
    WrongTypes,
)
from helpers import (
    ROOT,
    TESTS_ON_PATH,
    OneRankLog,
    each_fault_stops_then_resumes,
    episode_prompts,
    events,
    final_weights,
    kill_mid_turn_and_resume,
    submit,
    trajectories,
)

from rftpipe.config.schema import EnvConfig, RolloutConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.envs.base import Environment, Task
from rftpipe.envs.pool import EnvPool
from rftpipe.errors import UserError
from rftpipe.inspect.episodes import episode_turns
from rftpipe.stages import episodes, rollout
from rftpipe.storage.episode_stats import EpisodeCounts


@pytest.fixture(scope="module")
def tiny():
    path = prepare_tiny()
    torch.manual_seed(0)
    return load_causal_lm(path, "float32"), load_tokenizer(path)


def _run(
    tiny, make_env: Callable[[], Environment], env: EnvConfig, n: int = 2, max_new: int = 6
) -> list[episodes.Episode]:
    model, tok = tiny
    cfg = RolloutConfig(n=n, max_new_tokens=max_new, env=env)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    return _episodes(cfg, engine, tok, make_env, episode_prompts(tok))


def _episodes(cfg, engine, tok, make_env, prompts) -> list[episodes.Episode]:
    inp = episodes.EpisodeInputs(
        cfg=cfg, env_cfg=cfg.env, run_seed=0, step=1, stage="rollout", calls=[prompts]
    )
    return episodes.run(inp, engine, tok, make_env, OneRankLog()).episodes


ENV = EnvConfig(path="envs_toy:EvenChars", max_turns=3, max_total_tokens=200)


def test_an_episode_is_one_token_sequence_with_the_environment_tokens_masked(tiny) -> None:
    model, tok = tiny
    made: list[EvenChars] = []

    def make() -> EvenChars:
        made.append(EvenChars())
        return made[-1]

    eps = _run(tiny, make, ENV)
    assert len(eps) == 4 and all(env.closed for env in made)
    for e in eps:
        assert e.status == "max_turns" and len(e.turn_offsets) == 3
        assert len(e.response) == len(e.logprobs) == len(e.loss_mask)
        assert e.prompt_ids == list(e.prompt.token_ids)  # reset kept the dataset prompt
        # Per turn: the model's tokens (mask 1, up to max_new_tokens), then the
        # environment's (mask 0, logprob 0), which decode to the template's text around
        # the observation.
        bounds = [*e.turn_offsets, len(e.response)]
        for t in range(3):
            span = e.loss_mask[bounds[t] : bounds[t + 1]]
            model_len = span.count(1)
            assert 1 <= model_len <= 6 and span == [1] * model_len + [0] * (len(span) - model_len)
            env_ids = e.response[bounds[t] + model_len : bounds[t + 1]]
            assert all(lp == 0.0 for lp in e.logprobs[bounds[t] + model_len : bounds[t + 1]])
            if t < 2:
                text = tok.decode(env_ids)
                assert f"(turn {t + 1}: " in text and text.endswith("<|im_start|>assistant\n")
            else:
                assert env_ids == []  # the last turn ends the episode: no observation
        # The conversation: the prompt's messages, then assistant/user alternating.
        roles = [m["role"] for m in e.messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
        assert e.turn_rewards and all(0.0 <= r <= 1.0 for r in e.turn_rewards)
        info = [json.loads(i) for i in e.turn_infos]
        assert [i["turn"] for i in info] == [1, 2, 3]
    # Different samples of a prompt differ (their own seeds per turn).
    assert eps[0].response != eps[1].response


@pytest.mark.kernels
def test_model_token_logprobs_equal_the_trainer_over_the_whole_sequence(tiny) -> None:
    model, tok = tiny
    eps = _run(tiny, EvenChars, ENV)
    trainer = SingleDeviceEngine(model, TrainConfig(logprob_chunk_size=0), Dist())
    lps = trainer.compute_logprobs([e.prompt_ids for e in eps], [e.response for e in eps], 1.0)
    worst = 0.0
    for e, lp in zip(eps, lps, strict=True):
        for got, want, m in zip(e.logprobs, lp, e.loss_mask, strict=True):
            if m:
                worst = max(worst, abs(got - want))
    assert worst < 1e-4, worst


def test_episodes_are_reproducible_from_their_seeds(tiny) -> None:
    a = _run(tiny, EvenChars, ENV)
    b = _run(tiny, EvenChars, ENV)
    assert [e.response for e in a] == [e.response for e in b]
    assert [e.logprobs for e in a] == [e.logprobs for e in b]


def test_done_ends_an_episode_and_the_budget_truncates(tiny) -> None:
    stops = _run(tiny, StopsOnA, EnvConfig(path="envs_toy:StopsOnA", max_turns=6))
    assert all(e.status in ("done", "max_turns") for e in stops)
    for e in stops:
        if e.status == "done":
            assert e.turn_rewards[-1] == 1.0 and e.loss_mask[-1] == 1  # nothing after it
    tight = EnvConfig(path="envs_toy:EvenChars", max_turns=5, max_total_tokens=20)
    for e in _run(tiny, EvenChars, tight):
        assert e.status == "truncated" and len(e.response) <= 20


def test_environment_failures_follow_the_declared_policy(tiny) -> None:
    with pytest.raises(UserError) as err:
        _run(tiny, Raises, EnvConfig(path="envs_toy:Raises", max_turns=3))
    msg = str(err.value)
    assert "\n" not in msg and "envs_toy:Raises" in msg and "turn 1" in msg and "broke" in msg
    ended = _run(
        tiny, Raises, EnvConfig(path="envs_toy:Raises", max_turns=3, on_error="end_episode")
    )
    assert all(e.status == "error" and len(e.turn_offsets) == 2 for e in ended)
    assert all("broke" in json.loads(e.turn_infos[-1])["error"] for e in ended)
    with pytest.raises(UserError, match="reward") as err:
        _run(tiny, WrongTypes, EnvConfig(path="envs_toy:WrongTypes"))
    assert "\n" not in str(err.value) and "WrongTypes" in str(err.value)


def _with_answers(tok) -> list:
    """`episode_prompts` whose answers are "7" then "seven": `envs_toy.ReadsAnswer` cannot
    read the second prompt's (prompt_id 11) and `HangsOnBadAnswer` hangs on it."""
    a, b = episode_prompts(tok)
    return [dataclasses.replace(a, answer="7"), dataclasses.replace(b, answer="seven")]


def _reset_failures(tiny, env: EnvConfig, make_env, n: int) -> list[episodes.Episode]:
    model, tok = tiny
    cfg = RolloutConfig(n=n, max_new_tokens=6, env=env)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    return _episodes(cfg, engine, tok, make_env, _with_answers(tok))


@pytest.mark.serial  # a 2 s environment timeout: a loaded machine could trip it
@pytest.mark.parametrize(
    ("cls", "workers", "error"),
    [
        (ReadsAnswer, 0, "ValueError: invalid literal for int()"),  # the raw exception
        (ReadsAnswer, 1, "ValueError: invalid literal for int()"),  # EnvFailed from a worker
        (HangsOnBadAnswer, 1, "EnvTimeout: reset took over rollout.env.timeout_s=2"),
        (ResetsBadly, 0, "ResetsBadly.reset returned info str 'none', not a dict"),
    ],
)
def test_a_failing_reset_follows_the_declared_policy(
    tiny, monkeypatch: pytest.MonkeyPatch, cls: type, workers: int, error: str
) -> None:
    """A reset that raises, or (in a worker) outlives `timeout_s`, is handled as a failing
    step is: `fail` is one line naming the environment and the sample at turn 0;
    `end_episode` ends that episode before its first turn, with the task's templated
    prompt, no response, reward 0 and the error in `turn_infos`, while the others run."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # the workers import envs_toy
    n = 1 if cls is HangsOnBadAnswer else 2  # each hang costs a timeout
    path = f"envs_toy:{cls.__name__}"
    for on_error in ("fail", "end_episode"):
        env = EnvConfig(
            path=path,
            max_turns=2,
            max_total_tokens=200,
            on_error=on_error,
            workers=workers,
            timeout_s=2,
        )
        pool = EnvPool(env, workers, env.timeout_s) if workers else None
        try:
            make = pool.make if pool else cls
            if on_error == "fail":
                with pytest.raises(UserError) as err:
                    _reset_failures(tiny, env, make, n)
                msg = str(err.value)
                assert "\n" not in msg and cls.__name__ in msg and error in msg, msg
                assert "step 1 prompt_id 11 sample_idx 0 turn 0" in msg, msg
                if cls is not ResetsBadly:  # its check's own line names the class
                    assert f"{path} failed on" in msg and "turn 0 (reset)" in msg, msg
                continue
            eps = _reset_failures(tiny, env, make, n)
        finally:
            if pool:
                pool.close()
        assert len(eps) == 2 * n
        for e in eps[:n]:
            assert e.status == "max_turns" and len(e.turn_offsets) == 2
        for e in eps[n:]:
            assert e.status == "error" and (e.prompt.prompt_id, e.prompt.answer) == (11, "seven")
            assert e.prompt_ids == list(e.prompt.token_ids)  # the task's templated prompt
            assert e.messages == [dict(m) for m in e.prompt.messages]
            assert e.response == e.logprobs == e.loss_mask == e.turn_offsets == []
            assert e.turn_rewards == [] and len(e.turn_infos) == 1
            assert error in json.loads(e.turn_infos[0])["error"]
            row = episodes.turn_columns(e)
            assert (row["num_turns"], row["env_reward"], row["episode_status"]) == (0, 0.0, "error")


def test_skyrl_episodes_the_rollout_cuts_end_as_max_turns_not_done(tiny) -> None:
    """skyrl:gsm8k_multi_turn is handed our max_turns and ends every episode on its last
    turn itself; a model that is never right (the random tiny model) ends every episode as
    `max_turns`, none as `done` (`episode/done_frac` was 1.0)."""
    model, tok = tiny
    env = EnvConfig(path="skyrl:gsm8k_multi_turn", max_turns=2, max_total_tokens=200, workers=0)
    cfg = RolloutConfig(n=2, max_new_tokens=6, env=env)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts = [dataclasses.replace(p, answer="4") for p in episode_prompts(tok)]
    eps = _episodes(cfg, engine, tok, rollout.env_maker(env), prompts)
    assert all(len(e.turn_offsets) == 2 and max(e.turn_rewards) < 1.0 for e in eps)
    inp = rollout.RolloutInputs(step=1, rank=0, run_seed=0, prompts=[])
    metrics = EpisodeCounts.of(rollout.episode_rows(inp, engine, tok, eps)).metrics()
    assert (metrics["episode/max_turns_frac"], metrics["episode/done_frac"]) == (1.0, 0.0)


def test_an_unstable_template_prefix_is_refused(tiny) -> None:
    model, tok = tiny
    shifty = load_tokenizer(prepare_tiny())
    # Renders the number of messages first: every added turn rewrites the start.
    shifty.chat_template = "{{ messages|length }}" + (tok.chat_template or "")
    cfg = RolloutConfig(n=1, max_new_tokens=4, env=ENV)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    with pytest.raises(UserError, match="prefix is unstable") as err:
        _episodes(cfg, engine, shifty, EvenChars, episode_prompts(tok, 1))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Through the real entry point
# ---------------------------------------------------------------------------------------------

RUN = (
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    # The environment's reward is the whole return.
    "reward.functions=[]",
    "total_steps=12",
)
# The runs import the environment from tests/.
ENV_PATH = TESTS_ON_PATH


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("episodes") / "ref"
    out = submit(run, *RUN, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.mark.slow
def test_a_multi_turn_run_learns_from_the_environment_reward(reference: Path) -> None:
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert [r["rollout/reward_env"] for r in rows] == rewards  # nothing else scores
    # Seconds waiting for environments (two worker processes by default) are recorded.
    assert all(r["perf/env_s"] > 0 for r in rows)
    # At seed 0 (2026-11-25): 0.557 over steps 1-3, 0.761 over steps 10-12.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    t = trajectories(reference).to_pandas()  # pandas reads version 2 as it is
    assert set(t["num_turns"]) <= {1, 2} and (t["num_turns"] == 2).any()
    for _, r in t.iterrows():
        mask = list(r["loss_mask"])
        assert len(mask) == len(r["response_token_ids"]) == len(r["advantages"])
        # Environment tokens carry no advantage and no sampling logprob.
        assert all(a == 0.0 for a, m in zip(r["advantages"], mask, strict=True) if not m)
        assert all(lp == 0.0 for lp, m in zip(r["logprobs"], mask, strict=True) if not m)
        assert (
            r["reward"] == pytest.approx(r["env_reward"]) == pytest.approx(sum(r["turn_rewards"]))
        )
        assert json.loads(r["messages"])[-1]["role"] == "assistant"
    shard = next((reference / "stages" / "step=1" / "rollout").glob("*.parquet"))
    assert pq.read_metadata(shard).metadata[b"rftpipe.schema_version"] == b"2"


@pytest.mark.slow
def test_sigkill_mid_turn_and_around_turn_commits_resumes_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    """Killed in the middle of turn 2 of step 3 (4 calls x 2 turns a step), after step 3's
    second turn before its commit, and right after a later turn's commit; the resumed run
    equals the uninterrupted one, and no committed turn was generated again."""
    run = tmp_path / "killed"
    kills = (
        ("episode_mid_turn", 21),
        ("episode_before_turn_commit", 1),
        ("stage_after_commit", 21),
    )
    for point, skip in kills:
        env = {**ENV_PATH, "RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(skip)}
        assert submit(run, *RUN, env=env).returncode != 0
    out = submit(run, *RUN, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    log = events(run)
    assert [e["point"] for e in log if e["event"] == "fault"] == [p for p, _ in kills]
    resumed = [(e["step"], e["turns"]) for e in log if e["event"] == "resume_turns"]
    # The last kill came right after some later step's first turn committed.
    assert len(resumed) == 2 and resumed[0] == (3, 1) and resumed[1][0] > 3, resumed
    committed: set[tuple[int, str]] = set()
    for e in log:
        if e["event"] == "commit":
            committed.add((e["step"], e["stage"]))
        elif e["event"] == "turn_begin":
            turn_dir = f"{e['stage']}.t{e['turn'] + 1}"
            assert (e["step"], turn_dir) not in committed, f"step {e['step']} {turn_dir} redone"
    assert trajectories(run).equals(trajectories(reference))
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Only the newest turn of a step is kept.
    assert sorted(d.name for d in (run / "stages" / "step=5").iterdir()) == [
        "advantage",
        "rollout",
        "rollout.t2",
        "score",
        "sync",
        "train",
    ]


@pytest.mark.slow
def test_sigkill_mid_turn_3_resumes_on_replayed_kv_caches_bitwise(tmp_path: Path) -> None:
    """Killed in the middle of step 2's third turn (after the second of its 4 calls): the
    resumed rollout rebuilds the HF loop's kept KV caches by replaying two committed turns
    (the kills above replay one), and the run is bitwise the uninterrupted one."""
    steps = (
        *RUN[:1],
        "rollout.env.max_turns=3",
        "rollout.env.max_total_tokens=200",
        "reward.functions=[]",
        "total_steps=2",
    )
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert submit(ref, *steps, env=ENV_PATH).returncode == 0
    # Step 1 is 3 turns of 4 calls; step 2's third turn is hit 21 after 8 more.
    kill_mid_turn_and_resume(ref, run, steps, ENV_PATH, skip=21, resumed=[(2, 2)])


BAD_ANSWER = "ValueError: invalid literal for int() with base 10: 'seven'"
"""What `envs_toy.ReadsAnswer.reset` raises on `_guess_run`'s second prompt."""


def _guess_run(tmp_path: Path, *overrides: str) -> tuple[str, ...]:
    """A run of `envs_toy.ReadsAnswer` on four prompts, the second's (prompt_id 1) answer
    "seven", which the environment cannot read at reset."""
    data = tmp_path / "guess.jsonl"
    answers = ["3", "seven", "5", "8"]
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Guess my number, {i}.", "answer": a}) + "\n"
            for i, a in enumerate(answers)
        )
    )
    return (
        "rollout.env.path=envs_toy:ReadsAnswer",
        *RUN[1:-1],
        "data.source=file",
        f"data.file.path={data}",
        *overrides,
    )


@pytest.mark.slow
def test_a_failing_reset_in_a_run_exits_2_naming_the_sample(tmp_path: Path) -> None:
    """In the rollout process (`workers=0`, where the raw exception arrives), under the
    default `on_error=fail`: one line naming the environment and the sample, exit 2."""
    run = tmp_path / "fail"
    out = submit(run, *_guess_run(tmp_path, "rollout.env.workers=0", "total_steps=1"), env=ENV_PATH)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
    where = "envs_toy:ReadsAnswer failed on step 1 prompt_id 1 sample_idx 0 turn 0 (reset)"
    assert where in lines[0] and BAD_ANSWER in lines[0], lines[0]
    assert not (run / "stages" / "step=1" / "rollout").exists()


@pytest.mark.slow
def test_a_failing_reset_ends_its_episodes_and_the_run_resumes_bitwise(tmp_path: Path) -> None:
    """`on_error=end_episode` with environment workers: the row whose reset failed is a
    well-formed trajectory row (the templated prompt, no response, reward and advantages 0,
    the error in `turn_infos`); the run trains on the others, and killed in step 2's
    second turn it resumes (the ended rows restored from the committed turn) to bitwise
    the uninterrupted run."""
    steps = _guess_run(tmp_path, "rollout.env.on_error=end_episode", "total_steps=2")
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = submit(ref, *steps, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(ref).to_pandas()
    assert len(t) == 2 * 4 * 4
    for _, r in t.iterrows():
        if r["prompt_id"] != 1:
            assert r["episode_status"] == "max_turns" and r["num_turns"] == 2
            continue
        assert r["episode_status"] == "error" and r["num_turns"] == 0
        assert "Guess my number, 1." in r["prompt"] and len(r["prompt_token_ids"]) > 0
        assert r["response"] == "" and len(r["response_token_ids"]) == 0
        assert len(r["loss_mask"]) == len(r["advantages"]) == len(r["logprobs"]) == 0
        assert r["reward"] == r["env_reward"] == 0.0 and len(r["turn_rewards"]) == 0
        (info,) = r["turn_infos"]
        assert BAD_ANSWER in json.loads(info)["error"]
        # `rftpipe inspect RUN samples` shows the error as a turn without an action.
        _, (turn,) = episode_turns(r.to_dict())
        assert (turn.action, turn.model_tokens, turn.info) == (None, 0, info)
    metrics = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [m["episode/error_frac"] for m in metrics] == [0.25, 0.25]
    # 4 calls x 2 turns a step: the 13th mid-turn point is step 2's second turn.
    kill_mid_turn_and_resume(ref, run, steps, ENV_PATH, skip=12, resumed=[(2, 1)])


class _Snapshots:
    """A one-rank log keeping every episode's committed row after each turn."""

    def __init__(self, engine, tok) -> None:
        self.engine, self.tok = engine, tok
        self.rows: dict[int, dict[tuple[int, int], dict]] = {}
        self.kept: dict[int, set] = {}
        """The episodes whose KV caches the engine kept after each turn."""

    def commit(self, turns: int, finished) -> None:
        inp = rollout.RolloutInputs(step=1, rank=0, run_seed=0, prompts=[])
        table = rollout.episode_rows(inp, self.engine, self.tok, finished)
        self.rows[turns] = {(r["prompt_id"], r["sample_idx"]): r for r in table.to_pylist()}
        self.kept[turns] = set(self.engine._sessions)

    def any(self, flag: bool) -> bool:
        return flag


def _resumable(
    tiny, env: EnvConfig, make_env, resumed=None, turns: int = 0, calls=None, baseline=False
):
    model, tok = tiny
    cfg = RolloutConfig(n=2, max_new_tokens=6, env=env)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    inp = episodes.EpisodeInputs(
        cfg=cfg,
        env_cfg=env,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=calls or [episode_prompts(tok)],
        resumed=resumed or {},
        resumed_turns=turns,
        samples=[0, 1, 2] if baseline else None,
        greedy_samples=frozenset({2}) if baseline else frozenset(),
    )
    log = _Snapshots(engine, tok)
    return episodes.run(inp, engine, tok, make_env, log).episodes, log


def test_a_resumed_episode_continues_as_the_uninterrupted_one(tiny) -> None:
    full, log = _resumable(tiny, ENV, EvenChars)
    assert sorted(log.rows) == [1, 2, 3]
    assert all(r["episode_status"] is None for r in log.rows[1].values())
    again, _ = _resumable(tiny, ENV, EvenChars, log.rows[1], 1)
    for a, b in zip(full, again, strict=True):
        assert (a.response, a.logprobs, a.loss_mask) == (b.response, b.logprobs, b.loss_mask)
        assert (a.messages, a.turn_rewards, a.status) == (b.messages, b.turn_rewards, b.status)


def test_resumed_in_any_turn_the_kept_kv_caches_are_rebuilt_bitwise(tiny) -> None:
    """The HF loop keeps each episode's KV cache across its turns (`continues_turns`); a
    stage killed in turn 2, 3 or 4 resumes on caches rebuilt by replaying the committed
    turns, with episodes ending at different turns, in two calls: bit for bit the
    uninterrupted episodes. An episode's cache is freed when it ends."""
    env = EnvConfig(
        path="envs_toy:EndsFourWays", max_turns=4, max_total_tokens=200, on_error="end_episode"
    )
    prompts = episode_prompts(tiny[1], 3)
    calls = [prompts[:1], prompts[1:]]
    full, log = _resumable(tiny, env, EndsFourWays, calls=calls)
    turns = [len(e.turn_offsets) for e in full]
    # Some episodes ended early (their rows dropped from a call's cache), some ran on.
    assert min(turns) < 3 and max(turns) == 4, turns
    slot = {(e.prompt.prompt_id, e.sample_idx): e.slot for e in full}
    for t, rows in log.rows.items():
        assert log.kept[t] == {slot[k] for k, r in rows.items() if r["episode_status"] is None}
    assert log.kept[4] == set() and log.engine._sessions == {}
    for done in (1, 2, 3):
        again, _ = _resumable(tiny, env, EndsFourWays, log.rows[done], done, calls=calls)
        for a, b in zip(full, again, strict=True):
            assert (a.response, a.logprobs, a.loss_mask) == (b.response, b.logprobs, b.loss_mask)
            assert (a.messages, a.turn_rewards, a.status) == (b.messages, b.turn_rewards, b.status)


def test_kept_kv_caches_refuse_rows_that_do_not_continue_their_episodes(tiny) -> None:
    model, tok = tiny
    engine = HFGenerateEngine(model, RolloutConfig(n=1, env=ENV), tok.eos_token_id, 0)
    a, b = [5, 6, 7, 8], [9, 10, 11]
    first = engine.generate_rows([a, b], [1, 2], [3, 3], keys=["a", "b"])
    a2, b2 = a + first[0].tokens + [20], b + first[1].tokens + [21]
    for rows, keys, what in (
        ([a2, a2], ["a", "a"], "appears twice"),
        ([b2, a2], ["b", "a"], "order"),
        ([a2, b2], ["a", "c"], "not one earlier call's"),
        ([[5, 6, 99, 8, 1], b2], ["a", "b"], "row 0's prompt does not extend"),
        ([a, b2], ["a", "b"], "row 0's prompt does not extend"),  # adds nothing
    ):
        with pytest.raises(ValueError, match=what):
            engine.generate_rows(rows, [1, 2], [3, 3], keys=keys)
    engine.end_episodes(["a"])
    assert set(engine._sessions) == {"b"}  # "b" continues alone
    assert len(engine.generate_rows([b2], [2], [3], keys=["b"])[0].tokens) == 3
    engine.sleep()
    assert engine._sessions == {}


def test_an_environment_that_replays_differently_is_refused_unless_it_says_so(tiny) -> None:
    env = EnvConfig(path="envs_toy:Drifts", max_turns=3, max_total_tokens=200)
    _, log = _resumable(tiny, env, Drifts)
    with pytest.raises(UserError, match="replaying the recorded actions") as err:
        _resumable(tiny, env, Drifts, log.rows[1], 1)
    assert "\n" not in str(err.value) and "envs_toy:Drifts" in str(err.value)
    assert "replayable = False" in str(err.value)
    env = EnvConfig(path="envs_toy:Remembers", max_turns=3, max_total_tokens=200)
    _, log = _resumable(tiny, env, Remembers)
    Remembers.restored.clear()
    _resumable(tiny, env, Remembers, log.rows[1], 1)
    # Each running episode got its conversation so far: system, user, assistant, user.
    assert Remembers.restored and set(Remembers.restored) == {4}


def test_the_retry_example_environment() -> None:
    from rftpipe.envs.examples import RetryArithmetic

    env = RetryArithmetic()
    task = Task(prompt_id=1, messages=[{"role": "user", "content": "12 + 30"}], answer="42")
    assert env.reset(task, 0)[0] == task.messages
    wrong = env.step("It is 41.")
    assert (wrong.reward, wrong.done, wrong.info["guess"]) == (0.0, False, "41")
    assert (
        wrong.observations[0]["role"] == "user" and "not right" in wrong.observations[0]["content"]
    )
    right = env.step("42")
    assert (right.reward, right.done, right.observations) == (0.5, True, [])
    env.reset(task, 0)
    assert env.step("42.0").reward == 1.0
    with pytest.raises(ValueError, match="decay"):
        RetryArithmetic(decay=0)


def test_environments_in_worker_processes_give_the_same_episodes(tiny, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # the workers import envs_toy
    local = _run(tiny, EvenChars, ENV)
    pool = EnvPool(ENV, workers=2, timeout_s=60)
    try:
        remote = _run(tiny, pool.make, ENV)
    finally:
        pool.close()
    for a, b in zip(local, remote, strict=True):
        assert (a.response, a.messages, a.turn_rewards) == (b.response, b.messages, b.turn_rewards)
        assert a.turn_infos == b.turn_infos


@pytest.mark.slow
def test_two_ranks_killed_after_a_turn_commit_resume_bitwise(tmp_path: Path) -> None:
    """On 2 gloo ranks (FSDP2), killed right after step 2's first turn committed (each rank
    wrote its shard of the turn) and resumed: bitwise the uninterrupted 2-rank run."""
    steps = (*RUN[:-1], "total_steps=3", "train.backend=fsdp2")
    two = ("--tasks-per-node", "2")
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert submit(ref, *steps, env=ENV_PATH, extra=two).returncode == 0
    env = {**ENV_PATH, "RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "7"}
    assert submit(run, *steps, env=env, extra=two).returncode != 0
    out = submit(run, *steps, env=ENV_PATH, extra=two)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [(e["step"], e["turns"]) for e in events(run) if e["event"] == "resume_turns"] == [
        (2, 1),
        (2, 1),
    ]  # both ranks
    assert trajectories(run).equals(trajectories(ref))
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_dynamic_sampling_rounds_run_episodes(tmp_path: Path) -> None:
    """DAPO's rounds with turns: each generation round runs (and commits) its own episodes."""
    run = tmp_path / "rounds"
    out = submit(
        run,
        *RUN[:-1],
        "total_steps=2",
        "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.metric=reward",
        "rollout.dynamic_sampling.prompts_per_round=2",
        "rollout.dynamic_sampling.max_rounds=4",
        env=ENV_PATH,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = events(run)
    rounds = {e["stage"] for e in log if e["event"] == "turn_begin"}
    assert "rollout" in rounds and "rollout.r1" in rounds, rounds
    t = trajectories(run).to_pandas()
    assert len(t) == 2 * 4 * 4 and (t["num_turns"] >= 1).all()  # 4 varied groups a step


def test_a_prompt_twice_in_a_step_makes_two_kept_caches(tiny) -> None:
    """A step straddling an epoch boundary may hold a prompt twice, in two engine calls:
    each occurrence is its own episode to the engine (they once shared a cache name and the
    second call was refused, found on a GPU run with a 10-prompt file)."""
    model, tok = tiny
    cfg = RolloutConfig(n=2, max_new_tokens=6, env=ENV)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert engine.continues_turns
    prompt = episode_prompts(tok)[:1]
    inp = episodes.EpisodeInputs(
        cfg=cfg, env_cfg=ENV, run_seed=0, step=1, stage="rollout", calls=[prompt, prompt]
    )
    out = episodes.run(inp, engine, tok, EvenChars, OneRankLog()).episodes
    assert len(out) == 4 and max(len(e.turn_offsets) for e in out) > 1
    assert sorted(e.slot for e in out) == [0, 1, 2, 3]


def test_remax_baseline_episodes_are_greedy_and_resume_with_the_samples(tiny) -> None:
    """ReMax with an environment: each prompt's samples and one greedy episode (sample n),
    committed turn by turn together; resumed after any turn, all of them equal the
    uninterrupted ones bitwise (the greedy episodes keep no KV cache, so the replay skips
    them)."""
    env = EnvConfig(
        path="envs_toy:EndsFourWays", max_turns=4, max_total_tokens=200, on_error="end_episode"
    )
    prompts = episode_prompts(tiny[1], 3)
    calls = [prompts[:1], prompts[1:]]
    full, log = _resumable(tiny, env, EndsFourWays, calls=calls, baseline=True)
    assert [(e.sample_idx, e.greedy) for e in full[:3]] == [(0, False), (1, False), (2, True)]
    assert len(full) == 3 * 3 and max(len(e.turn_offsets) for e in full if e.greedy) > 1
    rows = log.rows[max(log.rows)]
    assert all(r["is_baseline"] == (k[1] == 2) for k, r in rows.items())
    # Greedy turns carry no sampling logprobs; no greedy episode's cache was kept.
    assert all(lp == 0.0 for e in full if e.greedy for lp in e.logprobs)
    slot = {e.slot for e in full if e.greedy}
    assert all(not (kept & slot) for kept in log.kept.values())
    for done in (1, 2):
        again, _ = _resumable(
            tiny, env, EndsFourWays, log.rows[done], done, calls=calls, baseline=True
        )
        for a, b in zip(full, again, strict=True):
            assert (a.response, a.logprobs, a.loss_mask) == (b.response, b.logprobs, b.loss_mask)
            assert (a.turn_rewards, a.status, a.greedy) == (b.turn_rewards, b.status, b.greedy)


@pytest.mark.slow
def test_a_full_disk_at_a_turn_shard_stops_with_one_line_and_resumes(
    reference: Path, tmp_path: Path
) -> None:
    """`EDQUOT`, then a real full file system, at step 3's first turn shard (issue 51):
    each start stops with one line naming it, exit 75, no temporary file left; the resumed
    run equals the uninterrupted one."""
    part = "stages/step=3/rollout.t1"
    done = each_fault_stops_then_resumes(
        tmp_path / "fs", 64 << 20, part, RUN, ENV_PATH, tmp_path / "copy"
    )
    assert trajectories(done).equals(trajectories(reference))
    a, b = final_weights(done), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
