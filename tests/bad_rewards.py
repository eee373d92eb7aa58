"""A user reward function that fails, for the bad-input tests (imported by path)."""


def boom(sample) -> float:
    raise ValueError("cannot score this")
