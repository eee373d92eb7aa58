"""User reward functions for the reward tests, imported by path in the worker processes,
and the rollout rows they score."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa


def _record_pid() -> None:
    """Append this worker's pid to $RFTPIPE_TEST_PIDS (so a test can check it was killed)."""
    if path := os.environ.get("RFTPIPE_TEST_PIDS"):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


def even_share(sample) -> float:
    """rftpipe signature: the share of even token ids (dense_even_tokens, by import path)."""
    ids = sample.response_token_ids
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl signature, returning a dict of components."""
    return {
        "score": float(solution_str.strip() == str(ground_truth)),
        "length": len(solution_str),
        "source": data_source,
    }


def trl_length(prompts, completions, completion_ids, **columns) -> list[float]:
    """TRL signature: one value per completion of the group."""
    assert len(prompts) == len(completions) == len(columns["prompt_id"])
    return [len(ids) / 8 for ids in completion_ids]


def trl_wrong_length(prompts, completions, **columns) -> list[float]:
    return [1.0]


def sleepy(sample) -> float:
    """Never returns for sample 0 of every group; the others score like even_share."""
    if sample.sample_idx == 0:
        _record_pid()
        while True:
            time.sleep(3600)
    return even_share(sample)


def sleep_forever(sample) -> float:
    _record_pid()
    while True:
        time.sleep(3600)


def raises_on_odd(sample) -> float:
    if sample.sample_idx % 2:
        raise RuntimeError(f"odd sample {sample.sample_idx}")
    return 1.0


def not_a_number(sample):
    return "high"


def exits(sample) -> float:
    os._exit(3)


def prints(sample) -> float:
    print("a user print that must not corrupt the reply stream")
    return 0.5


def rollouts(
    prompts: int = 2, n: int = 3, step: int = 1, sources: tuple[str, ...] = ()
) -> pa.Table:
    """`prompts` groups of `n` rows; `sources[p]` is prompt p's data_source (default: the
    reasoning-gym dataset's name)."""
    rows = [
        {
            "step": step,
            "prompt_id": p,
            "sample_idx": k,
            "prompt": f"What is {p} + {k}?",
            "response": str(p + k) if k != 2 else "no idea",
            "answer": str(p + k),
            "metadata": json.dumps(
                {"data_source": sources[p]} if sources else {"source_dataset": "basic_arithmetic"}
            ),
            "response_token_ids": list(range(k + 1)),
            "finish_reason": "stop",
        }
        for p in range(prompts)
        for k in range(n)
    ]
    return pa.Table.from_pylist(rows)


def verl_echo(data_source, solution_str, ground_truth, extra_info=None):
    """verl signature: echoes what it was given, as extra reward columns."""
    return {
        "score": 1.0,
        "data_source": data_source,
        "ground_truth": ground_truth,
        "extra_index": (extra_info or {}).get("index", -1),
        "extra_split": (extra_info or {}).get("split", ""),
    }


def first_token_even(sample) -> float:
    """1 if the response's first token id is even: a binary reward, so some groups of a
    random model score alike (what dynamic sampling drops) and others do not."""
    ids = sample.response_token_ids
    return float(bool(ids) and ids[0] % 2 == 0)


def red_mean(sample) -> dict:
    """rftpipe signature: the mean red channel (0-255) of the row's first image (-1 for a
    row without images), with how many images it saw and whether their bytes hash to
    their names."""
    import hashlib

    import numpy as np

    ok = all(hashlib.sha256(im.read_bytes()).hexdigest() == im.sha256 for im in sample.images)
    red = float(np.asarray(sample.images[0].pil())[..., 0].mean()) if sample.images else -1.0
    return {"score": red, "images": len(sample.images), "verified": float(ok)}


def image_rollouts(run_root, pictures: list[bytes], n: int = 3) -> pa.Table:
    """`rollouts(n=n)` (2 prompts x n samples) with an `images` column of a vision run: prompt
    0 showed `pictures[0]`, prompt 1 showed `pictures[1:]`; the pictures (PNG bytes) are
    put in `run_root`'s image store."""
    from rftpipe.storage.images import ImageStore

    store = ImageStore(run_root)
    refs = [store.put(b, "png").relpath for b in pictures]
    table = rollouts(n=n)
    shown = [refs[:1] if p == 0 else refs[1:] for p in table.column("prompt_id").to_pylist()]
    return table.append_column("images", pa.array(shown, pa.list_(pa.string())))


def trl_red_mean(prompts, completions, images, **columns) -> list[float]:
    """TRL signature: each completion's mean red channel (0-255) of its prompt's first
    image, -1 without images; the images are decoded RGB pictures."""
    import numpy as np

    assert all(im.mode == "RGB" for ims in images for im in ims)
    return [float(np.asarray(ims[0])[..., 0].mean()) if ims else -1.0 for ims in images]


_held = False


def hold_256mib_once(sample) -> float:
    """rftpipe signature, always 0: the first call in step 2 of each worker process fills
    256 MiB (a block glibc maps and unmaps: its pages leave the resident set when freed),
    holds it for 1 s and frees it, inside the score stage."""
    global _held
    if sample.step == 2 and not _held:
        _held = True
        block = b"\x01" * (256 * 2**20)  # written, so resident (calloc'd pages would not be)
        time.sleep(1.0)
        del block
    return 0.0


def last_digit(sample) -> float:
    """The response's last character as a number (test_branches.py's rows end in one)."""
    return float(sample.response[-1])


def even_share_odd_prompts(sample) -> float:
    """rftpipe signature: 1 for every sample of an even prompt id (its group is all alike:
    advantage 0, skipped by the train stage), the share of even token ids for the others."""
    if sample.prompt_id % 2 == 0:
        return 1.0
    return even_share(sample)
