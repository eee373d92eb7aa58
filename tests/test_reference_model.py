"""`model.reference`: a different reference model for the KL term, through the real entry
point on the tiny model (its committed reference logprobs, the vocabulary check, the model
fingerprint on resume, and run directories whose config.yaml still holds the old bool)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import save_perturbed_tiny, submit

pytestmark = pytest.mark.slow

KL = ("total_steps=1", "kl.mode=loss", "kl.coef=0.1")


def _advantage_rows(run: Path) -> dict[tuple[int, int], dict]:
    table = pq.read_table(run / "stages" / "step=1" / "advantage" / "part-r0.parquet")
    return {(r["prompt_id"], r["sample_idx"]): r for r in table.to_pylist()}


def _train_kl(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(m["train/kl"] for m in lines if "train/kl" in m)


def _one_line_error(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step with a KL loss and no model.reference: the initial policy is the reference."""
    run = tmp_path_factory.mktemp("ref") / "default"
    out = submit(run, *KL)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_a_different_reference_changes_the_committed_reference_logprobs(
    default_run: Path, tmp_path: Path
) -> None:
    """Same policy, same samples; the reference logprobs (and so the KL) are those of
    `model.reference`. Without it they are the initial policy's, i.e. the rollout's own."""
    ref = save_perturbed_tiny(tmp_path / "perturbed")
    other = tmp_path / "other"
    out = submit(other, *KL, f"model.reference={ref}")
    assert out.returncode == 0, out.stderr[-3000:]
    base, changed = _advantage_rows(default_run), _advantage_rows(other)
    assert base.keys() == changed.keys()
    for key, row in base.items():
        assert row["response_token_ids"] == changed[key]["response_token_ids"]
        torch.testing.assert_close(
            torch.tensor(row["ref_logprobs"]), torch.tensor(row["logprobs"]), rtol=0, atol=1e-5
        )
    diff = max(
        abs(a - b)
        for key, row in base.items()
        for a, b in zip(row["ref_logprobs"], changed[key]["ref_logprobs"], strict=True)
    )
    assert diff > 0.1
    # The default's KL only grows from 0 after the step's first update (about 0.01 here).
    assert 10 * _train_kl(default_run) < _train_kl(other)

    # The reference's weights are part of the run's model fingerprint: a resume with other
    # weights at the same path is refused, and leaves the run as it was.
    from rftpipe.engines.models import load_causal_lm

    changed_ref = load_causal_lm(ref, "float32")
    with torch.no_grad():
        for p in changed_ref.parameters():
            p.mul_(1.5)
    changed_ref.save_pretrained(ref)
    before = (other / "run.json").read_bytes()
    line = _one_line_error(submit(other, "total_steps=2", config=None))
    assert "model" in line and "differs" in line
    assert (other / "run.json").read_bytes() == before


def test_a_reference_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    """The KL compares both models' logprobs of the same token ids: a tokenizer whose ids
    mean other tokens is refused at start, before anything is committed."""
    from rftpipe.engines.models import load_tokenizer, prepare_tiny

    ref = tmp_path / "other-vocab"
    shutil.copytree(prepare_tiny(), ref)
    tok = load_tokenizer(ref)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(ref)
    run = tmp_path / "run"
    line = _one_line_error(submit(run, *KL, f"model.reference={ref}"))
    assert "model.reference" in line and "vocabulary" in line
    assert not (run / "stages").exists()


@pytest.mark.tier1
def test_a_missing_reference_directory_names_model_reference(tmp_path: Path) -> None:
    line = _one_line_error(submit(tmp_path / "run", *KL, f"model.reference={tmp_path}/nope"))
    assert line.startswith("rftpipe: error: model.reference:"), line


def test_an_old_run_directory_with_a_boolean_reference_resumes(
    default_run: Path, tmp_path: Path
) -> None:
    """A run directory written before `model.reference` named a model holds
    `reference: true` in its config.yaml: it resumes (through jobs.submit and the
    worker), as the policy's initial weights, and its config then says `null`."""
    run = tmp_path / "old"
    shutil.copytree(default_run, run)
    config = run / "config.yaml"
    text = config.read_text()
    assert "  reference: null\n" in text
    config.write_text(text.replace("  reference: null\n", "  reference: true\n"))
    out = submit(run, "total_steps=2", config=None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "stages" / "step=2" / "train" / "MANIFEST.json").exists()
    assert "  reference: null\n" in config.read_text()


def test_the_worker_loads_an_old_run_config(
    default_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads the run's config.yaml itself (a requeued Slurm job never passes
    through jobs.submit): the old bool loads there too."""
    import rftpipe.run.loop
    from rftpipe.run import worker

    run = tmp_path / "old"
    shutil.copytree(default_run, run)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("  reference: null\n", "  reference: false\n"))
    seen = []
    monkeypatch.setattr(rftpipe.run.loop, "train_run", lambda cfg, *a, **k: seen.append(cfg) or 0)
    assert worker.main([str(run)]) == 0
    assert seen[0].model.reference is None
