"""`phaze-opt` (also `python -m phaze_opt`): one console command with subcommands.

Each subcommand lives in `phaze_opt/commands/<name>.py` and exposes `HELP`, `add_arguments(parser)`,
`run(args) -> dict` and optionally `render(result) -> str` for the human-readable form. The CLI
adds `--json` to every subcommand, prints the result, and turns user mistakes (`PhazeError`) into
one line on stderr with exit status 2. Mistakes argparse catches (an unknown command or flag, a bad
choice or number, a missing argument) are one line too, from `Parser`, never argparse's whole usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from . import configs
from . import interrupt
from .errors import PhazeError, closest, unknown_choice
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


_NUMBER_TYPES = {"int": "a whole number", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """The parser of `phaze-opt` and (argparse builds subparsers with the parent's class) of every
    subcommand. A usage mistake is one line, `phaze-opt <cmd>: error: ...`, exit status 2, naming the
    flag and what it allows, with "did you mean" for a misspelt command, choice or flag: argparse's
    own error prints the whole usage first (22 lines for `evaluate`), which buries the one line that
    says what was wrong. `--help` still prints everything."""

    def error(self, message: str):
        message = message.removeprefix("argument ").replace(" with argument ", " with ")
        # argparse's "invalid int value: 'abc'" says what was wrong, not what is allowed
        for kind, allowed in _NUMBER_TYPES.items():
            message = message.replace(f"invalid {kind} value: ", f"expected {allowed}, got ")
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _check_value(self, action, value):
        # argparse's check, worded as every other unknown name here (with a suggestion). It is a
        # private hook, but the only one that sees the action and the value together; the message
        # argparse builds lists its choices as repr or str depending on the Python version.
        if action.choices is None or value in action.choices:
            return
        if isinstance(action, argparse._SubParsersAction):
            problem = unknown_choice("command", value, action.choices)
        else:
            flag = "/".join(action.option_strings) or action.dest
            problem = f"{flag}: {unknown_choice('value', value, action.choices)}"
        raise argparse.ArgumentError(None, problem)

    def reject_extra(self, extra: list[str]):
        """Arguments no flag of this parser took: one line naming the unknown flags (with the closest
        known flag for each), else the stray values."""
        flags = [a.split("=", 1)[0] for a in extra if a.startswith("-") and not a[1:2].isdigit() and a != "-"]
        if not flags:
            self.error(f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(extra)}")
        # compared without the dashes every flag shares, which would make any two flags look alike
        known = {o.lstrip("-"): o for action in self._actions for o in action.option_strings}
        matches = [closest(f.lstrip("-"), known) for f in flags]
        named = [f"{f} (did you mean {known[m]}?)" if m else f for f, m in zip(flags, matches)]
        help_hint = "" if all(matches) else f"; '{self.prog} --help' lists them"
        self.error(f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(named)}{help_hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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


def heartbeat_label(module, args) -> str | None:
    """What the command's "still working" lines are titled: its module's `heartbeat(args)` (None for
    no lines: a server, or `--no-progress`), else the command and its model, if it takes one."""
    label = getattr(module, "heartbeat", _default_label)
    return label(args) if label is not None else None


def _default_label(args) -> str:
    model = getattr(args, "model", None)
    return args.command if not model or not isinstance(model, str) else f"{args.command} {model}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    interrupt.install()  # SIGTERM and SIGHUP stop a command as Ctrl-C does: exit 130, one line
    with interrupt.command():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    before = os.environ.get(configs.ENV)
    try:
        interrupt.preload_native()
        interrupt.checkpoint()  # a signal during the preload: stop here, with no work begun
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if not getattr(args, "command", None):
            if extra:
                parser.reject_extra(extra)
            parser.error(f"give a command, one of {', '.join(COMMANDS)}; 'phaze-opt --help' says what each does")
        if extra:  # reported by the subcommand's parser, which knows that subcommand's flags
            args._parser.reject_extra(extra)
        module = args._module
        configs.add_user_dirs(args.configs)
        label = heartbeat_label(module, args)
        if label is None:
            result = module.run(args)
        else:  # any command may work for minutes on a large model: it never stays silent for 10 s
            with Heartbeat(label):
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
    except BaseException as exc:  # a stop, whatever form it reached the top level in
        if not interrupt.is_stop(exc):
            raise
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
