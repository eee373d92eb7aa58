"""Agent episodes (`rollout.agent`, issue 34): users' agent programs, plain `openai` client
code in processes of their own, served by the rollout stage's endpoint in front of the real
HF engine on the tiny model; the record is checked against the token ids captured at the
engine boundary, not against itself."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    ROOT,
    TESTS_ON_PATH,
    TINY,
    EngineSpy,
    Killed,
    MemoryLog,
    OneRankLog,
    alive,
    episode_prompts,
    events,
    final_weights,
    run_agent_episodes,
    submit,
    trajectories,
)

from rftpipe.config.loader import ConfigError, load_config
from rftpipe.config.schema import AgentConfig, EvalConfig, RewardConfig, RolloutConfig, RunConfig
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.forward import build_micro_batch, response_logprobs
from rftpipe.errors import UserError
from rftpipe.stages import agents, evaluation, rollout
from rftpipe.storage.episode_stats import EpisodeCounts


@pytest.fixture(scope="module")
def tiny():
    path = prepare_tiny()
    torch.manual_seed(0)
    return load_causal_lm(path, "float32"), load_tokenizer(path)


def _run(tiny, agent: AgentConfig, n: int = 2, prompts: int = 2, max_new: int = 6, **kw):  # noqa: ANN001
    return run_agent_episodes(tiny, agent, n=n, prompts=prompts, max_new=max_new, **kw)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_episodes_record_what_the_engine_sampled_call_by_call(tiny, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    agent = AgentConfig(
        path="agents_e2e:even_tokens", kwargs={"calls": 3, "log": str(log)}, max_total_tokens=400
    )
    eps, stats, spy = _run(tiny, agent)
    _, tok = tiny
    assert len(eps) == 4
    # A barrier per call index: 3 indices, one engine call each for the 4 episodes.
    assert stats.engine_calls == [1, 1, 1] and len(spy.calls) == 3
    assert all(len(c) == 4 for c in spy.calls)
    seen = _lines(log)
    assert len(seen) == 12
    for e in eps:
        assert e.status == "done" and len(e.turn_offsets) == 3
        assert len(e.response) == len(e.logprobs) == len(e.loss_mask)
        mine = sorted(
            (
                r
                for r in seen
                if (r["prompt_id"], r["sample_idx"]) == (e.prompt.prompt_id, e.sample_idx)
            ),
            key=lambda r: r["call"],
        )
        bounds = [*e.turn_offsets, len(e.response)]
        for c in range(3):
            # The engine's prompt for call c is the record's prompt and response so far,
            # and its sampled tokens are the record's mask-1 span of call c.
            # (Every episode lives to the end, so each engine call's rows are in slot order.)
            boundary = spy.calls[c][e.slot]
            assert boundary[0] == e.prompt_ids + e.response[: bounds[c]]
            span = e.loss_mask[bounds[c] : bounds[c + 1]]
            sampled = span.count(1)
            assert span == [1] * sampled + [0] * (len(span) - sampled)
            assert e.response[bounds[c] : bounds[c] + sampled] == boundary[1]
            # What the agent was answered with is what the engine sampled and saw.
            assert mine[c]["token_ids"] == boundary[1]
            assert mine[c]["prompt_token_ids"] == boundary[0]
            assert all(lp == 0.0 for lp in e.logprobs[bounds[c] + sampled : bounds[c + 1]])
        # The agent's reward is the episode's return: the mean share of even ids.
        want = (
            sum(
                sum(1 for t in r["token_ids"] if t % 2 == 0) / max(1, len(r["token_ids"]))
                for r in mine
            )
            / 3
        )
        assert sum(e.turn_rewards) == pytest.approx(want)
        # The new messages' tokens are the template's text after the sampled answer.
        text = tok.decode(
            e.response[bounds[0] + e.loss_mask[bounds[0] : bounds[1]].count(1) : bounds[1]]
        )
        assert "Again, more even (1)." in text and text.endswith("<|im_start|>assistant\n")


def _calls_of(e) -> list[tuple[list[int], list[int], list[float]]]:  # noqa: ANN001
    """Each call of an episode as its record holds it, across its sequences: the whole
    prompt the call sent, the tokens sampled and their logprobs (the mask-1 span)."""
    out = []
    for seq in [*e.branches, e]:
        assert len(seq.response) == len(seq.logprobs) == len(seq.loss_mask)
        bounds = [*seq.turn_offsets, len(seq.response)]
        for a, b in itertools.pairwise(bounds):
            span = seq.loss_mask[a:b]
            k = span.count(1)
            assert span == [1] * k + [0] * (len(span) - k)
            assert all(lp == 0.0 for lp in seq.logprobs[a + k : b])
            out.append(
                (
                    seq.prompt_ids + seq.response[:a],
                    seq.response[a : a + k],
                    seq.logprobs[a : a + k],
                )
            )
    return out


def test_a_rewritten_history_makes_a_branch(tiny, tmp_path: Path) -> None:
    """An odd sample's agent drops its history before its second call: that call starts
    the episode's second sequence, rendered whole, and the third extends it. Every call in
    the record is what the engine saw and sampled, and what the agent was told."""
    log = tmp_path / "calls.jsonl"
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 3, "log": str(log), "summarize_odd": True},
        max_total_tokens=400,
    )
    eps, stats, spy = _run(tiny, agent)
    _, tok = tiny
    seen = _lines(log)
    assert sum(len(e.branches) for e in eps) == 2 and stats.engine_calls == [1, 1, 1]
    for e in eps:
        assert e.status == "done" and len(e.branches) == e.sample_idx % 2
        calls = _calls_of(e)
        assert len(calls) == 3
        mine = sorted(
            (
                r
                for r in seen
                if (r["prompt_id"], r["sample_idx"]) == (e.prompt.prompt_id, e.sample_idx)
            ),
            key=lambda r: r["call"],
        )
        for c, (prompt, sampled, _) in enumerate(calls):
            # Every episode lives to the end, so each engine call's rows are in slot order.
            assert (prompt, sampled) == tuple(spy.calls[c][e.slot])
            assert (mine[c]["prompt_token_ids"], mine[c]["token_ids"]) == (prompt, sampled)
        if e.branches:
            (first,) = e.branches
            # The second sequence is the summarised conversation rendered whole: it does
            # not extend the first, and its first call is its prompt.
            assert len(first.turn_offsets) == 1 and len(e.turn_offsets) == 2
            assert e.prompt_ids == calls[1][0]
            assert e.prompt_ids[: len(calls[0][0])] != calls[0][0] + calls[0][1]
            assert "Summary: one answer" in tok.decode(e.prompt_ids)
            # The agent's reward is paid on the episode's last call, in its last sequence.
            assert sum(first.turn_rewards) == 0.0 and sum(e.turn_rewards) > 0
    # As rows: one per sequence, consecutive in branch order, the episode's status on each.
    inp = rollout.RolloutInputs(
        step=1, rank=0, run_seed=0, prompts=episode_prompts(tok, 2), agent=agent
    )
    rows = rollout.episode_rows(inp, spy, tok, eps).to_pylist()
    assert [(r["sample_idx"], r["branch"], r["branches"]) for r in rows] == [
        (0, 0, 1),
        (1, 0, 2),
        (1, 1, 2),
    ] * 2
    assert all(r["episode_status"] == "done" for r in rows)
    counts = EpisodeCounts.of(rollout.episode_rows(inp, spy, tok, eps))
    assert counts.episodes == 4 and counts.metrics()["episode/branches_mean"] == 0.5


def test_branches_refuse_answers_a_rewritten_history_with_400(tiny) -> None:
    agent = AgentConfig(
        path="agents_e2e:rewrites_history", on_error="end_episode", branches="refuse"
    )
    eps, _, _ = _run(tiny, agent, n=1, prompts=1)
    (e,) = eps
    assert e.status == "error" and len(e.turn_offsets) == 1 and not e.branches
    assert "rollout.agent.branches=refuse" in json.loads(e.turn_infos[-1])["error"]


# Renders every assistant message but the last as "[...]": a template that rewrites earlier
# text once messages follow (as Qwen3's drops earlier reasoning).
HIDING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}[...]{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_text_makes_a_branch_per_call(tiny) -> None:
    model, tok = tiny
    hiding = copy.deepcopy(tok)
    hiding.chat_template = HIDING
    agent = AgentConfig(path="agents_e2e:even_tokens", kwargs={"calls": 3}, max_total_tokens=400)
    eps, _, spy = run_agent_episodes((model, hiding), agent, n=1, prompts=1)
    (e,) = eps
    # Each later call's rendering hides the answer before it: a new sequence each time,
    # each its own whole rendering, which the engine saw.
    assert len(e.branches) == 2
    for c, (prompt, sampled, _) in enumerate(_calls_of(e)):
        assert (prompt, sampled) == tuple(spy.calls[c][0])
        if c:
            assert "[...]" in hiding.decode(prompt)
    refuse = AgentConfig(
        path="agents_e2e:even_tokens", kwargs={"calls": 3}, max_total_tokens=400, branches="refuse"
    )
    with pytest.raises(UserError) as err:
        run_agent_episodes((model, hiding), refuse, n=1, prompts=1)
    assert "\n" not in str(err.value) and "prefix is unstable" in str(err.value)


def test_an_agent_past_its_timeout_is_killed_with_its_children(tiny, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    agent = AgentConfig(
        path="agents_e2e:sleeps",
        kwargs={"pid_file": str(pids)},
        timeout_s=3,
        on_error="end_episode",
    )
    eps, _, _ = _run(tiny, agent, n=1, prompts=1)
    (e,) = eps
    assert e.status == "error" and "timeout_s=3" in json.loads(e.turn_infos[-1])["error"]
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), pid


def test_an_agents_process_start_is_not_its_time(tiny) -> None:
    # Its module's import (the agents' zygote's) takes 4 s, longer than its timeout_s: a
    # start that long is a loaded node's, not the agent's.
    agent = AgentConfig(path="agents_slow_start:returns_at_once", timeout_s=1)
    eps, _, _ = _run(tiny, agent, n=1, prompts=1)
    (e,) = eps
    assert e.status == "done" and e.turn_rewards == [1.0]


def test_a_failing_agent_stops_the_run_with_one_line(tiny) -> None:
    agent = AgentConfig(path="agents_e2e:sleeps", timeout_s=2)
    with pytest.raises(UserError) as err:
        _run(tiny, agent, n=1, prompts=1)
    msg = str(err.value)
    assert "\n" not in msg and "prompt_id 10 sample_idx 0 call 0" in msg and "step 1" in msg


# ---------------------------------------------------------------------------------------------
# Through the real entry point
# ---------------------------------------------------------------------------------------------

RUN = (
    "rollout.agent.path=agents_e2e:even_tokens",
    # Odd samples' agents of odd prompts rewrite their history before their second call (a
    # branch, whose group's KV cache is then prefilled anew); other groups continue theirs.
    "rollout.agent.kwargs={calls: 2, max_tokens: 6, summarize_odd: true, odd_prompts_only: true}",
    "rollout.agent.max_total_tokens=96",
    "reward.functions=[]",
    "total_steps=4",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run; while it runs, the most exited-but-unreaped children its
    launcher held at once is written to `zombies` (agents' processes end by the dozen each
    step and are adopted by the launcher)."""
    run = tmp_path_factory.mktemp("agents") / "ref"
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(TINY), *RUN]
    env = {**os.environ, **TESTS_ON_PATH}
    most = 0
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) as proc:
        while proc.poll() is None:
            most = max(most, _zombies_of(proc.pid))
            time.sleep(0.5)
        err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err[-3000:]
    (run.parent / "zombies").write_text(str(most))
    return run


def _zombies_of(pid: int) -> int:
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        count += fields[0] == "Z" and fields[1] == str(pid)
    return count


@pytest.mark.slow
def test_an_agent_run_trains_on_its_calls(reference: Path) -> None:
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/reward_env"] for r in rows] == [r["rollout/reward_mean"] for r in rows]
    # 4 engine call groups (prompts_per_step 4, groups_per_call 1) x 2 call indices.
    assert all(r["agent/engine_calls"] == 8 and r["perf/agent_s"] > 0 for r in rows)
    t = trajectories(reference).to_pandas()
    t["odd"] = (t["sample_idx"] % 2 == 1) & (t["prompt_id"] % 2 == 1)
    # The odd samples of odd prompts branch at their second call; every step, including
    # step 3 (where the SIGKILL tests below kill), has groups that do and groups that do not.
    for r in rows:
        step = t[t["step"] == r["step"]]
        assert r["agent/branches"] == (step["branch"] == 1).sum()
        assert r["episode/branches_mean"] == r["agent/branches"] / 16
        assert 0 < step[step["odd"]]["prompt_id"].nunique() < 4
    even, odd = t[~t["odd"]], t[t["odd"]]
    assert (even["num_turns"] == 2).all() and (even["branches"] == 1).all()
    assert (odd["num_turns"] == 1).all() and (odd["branches"] == 2).all()
    # An episode's sequences share its reward (paid on its last call: the first
    # sequence's own env_reward is 0) and its advantage.
    for _, ep in odd.groupby(["step", "prompt_id", "sample_idx"]):
        first, last = ep.sort_values("branch").to_dict("records")
        assert (
            first["env_reward"] == 0.0 and first["reward"] == last["reward"] == last["env_reward"]
        )
        assert {*first["advantages"]} == {*last["advantages"]} and len({*last["advantages"]}) == 1
    # The step's reward mean is over episodes, not sequences.
    episodes = t[t["branch"] == t["branches"] - 1]
    for r in rows:
        assert r["rollout/reward_mean"] == pytest.approx(
            episodes[episodes["step"] == r["step"]]["reward"].mean()
        )
    # 4 steps of 16 episodes, each leaving processes to the launcher: it reaps them every
    # second, so they never pile up past one step's (unreaped, 62 did on 2026-11-29).
    assert int((reference.parent / "zombies").read_text()) <= 36
    # Advantages move, on the model's tokens only.
    assert any(any(a != 0 for a in r["advantages"]) for _, r in t.iterrows())
    for _, r in t.iterrows():
        mask = list(r["loss_mask"])
        assert all(a == 0.0 for a, m in zip(r["advantages"], mask, strict=True) if not m)


@pytest.mark.slow
def test_the_inspector_shows_an_episodes_sequences(reference: Path, tmp_path: Path) -> None:
    def inspect(*args: str | Path) -> str:
        cmd = [sys.executable, "-m", "rftpipe.inspect", str(reference), *map(str, args)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    logged = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads(inspect("summary", "--json"))
    for m, s in zip(logged, summary, strict=True):
        # Recomputed offline from the rows: episodes, not sequences.
        assert s["rollout/samples"] == 16
        for k in ("rollout/reward_mean", "episode/branches_mean", "episode/turns_mean"):
            assert s[k] == pytest.approx(m[k], rel=1e-12), k
    t = trajectories(reference).to_pandas()
    # A prompt of step 1 with an odd id: its odd samples (1 and 3 of 4) branched.
    odd = str(int(t[(t["step"] == 1) & (t["prompt_id"] % 2 == 1)]["prompt_id"].min()))
    text = inspect("samples", "--step", "1", "--prompt-id", odd)
    heads = [line for line in text.splitlines() if line.startswith("== ")]
    assert len(heads) == 6 and "sample 0  reward" in heads[0]
    assert "sample 1  sequence 1 of 2" in heads[1] and "sample 1  sequence 2 of 2" in heads[2]
    page = tmp_path / "page.html"
    inspect("html", "--step", "1", "--prompt-id", odd, "--out", page)
    html = page.read_text()
    assert 'data-sample="1" data-branch="1"' in html and "sequence 2 of 2" in html
    # Each second sequence's own prompt: the summary that replaced the history.
    assert html.count("this sequence's prompt") == 2 and "Summary: one answer" in html


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "skip"),
    [
        # Step 3's first call index (2 a step): generated, then killed before or after its
        # commit.
        ("agent_before_call_commit", 4),
        ("agent_after_call_commit", 4),
        # Mid-generation: after the first of its 4 engine call groups (one a group).
        ("agent_mid_call", 16),
    ],
)
def test_sigkill_between_calls_resumes_from_the_record_bitwise(
    reference: Path, tmp_path: Path, point: str, skip: int
) -> None:
    run = tmp_path / "killed"
    env = {**TESTS_ON_PATH, "RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(skip)}
    assert submit(run, *RUN, env=env).returncode != 0
    # Killed in step 3's rollout: steps 1 and 2 are done.
    done = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert done == [1, 2]
    out = submit(run, *RUN, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    log = events(run)
    assert [e["point"] for e in log if e["event"] == "fault"] == [point]
    resumed = [(e["step"], e["turns"]) for e in log if e["event"] == "resume_turns"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step3 = next(m for m in metrics if m["step"] == 3)
    if point == "agent_after_call_commit":
        # Call 0 of step 3 committed: the restarted agents were answered from the record.
        assert resumed == [(3, 1)] and step3["agent/from_record"] == 16
        assert step3["agent/engine_calls"] == 4
    else:
        assert resumed == [] and step3["agent/from_record"] == 0
    assert trajectories(run).equals(trajectories(reference))
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumable(tiny, agent: AgentConfig, kill_after: int, n: int = 2):
    """The agent's episodes killed after call index `kill_after`'s commit and resumed from
    what it committed; and the same episodes uninterrupted."""
    model, tok = tiny
    cfg = RolloutConfig(n=n, max_new_tokens=6, agent=agent)
    prompts = episode_prompts(tok, 1)

    def go(log, resumed=None, turns=0):  # noqa: ANN001, ANN202
        engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        inp = agents.AgentInputs(
            cfg=cfg,
            agent=agent,
            run_seed=0,
            step=1,
            stage="rollout",
            calls=[prompts],
            resumed=resumed or {},
            resumed_turns=turns,
        )
        return agents.run(inp, engine, tok, log)

    first = MemoryLog(SimpleNamespace(weight_version=0), tok, prompts, agent, kill_after)
    with pytest.raises(Killed):
        go(first)
    return (lambda: go(OneRankLog(), first.rows, first.turns)), (lambda: go(OneRankLog()))


def _same(a, b) -> None:  # noqa: ANN001
    for x, y in zip(a, b, strict=True):
        assert len(x.branches) == len(y.branches)
        _same(x.branches, y.branches)
        assert (x.prompt_ids, x.response, x.logprobs, x.loss_mask) == (
            y.prompt_ids,
            y.response,
            y.logprobs,
            y.loss_mask,
        )
        assert (x.turn_offsets, x.turn_rewards, x.messages, x.status) == (
            y.turn_offsets,
            y.turn_rewards,
            y.messages,
            y.status,
        )


def test_a_resumed_agent_is_answered_from_the_record(tiny) -> None:
    agent = AgentConfig(path="agents_e2e:even_tokens", kwargs={"calls": 3}, max_total_tokens=400)
    resume, whole = _resumable(tiny, agent, kill_after=2)
    (got, stats), (want, _) = resume(), whole()
    # 2 episodes x 2 recorded calls answered from the record, the third generated.
    assert stats.from_record == 4 and stats.engine_calls == [1]
    _same(got.episodes, want.episodes)


def test_a_resumed_branch_is_answered_from_the_record(tiny) -> None:
    """Killed after call index 1, where sample 1's call started its second sequence: the
    restarted agents' calls 0 and 1 are answered from the record, that one across the
    branch, and the episodes end as the uninterrupted ones did."""
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 3, "summarize_odd": True},
        max_total_tokens=400,
    )
    resume, whole = _resumable(tiny, agent, kill_after=2)
    (got, stats), (want, _) = resume(), whole()
    assert stats.from_record == 4 and stats.engine_calls == [1]
    assert [len(e.branches) for e in want.episodes] == [0, 1]
    _same(got.episodes, want.episodes)


@pytest.mark.kernels
def test_kept_kv_caches_equal_calls_prefilled_whole(tiny) -> None:
    """The HF loop's kept caches across calls (`rollout.agent.keep_kv_cache`, the default)
    against every call's whole prompt prefilled again: the same tokens, and logprobs equal
    up to fp32 rounding, including a group whose second call index starts a new cache (its
    odd sample branches there) that its third continues."""
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 3, "summarize_odd": True},
        max_total_tokens=400,
    )
    kept, _, spy = _run(tiny, agent)
    assert spy.engine.continues_turns
    whole, _, spy = _run(tiny, dataclasses.replace(agent, keep_kv_cache=False))
    assert not spy.engine.continues_turns
    worst = 0.0
    for a, b in zip(kept, whole, strict=True):
        for x, y in zip([*a.branches, a], [*b.branches, b], strict=True):
            assert (x.prompt_ids, x.response, x.loss_mask) == (
                y.prompt_ids,
                y.response,
                y.loss_mask,
            )
            worst = max(worst, *(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)))
    assert worst < 1e-5, worst


def test_a_requests_stop_string_ends_the_answer_where_it_is_completed(tiny, tmp_path: Path) -> None:
    """A ReAct-style agent stops at "Observation:": the answer ends at the token that
    completes it (kept in the record and in `token_ids`, left out of the text, as OpenAI's
    API answers), the tokens sampled after it are not recorded, and the next call extends
    the episode from there."""
    _, tok = tiny
    log = tmp_path / "calls.jsonl"
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 2, "log": str(log), "stop": ["Observation:"]},
        max_total_tokens=400,
    )
    text = "Thought: add them\nObservation: 42, and more"
    script = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    eps, _, spy = run_agent_episodes(
        tiny, agent, n=1, prompts=1, max_new=40, script={(0, 0): script}
    )
    (e,) = eps
    first = _lines(log)[0]
    assert first["content"] == "Thought: add them\n" and first["finish_reason"] == "stop"
    kept = first["token_ids"]
    # The prefix of what the engine sampled that ends with the token completing the stop
    # string, and nothing after it.
    assert kept == spy.calls[0][0][1][: len(kept)] and len(kept) < len(script)
    assert tok.decode(kept).endswith("Observation:") and not tok.decode(kept[:-1]).endswith(
        "Observation:"
    )
    assert e.response[e.turn_offsets[0] : e.turn_offsets[0] + len(kept)] == kept
    assert e.loss_mask[e.turn_offsets[0] + len(kept)] == 0
    # The second call extends the record (no EOS was sampled: the template closes the turn).
    assert spy.calls[1][0][0] == e.prompt_ids + e.response[: e.turn_offsets[1]]
    closing = tok.decode(e.response[e.turn_offsets[0] + len(kept) : e.turn_offsets[1]])
    assert closing.startswith("<|im_end|>") and "Again, more even (1)." in closing


def test_a_nondeterministic_agent_fails_or_is_discarded_as_declared(tiny) -> None:
    fail = AgentConfig(path="agents_e2e:flaky")
    resume, _ = _resumable(tiny, fail, kill_after=2, n=1)
    with pytest.raises(UserError) as err:
        resume()
    msg = str(err.value)
    assert "\n" not in msg and "prompt_id 10 sample_idx 0 call 1" in msg
    assert "on_divergence=discard" in msg
    discard = AgentConfig(path="agents_e2e:flaky", on_divergence="discard")
    resume, _ = _resumable(tiny, discard, kill_after=2, n=1)
    (got, stats) = resume()
    # Call 0 matched its record; call 1 differed, so it was generated afresh.
    (e,) = got.episodes
    assert stats.from_record == 1 and stats.engine_calls == [1]
    assert e.status == "done" and len(e.turn_offsets) == 2


def _data_hash(run: Path) -> str:
    """Every committed stage, trajectory, checkpoint and export file (the resume's new
    `total_steps` commits a new config.yaml, and metrics are rewritten)."""
    h = hashlib.sha256()
    for part in ("stages", "trajectories", "checkpoints", "export"):
        for p in sorted((run / part).rglob("*")):
            if p.is_file() and not p.name.startswith(".tmp-"):
                h.update(str(p.relative_to(run)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_a_failing_agent_exits_2_and_changes_nothing_committed(tmp_path: Path) -> None:
    run, flag = tmp_path / "run", tmp_path / "fail"
    steps = (*RUN[:-1], "total_steps=1", f"rollout.agent.kwargs.fail_if={flag}")
    assert submit(run, *steps, env=TESTS_ON_PATH).returncode == 0
    before = _data_hash(run)
    flag.touch()
    out = submit(run, *steps[:-2], "total_steps=2", steps[-1], config=None, env=TESTS_ON_PATH)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "step 2 prompt_id" in lines[0] and "call 0" in lines[0], lines[0]
    assert "RuntimeError: told to fail" in lines[0] and "rollout.agent.path" in lines[0]
    assert _data_hash(run) == before
    # An agent path that does not import: exit 2 before anything is generated.
    bad = tmp_path / "bad"
    out = submit(bad, *RUN[:-1], "total_steps=1", "rollout.agent.path=agents_e2e:nowhere")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "rollout.agent.path agents_e2e:nowhere" in lines[0], lines[0]


@pytest.mark.slow
def test_two_ranks_killed_mid_generation_resume_bitwise(tmp_path: Path) -> None:
    """On 2 gloo ranks (FSDP2), killed mid-generation of step 2's second call index (after
    a rank's first engine call group) and resumed: bitwise the uninterrupted 2-rank run,
    with step 2's first call answered from the record on both ranks."""
    steps = (*RUN[:-1], "total_steps=2", "train.backend=fsdp2")
    two = ("--tasks-per-node", "2")
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = submit(ref, *steps, env=TESTS_ON_PATH, extra=two)
    assert out.returncode == 0, out.stderr[-3000:]
    # Each rank: 2 call groups a call index, 2 indices a step; the 7th hit is step 2's
    # second index after its first group.
    env = {**TESTS_ON_PATH, "RFTPIPE_FAULT": "agent_mid_call", "RFTPIPE_FAULT_SKIP": "6"}
    assert submit(run, *steps, env=env, extra=two).returncode != 0
    out = submit(run, *steps, env=TESTS_ON_PATH, extra=two)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = [(e["step"], e["turns"]) for e in events(run) if e["event"] == "resume_turns"]
    assert resumed == [(2, 1), (2, 1)]  # both ranks
    assert trajectories(run).equals(trajectories(ref))
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eight_episodes_make_one_engine_call_per_group_and_call_index(tiny) -> None:
    """8 concurrent episodes (4 prompts x 2 samples) at groups_per_call=2: each call index
    is 2 engine calls, within ceil(8 / groups_per_call)."""
    model, tok = tiny
    agent = AgentConfig(path="agents_e2e:even_tokens", kwargs={"calls": 2})
    cfg = RolloutConfig(n=2, max_new_tokens=4, agent=agent, groups_per_call=2)
    spy = EngineSpy(HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id))
    prompts = episode_prompts(tok, 4)
    inp = agents.AgentInputs(
        cfg=cfg, agent=agent, run_seed=0, step=1, stage="rollout", calls=[prompts[:2], prompts[2:]]
    )
    out, stats = agents.run(inp, spy, tok, OneRankLog())
    assert len(out.episodes) == 8 and all(e.status == "done" for e in out.episodes)
    assert stats.engine_calls == [2, 2] and max(stats.engine_calls) <= -(-8 // 2)
    assert [len(c) for c in spy.calls] == [4, 4, 4, 4]


@pytest.mark.parametrize(
    ("override", "what"),
    [
        ("rollout.staleness=1", "rollout.staleness > 0"),
        ("rollout.engine=vllm", "rollout.engine=vllm"),
        ("rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling"),
        ("eval.size=4", "and rollout.agent give"),  # tiny_dense's eval.metric: not a reward
        ("rollout.env.path=envs_toy:EvenChars", "set one of them"),
    ],
)
def test_what_agents_do_not_compose_with_yet_is_refused_in_one_line(
    override: str, what: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            RunConfig, TINY, ["rollout.agent.path=agents_e2e:even_tokens", *override.split()]
        )
    assert "\n" not in str(err.value) and what in str(err.value), str(err.value)


def test_held_out_greedy_episodes_draw_nothing(tiny) -> None:
    """Evaluation's greedy agent episode (-1) answers every call with the greedy
    continuation: the same under another run seed, while the sampled one changes."""
    model, tok = tiny
    agent = AgentConfig(path="agents_e2e:even_tokens", kwargs={"calls": 2})
    cfg = RolloutConfig(n=1, max_new_tokens=6, agent=agent)

    def go(seed: int) -> list:
        engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        inp = agents.AgentInputs(
            cfg=cfg,
            agent=agent,
            run_seed=seed,
            step=1,
            stage="eval",
            calls=[episode_prompts(tok, 1)],
            samples=[-1, 0],
            greedy_samples=frozenset({-1}),
        )
        out, stats = agents.run(inp, engine, tok, OneRankLog())
        assert stats.engine_calls == [2, 2]  # the sampled row's call and the greedy one's
        return out.episodes

    (g0, s0), (g1, s1) = go(0), go(1)
    assert g0.greedy and g0.sample_idx == -1 and len(g0.turn_offsets) == 2
    assert g0.response == g1.response and s0.response != s1.response


def test_held_out_evaluation_counts_a_branched_episodes_calls(tiny) -> None:
    """The greedy episode (-1, an odd sample) summarises before its second call: its row
    holds its last sequence (2 calls) and counts all 3 of its calls in `num_turns`."""
    model, tok = tiny
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 3, "summarize_odd": True},
        max_total_tokens=400,
    )
    cfg = RolloutConfig(n=1, max_new_tokens=6, agent=agent)
    engine = HFGenerateEngine(model, cfg, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    inp = evaluation.EvalInputs(
        step=1,
        rank=0,
        run_seed=0,
        prompts=episode_prompts(tok, 1),
        eval=EvalConfig(size=1, samples=1, k=(1,), metric="env", threshold=0.5),
        rollout=cfg,
        reward=RewardConfig(functions=()),
    )
    rows = {r["sample_idx"]: r for r in evaluation.run(engine, tok, {}, inp).to_pylist()}
    assert rows[-1]["num_turns"] == 3 and len(rows[-1]["turn_offsets"]) == 2
    assert rows[0]["num_turns"] == 3 and len(rows[0]["turn_offsets"]) == 3


# Spaced unlike json.dumps: the arguments parsed to JSON and rendered back are other text.
TOOL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1,   "b": 2}}</tool_call>'


@pytest.mark.kernels
def test_a_tool_call_round_trips_as_sampled_and_logprobs_are_the_trainers(
    tiny, tmp_path: Path
) -> None:
    model, tok = tiny
    log = tmp_path / "calls.jsonl"
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 2, "log": str(log), "tools": True},
        max_total_tokens=400,
    )
    # A scripted first answer (a random model writes no tool call); later ones sampled.
    script = [*tok(TOOL_TEXT, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    eps, _, spy = run_agent_episodes(
        tiny, agent, n=1, prompts=1, max_new=40, script={(0, 0): script}
    )
    (e,) = eps
    seen = _lines(log)
    # The agent was answered with a parsed tool call, and sent back its result.
    assert seen[0]["tool_calls"] == ["add"] and seen[0]["content"] is None
    msgs = json.loads(e.messages) if isinstance(e.messages, str) else e.messages
    sent = msgs[len(episode_prompts(tok, 1)[0].messages)]
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    # The record keeps the sampled tokens, not a rendering of the parsed call.
    first = e.response[e.turn_offsets[0] : e.turn_offsets[0] + len(script)]
    assert first == script == spy.calls[0][0][1]
    assert spy.calls[1][0][0] == e.prompt_ids + e.response[: e.turn_offsets[1]]
    # Rendering the agent's returned messages again (the JSON call, content None) gives
    # other ids than were sampled: the re-tokenization a framework that re-renders trains on.
    history = [{**m, "content": m.get("content") or ""} for m in msgs[: len(msgs) - 1]]
    rerendered = tok(
        tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert rerendered != spy.calls[1][0][0]
    assert tok.decode(first[:-1]) == TOOL_TEXT
    # The call's info names the tool, as environments' do: `episode/tool_calls_mean` counts it.
    assert json.loads(e.turn_infos[0])["tool_calls"] == ["add"]
    rows = rollout.episode_rows(
        rollout.RolloutInputs(step=1, rank=0, run_seed=0, prompts=episode_prompts(tok, 1)),
        spy,
        tok,
        eps,
    )
    assert EpisodeCounts.of(rows).metrics()["episode/tool_calls_mean"] == 1.0
    # The second call's sampled tokens carry the engine's logprobs, which are the trainer's
    # log softmax of the same tokens (fp32, the bound of test_rollout_engines.py).
    second = e.turn_offsets[1]
    span = [i for i in range(second, len(e.response)) if e.loss_mask[i]]
    mb = build_micro_batch([e.prompt_ids], [e.response], pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, mb, 1.0, with_entropy=False)
    diff = max(abs(lp[0, i].item() - e.logprobs[i]) for i in span)
    assert span and diff < 1e-4, diff
