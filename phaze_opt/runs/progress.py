"""Progress of a study or sweep: a tqdm bar on a terminal, plain lines in a log file.

A bar redraws one line with carriage returns, which a log file (`> log 2>&1`) keeps as one
unreadable line, so tqdm turns itself off there and a three-minute study would print nothing
until its summary. Off a terminal, progress is instead one plain, self-contained line every
`EVERY_S` seconds of wall time and one at the end, flushed at once so `tail -f log` follows it:

    [gpt3-175b-phaze-tpe] 120/500 trials  feasible 81  best 118.2 seq/s  1.9 trials/s  ETA 3m20s

`enabled` is the study's `progress` setting: None (the default) chooses by the stream, True
always draws the bar (`--progress`), False shows nothing (`--no-progress`). The clock is
injectable so tests can drive the pace without sleeping.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from ..activity import current

EVERY_S = 10.0  # seconds of wall time between two plain progress lines; the most a command stays silent
BAR_EVERY_S = 0.5  # the most often `due` asks a caller for fresh counts while a bar is drawn

# The live tqdm bar (messages print above it instead of through it), the plain-line progress being
# shown, and when anything was last shown (`spoke`), which the heartbeat reads.
_PROGRESS: dict = {"bar": None, "lines": None, "spoke": 0.0, "beating": False}


def spoke() -> None:
    """Something was shown just now: the heartbeat waits another interval."""
    _PROGRESS["spoke"] = time.monotonic()


def say(text: str) -> None:
    """One message line on stderr, above the progress bar when one is drawn."""
    bar = _PROGRESS["bar"]
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)
    spoke()


def close_bar() -> None:
    """Close the live bar, if any (an interrupted or failed run leaves its bar open)."""
    if _PROGRESS["bar"] is not None:
        _PROGRESS["bar"].close()
        _PROGRESS["bar"] = None


def duration(seconds: float) -> str:
    """A short wall-time span for a log line: 45s, 3m20s, 2h05m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Progress over `total` things (trials, points, designs), with the feasible count and best score.

    `feasible` is None where the count does not apply. `steady=False` drops the rate and ETA from
    the lines, for progress that comes in jumps (a bound settling thousands of points at once)
    where a linear estimate would mislead.
    """

    def __init__(self, total: int, initial: int, label: str, unit: str, enabled: bool | None,
                 fmt: Callable[[float], str] | None = None, *, feasible: int | None = None, phase: str = "",
                 steady: bool = True, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 every_s: float = EVERY_S):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.n, self.initial = total, initial, initial
        self.label, self.unit, self.phase, self.steady = label, unit, phase, steady
        self.fmt = fmt or (lambda v: f"{v:,.4g}")
        self.feasible = feasible
        self.best: float | None = None
        self.extra: dict[str, int] = {}
        self.clock, self.every_s = clock, every_s
        self.started = self.last_shown = clock()
        self.bar = None
        self.lines = False
        if enabled or (enabled is None and _isatty(self.stream)):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=f"{label} {phase}".strip(), unit=unit,
                            dynamic_ncols=True, file=self.stream)
            _PROGRESS["bar"] = self.bar
            spoke()
        elif enabled is None:
            self.lines = True
            _PROGRESS["lines"] = self

    def update(self, n: int = 1, best: float | None = None, feasible: int = 0) -> None:
        """`n` more done, `feasible` of them feasible; `best` a score reached (kept if it is the best)."""
        self.set_done(self.n + n, best, None if self.feasible is None else self.feasible + feasible)

    def set_done(self, done: int, best: float | None = None, feasible: int | None = None, **extra: int) -> None:
        """Absolute counts (from a poll of the storage): done, feasible and any named extras."""
        if best is not None and (self.best is None or best > self.best):
            self.best = best
        if feasible is not None:
            self.feasible = feasible
        self.extra.update(extra)
        self.n = done
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(self._fields()), refresh=False)
            self.bar.update(max(0, done - self.bar.n))
            self.last_shown = self.clock()
            spoke()
        elif self.due():
            self._print_line()

    def due(self) -> bool:
        """Whether fresh counts would be shown now, so a caller can skip computing costly ones."""
        if self.bar is not None:
            return self.clock() - self.last_shown >= BAR_EVERY_S
        return self.lines and self.clock() - self.last_shown >= self.every_s

    def line(self) -> str:
        """The plain progress line for now."""
        head = f"[{self.label}] {self.phase + ' ' if self.phase else ''}{self.n:,}/{self.total:,} {self.unit}s"
        parts = [head, *self._fields()]
        elapsed = self.clock() - self.started
        if self.steady and self.n > self.initial and elapsed > 0:
            rate = (self.n - self.initial) / elapsed
            parts.append(f"{rate:,.0f} {self.unit}s/s" if rate >= 100 else f"{rate:.3g} {self.unit}s/s")
            if self.n < self.total:
                parts.append(f"ETA {duration((self.total - self.n) / rate)}")
        return "  ".join(parts)

    def _fields(self) -> list[str]:
        out = [] if self.feasible is None else [f"feasible {self.feasible:,}"]
        out += [f"{k} {v:,}" for k, v in self.extra.items()]
        if self.best is not None:
            out.append(f"best {self.fmt(self.best)}")
        return out

    def _print_line(self, suffix: str = "") -> None:
        print(self.line() + suffix, file=self.stream, flush=True)
        self.last_shown = self.clock()
        spoke()

    def close(self) -> None:
        """End the bar, or print the final line."""
        if self.bar is not None:
            self.bar.close()
            if _PROGRESS["bar"] is self.bar:
                _PROGRESS["bar"] = None
            self.bar = None
        elif self.lines:
            self._print_line()
            self.lines = False
        if _PROGRESS["lines"] is self:
            _PROGRESS["lines"] = None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so the first heartbeat counts the
    interpreter's start and imports too; 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Heartbeat:
    """A line on stderr whenever a command has shown nothing for most of `every_s` seconds (default
    `EVERY_S`, read when it starts, so a test can lower it), so a log or a terminal never sits silent
    for longer, whatever phase the command is in (tracing, baselines, solves, bounding, flushing):

        [evaluate mixtral-8x7b on tpuv4] still working, 40s
        [study gpt2-xl] still computing the TPUv4 baselines, 20s
        [gpt2-xl-small-bound] 1/4 trials  feasible 1  best 27.1 seq/s  still running a trial, 30s

    The words are the innermost `phase` (else "working"), the time is the phase's (else the
    command's); while plain progress lines are shown, the heartbeat prints the progress line with
    that phase after it, and while a bar is drawn it redraws the bar (its clock moves) instead of
    printing. Any line shown (`say`, progress) restarts the wait, so a command that speaks on its
    own, or finishes within the interval, gets no extra lines. The lines come from a daemon thread,
    which only reads the clock and the shared state and prints; the work itself is untouched.
    """

    QUIET_SHARE = 0.8  # speak after this share of the interval in silence, so waking late stays within it
    POLLS = 20  # wake-ups per interval

    def __init__(self, label: str, every_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 out: Callable[[str], None] = say):
        self.label, self.every_s, self.clock, self.out = label, every_s, clock, out
        self.start = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phaze-opt-heartbeat", daemon=True)

    def interval(self) -> float:
        return EVERY_S if self.every_s is None else self.every_s

    def doing(self) -> tuple[str, float]:
        """(what is being done, since when on `clock`): the innermost phase, else the whole command."""
        now = current() if self.clock is time.monotonic else None
        return now if now is not None else ("working", self.start)

    def line(self) -> str:
        words, since = self.doing()
        return f"[{self.label}] still {words}, {duration(self.clock() - since)}"

    def beat(self) -> None:
        """Show that the command is alive: the bar redrawn, or one line."""
        bar, lines = _PROGRESS["bar"], _PROGRESS["lines"]
        if bar is not None:
            bar.refresh()
            spoke()
        elif lines is not None and lines.lines:
            words, since = self.doing()
            suffix = "" if words == "working" else f"  still {words}, {duration(self.clock() - since)}"
            lines._print_line(suffix)
        else:
            self.out(self.line())
            spoke()  # an `out` other than `say` (tests) counts as shown too

    def _run(self) -> None:
        every = self.interval()
        while not self._stop.wait(every / self.POLLS):
            last = _PROGRESS["spoke"]
            if time.monotonic() - last >= every * self.QUIET_SHARE:
                self.beat()

    def __enter__(self) -> "Heartbeat":
        self.start = self.clock()
        # the first command of a process counts its wait from the process's start (interpreter, imports)
        first = not _PROGRESS.get("beating")
        _PROGRESS["beating"] = True
        _PROGRESS["spoke"] = time.monotonic() - (process_age() if first else 0.0)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        _PROGRESS["lines"] = None  # a progress an error left open is not the next command's
