"""A verl-style GSM8K reward: `compute_score(data_source, solution_str, ground_truth,
extra_info)`, the signature verl's reward manager calls (rftpipe: `signature: verl`).

Two ways to read the answer, as verl's GSM8K scorer has:
- strict: the number right after the first "#### " (the format the prompt asks for);
- flexible: the last number anywhere in the response.
Commas and dollar signs inside a number are dropped, so "#### $1,200" reads 1200.
"""

from __future__ import annotations

import re
from typing import Any

_STRICT = re.compile(r"#### (-?[0-9.,$]+)")
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")
#: Only the end of a long response is searched (a rambling one cannot hit by luck early).
TAIL_CHARS = 300


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The response's final answer as a string of digits, or None if it gives none."""
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        m = _STRICT.search(tail)
        return _clean(m.group(1)) or None if m else None
    if method != "flexible":
        raise ValueError(f"method must be strict or flexible, got {method!r}")
    numbers = [_clean(n) for n in _NUMBER.findall(tail)]
    numbers = [n for n in numbers if n not in ("", "-")]
    return numbers[-1] if numbers else None


def _same(answer: str | None, ground_truth: str) -> bool:
    if answer is None:
        return False
    try:
        return float(answer) == float(_clean(ground_truth))
    except ValueError:
        return answer == ground_truth.strip()


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """1.0 if the strict "#### N" answer equals the ground truth, else 0.0; the flexible
    (last-number) score and whether the "####" format was followed ride along as extra
    columns `reward_gsm8k_flexible` and `reward_gsm8k_format`."""
    if "gsm8k" not in data_source:
        # verl's default_compute_score dispatches on data_source the same way.
        raise NotImplementedError(f"no GSM8K scorer for data_source {data_source!r}")
    strict = extract_answer(solution_str, "strict")
    return {
        "score": float(_same(strict, ground_truth)),
        "flexible": float(_same(extract_answer(solution_str, "flexible"), ground_truth)),
        "format": float(strict is not None),
    }
