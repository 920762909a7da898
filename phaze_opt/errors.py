"""User-facing errors.

Every mistake a user can make in a config or on the command line raises `PhazeError` with a single
line naming the file, the field and what is allowed. The CLI prints that line and exits with status 2;
nothing else should reach the user as a traceback.
"""


class PhazeError(Exception):
    """An error caused by user input; its message is one line meant for the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def config_error(file, field: str, problem: str) -> PhazeError:
    """The canonical shape of a config error: `FILE: field 'X': problem`."""
    return PhazeError(f"{file}: field '{field}': {problem}")
