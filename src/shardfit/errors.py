"""One exception type for user-facing mistakes: the CLI prints its message as one line and exits 2."""


class ShardfitError(Exception):
    """Bad input or an impossible request. The message names what is wrong and how to fix it.
    every_rank: every rank of a job raises this same error (it came from a collective decision), so
    only rank 0 prints it."""

    every_rank = False
