"""`python tests/config_walk.py`: the walk a reader takes following a study's config, measured.

A one-trial sampled study runs on the fake backend of `test_study_fakes` (tracking off, one
worker), under a profiler that sees every call into a phaze_opt function whose arguments hold the
study's settings: a `StudyConfig`, or an object carrying one as `.config` (the session, a worker's
spec, what `setup.prepare` returns). A call counts as a module entry when its caller is in another
module (or outside phaze_opt); consecutive entries into one module are one stop. The walk ends at
the first call of `search.objective.evaluate_point`, where the trial's point meets the evaluator.
Reading a setting (a `StudyConfig` property such as `strategy`, `mode`, `baseline_system`, and
what it calls) is not an entry: a reader sees its value where it is read.
The command line (`cli`, then `commands/study`, which builds the config) comes before the first
entry measured here: add two stops. One worker runs in the parent process on the session's open
study; each process of `--workers N > 1` opens the study itself (`setup.load_study`), its own walk
from its spec. `tests/test_architecture.py` holds the walk to at most two entries a module; no tests
here.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_study_fakes import backend, config  # noqa: E402


def _holds_config(value) -> bool:
    kind = type(value).__name__
    return kind == "StudyConfig" or type(getattr(value, "config", None)).__name__ == "StudyConfig"


def walk() -> list[tuple[str, str]]:
    """(module, function) of each module entry, in order, up to the first trial's evaluation."""
    import phaze_opt
    from phaze_opt.search.runner import run_study

    from phaze_opt.search.config import StudyConfig

    root = str(Path(phaze_opt.__file__).resolve().parent)
    reads = {name for name, value in vars(StudyConfig).items() if isinstance(value, property)}
    entries: list[tuple[str, str]] = []
    inside_read: set[int] = set()  # frames of a setting's read (a property) and of what it calls
    done = False

    def profile(frame, event, arg):
        nonlocal done
        if event == "return":
            inside_read.discard(id(frame))
        if done or event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        code = frame.f_code
        if id(frame.f_back) in inside_read or (code.co_name in reads and type(frame.f_locals.get("self")) is StudyConfig):
            inside_read.add(id(frame))
            return
        if code.co_name == "evaluate_point" and frame.f_globals.get("__name__") == "phaze_opt.search.objective":
            done = True
            entries.append(("phaze_opt.search.objective", "evaluate_point"))
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if not any(_holds_config(frame.f_locals.get(n)) for n in names):
            return
        module = frame.f_globals.get("__name__", "?")
        caller = frame.f_back.f_globals.get("__name__", "?") if frame.f_back else "?"
        if caller != module:
            entries.append((module, code.co_name))

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            run_study(config(Path(tmp), trials=1), backend())
        finally:
            sys.setprofile(None)
    return entries


def stops_of(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The walk's stops: consecutive entries into one module are one stop (its first entry)."""
    return [e for i, e in enumerate(entries) if i == 0 or e[0] != entries[i - 1][0]]


def main() -> None:
    stops = stops_of(walk())
    per_module = Counter(m for m, _ in stops)
    print(f"{len(stops) + 2} stops (cli and commands/study included), {len(per_module) + 2} modules, "
          f"most entries into one module: {max(per_module.values())} ({per_module.most_common(1)[0][0]})")
    for i, (module, function) in enumerate(stops, start=3):
        print(f"{i:3d}  {module.removeprefix('phaze_opt.')}.{function}")
    print("entries per module:", ", ".join(f"{m.removeprefix('phaze_opt.')} {n}" for m, n in per_module.most_common()))


if __name__ == "__main__":
    main()
