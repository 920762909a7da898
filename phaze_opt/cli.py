"""`phaze-opt` (also `python -m phaze_opt`): one console command with subcommands.

Each subcommand lives in `phaze_opt/commands/<name>.py` and exposes `HELP`, `add_arguments(parser)`,
`run(args) -> dict` and optionally `render(result) -> str` for the human-readable form. The CLI
adds `--json` to every subcommand, prints the result, and turns user mistakes (`PhazeError`) into
one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from . import configs
from . import interrupt
from .errors import PhazeError
from .jsonable import jsonable
from .runs import Heartbeat

COMMANDS = ("workload", "arch", "schedule", "evaluate", "study", "compare", "published", "measure", "validate",
            "ui", "export")


def _command_module(name: str):
    try:
        return importlib.import_module(f"phaze_opt.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"phaze_opt.commands.{name}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phaze-opt",
        description="Co-design search over a training accelerator and the device placement of a large model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _command_module(name)
        if module is None:
            continue
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP))
        module.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        p.add_argument("--configs", action="append", default=[], metavar="DIR",
                       help="a folder of your own configs (models/, archs/, spaces/, systems/, validation/, "
                            "area.yaml, energy.yaml) that add to or override the shipped ones by name; repeatable, "
                            "first wins; also $PHAZE_OPT_CONFIGS")
        p.set_defaults(_module=module, _parser=p)
    return parser


def dumps(result) -> str:
    return json.dumps(jsonable(result), indent=2)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    interrupt.install()  # SIGTERM and SIGHUP stop a command as Ctrl-C does: exit 130, one line
    with interrupt.command():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    before = os.environ.get(configs.ENV)
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if not getattr(args, "command", None):
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            parser.print_help()
            return 2
        if extra:  # reported by the subcommand's parser, so the user sees that subcommand's usage
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
        module = args._module
        configs.add_user_dirs(args.configs)
        label = getattr(module, "heartbeat", None)
        if label is None:
            result = module.run(args)
        else:  # a command that may work for minutes says so every 10 s
            with Heartbeat(label(args)):
                result = module.run(args)
        if isinstance(result, int):
            return result
        if args.json:
            print(dumps(result))
        else:
            render = getattr(module, "render", None)
            print(render(result) if render else dumps(result))
    except PhazeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 2)  # 1 for a full disk: not the user's mistake
    except KeyboardInterrupt:
        interrupt.settle()
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:  # main() may be called again in one process (tests, notebooks)
        if before is None:
            os.environ.pop(configs.ENV, None)
        else:
            os.environ[configs.ENV] = before
    return 0


INTERRUPTED = 130


def exit_with(status: int) -> None:
    """End the process with `status` (what `main` returned). After a stop (130) the process ends at
    once: the command has closed its stores and a stop must end within seconds, but the interpreter's
    teardown of its modules (numba, MLflow, HiGHS, SQLAlchemy) takes 3-8 s on a loaded 2-core
    machine. The exit handlers still run (logging, multiprocessing) and the standard streams are
    flushed; only that teardown is skipped."""
    if status != INTERRUPTED:
        sys.exit(status)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(status)


def entry() -> None:
    """The `phaze-opt` console script and `python -m phaze_opt`."""
    exit_with(main())


if __name__ == "__main__":
    entry()
