"""What the command is doing now, in words, for the heartbeat's `still <words>, 40s` lines.

The work that can take long sits in low layers (tracing a model's graphs in `workload`, the layer
schedules in `design`), below `runs.progress`, which prints the lines; so the words live here, in
the lowest layer, and any module can name its phase without importing the printing side.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_PHASES: list[tuple[str, float]] = []  # innermost last: (words, time.monotonic() when it began)


@contextmanager
def phase(words: str):
    """Name what the code inside does (`tracing gpt3-175b's layer graphs`). Cheap (a list push), so
    it can wrap work that is usually quick; the innermost phase is the one shown."""
    entry = (words, time.monotonic())
    _PHASES.append(entry)
    try:
        yield
    finally:
        if _PHASES and _PHASES[-1] is entry:
            _PHASES.pop()
        elif entry in _PHASES:  # left out of order (a generator closed late): drop just this one
            _PHASES.remove(entry)


def current() -> tuple[str, float] | None:
    """The innermost phase, (words, since on time.monotonic), or None; safe from another thread."""
    try:
        return _PHASES[-1]
    except IndexError:  # none, or the last one just ended
        return None
