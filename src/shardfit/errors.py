"""One exception type for user-facing mistakes: the CLI prints its message as one line and exits 2."""


class ShardfitError(Exception):
    """Bad input or an impossible request. The message names what is wrong and how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ShardfitError(message)
