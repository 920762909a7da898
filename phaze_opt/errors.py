"""User-facing errors.

Every mistake a user can make in a config or on the command line raises `PhazeError` with a single
line naming the file, the field and what is allowed. The CLI prints that line and exits with status 2;
nothing else should reach the user as a traceback.
"""


import difflib
import reprlib

SHOWN_CHARS = 80
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def shown(value) -> str:
    """A value echoed in an error message: its repr, bounded (a few elements, a few levels, at most
    about `SHOWN_CHARS` characters), so a huge or deeply shared value costs nothing to report."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def closest(word: str, choices) -> str | None:
    """The choice closest to a misspelt `word` (difflib's ratio, at least 0.6), or None when none is
    close: a hint, never a guess that replaces the allowed list."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return close[0] if close else None


def did_you_mean(word: str, choices) -> str:
    """`did you mean X?` with the closest choice, or ""."""
    match = closest(word, choices)
    return f"did you mean {match}?" if match else ""


def unknown_choice(noun: str, word, choices, alternative: str = "") -> str:
    """The one wording of a name that is not one of `choices`: `unknown NOUN 'WORD'; did you mean X?
    choose one of A, B[, ALTERNATIVE]` (the hint only when a choice is close)."""
    choices = [str(c) for c in choices]
    hint = did_you_mean(word, choices)
    allowed = ", ".join(choices) or "(none)"
    return (f"unknown {noun} {shown(str(word))}; {hint + ' ' if hint else ''}choose one of {allowed}"
            f"{', ' + alternative if alternative else ''}")


class PhazeError(Exception):
    """An error caused by user input; its message is one line meant for the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def config_error(file, field: str, problem: str) -> PhazeError:
    """The canonical shape of a config error: `FILE: field 'X': problem`."""
    return PhazeError(f"{file}: field '{field}': {problem}")
