"""User-facing errors: one line on stderr, exit code 2, nothing committed touched."""


class UserError(Exception):
    """Bad input from the user (config, data, model, reward function, resume mismatch).

    The message is a single line naming the field, row or sample at fault.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split("\n")))
