"""Finding and reading the config YAML files: the shipped ones (`phaze_opt/presets/`) and the user's.

A config is named either by its short name (`gpt3-175b` -> `presets/models/gpt3-175b.yaml`) or by a
path to the user's own YAML file. A name is looked up in the user's config folders first
(`--configs DIR`, `$PHAZE_OPT_CONFIGS`), then in the shipped ones, so a user folder adds configs or
overrides shipped ones by name. Validation of the contents belongs to the module that owns the
config kind; this module only guarantees a mapping came out of a readable YAML file and offers the
small checks that every kind repeats, including the upper limits (`Limit`) that keep a size no real
system has from reaching an allocation: each config kind lists its limits in one table with the
reason for each (`system.LIMITS`, `workload.models.LIMITS`, `hardware.arch.LIMITS`).
"""

from __future__ import annotations

import math
import os
from importlib import resources
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from .errors import PhazeError, config_error, shown, unknown_choice

KINDS = ("models", "archs", "spaces", "systems", "validation")
ENV = "PHAZE_OPT_CONFIGS"


def shipped_dir() -> Path:
    """The configs shipped inside the package (`phaze_opt/presets`, package data in the wheel).

    Found with importlib.resources, so an installed wheel finds its own copy wherever it lies; the
    configs are read as files (stat for the caches' versions, paths in messages), so an install
    that is not a folder on disk (a zipped package) is a one-line error."""
    root = resources.files("phaze_opt") / "presets"
    if not isinstance(root, Path):
        raise PhazeError(f"phaze_opt's shipped configs are inside {root}, not a folder: install phaze_opt unzipped")
    return root


def user_dirs() -> list[Path]:
    """The user's config folders, most important first: `$PHAZE_OPT_CONFIGS` (folders separated by
    `os.pathsep`; `--configs DIR` on the command line puts DIR in front)."""
    return [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]


def search_path() -> list[Path]:
    """Where a config name is looked up, first match wins: the user's folders, then the shipped ones.
    A user folder needs only the files it adds or overrides, in the same layout (`models/x.yaml`)."""
    return [*user_dirs(), shipped_dir()]


def add_user_dirs(folders: Iterable[str | os.PathLike]) -> None:
    """Put `folders` in front of `$PHAZE_OPT_CONFIGS`, so this process and the workers it starts read them."""
    folders = [str(Path(f)) for f in folders]
    for f in folders:
        if not Path(f).is_dir():
            raise PhazeError(f"--configs {f}: no such folder")
    os.environ[ENV] = os.pathsep.join([*folders, *map(str, user_dirs())])


def configs_dir() -> Path:
    """The first folder of the search path: the user's own, else the shipped one."""
    return search_path()[0]


def constants_file(name: str) -> Path:
    """`name` (area.yaml, energy.yaml) from the first folder of the search path that has it: a user
    folder need not carry the fitted or cited constants."""
    for folder in search_path():
        if (folder / name).is_file():
            return folder / name
    return shipped_dir() / name


def load_constants(path: str | os.PathLike, missing: str, parse: Callable[[str, Any], Any]) -> Any:
    """A constants file (area, energy, cost) as `parse(path, data)` returns it, read and checked once
    per file and modification time: a study's millions of lookups read nothing, and an edit or a
    refit is seen without a restart."""
    p = Path(path)
    return _parsed_constants(parse, str(p), file_version(p, missing))


@lru_cache(maxsize=16)
def _parsed_constants(parse: Callable[[str, Any], Any], path: str, _version: int) -> Any:
    return parse(path, read_yaml(path))


def finite_number(value: Any, file, key: str) -> float:
    """A constant that must be a finite number (not a bool, which YAML's yes/no would give)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise config_error(file, key, f"must be a number, got {shown(value)}")
    return float(value)


def file_version(path: Path, missing: str) -> int:
    """The file's modification time, so a cache keyed on it sees edits; `missing` is the message."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        raise PhazeError(f"{path}: {missing}") from None


def available(kind: str) -> list[str]:
    """Every name of `kind` on the search path (a user's file overriding a shipped one counts once)."""
    return sorted({p.stem for folder in search_path() for p in (folder / kind).glob("*.yaml")})


def find(kind: str, name: str) -> Path | None:
    """The file a config name stands for: the first `<folder>/<kind>/<name>.yaml` on the search path."""
    for folder in search_path():
        path = folder / kind / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def is_path(text: str) -> bool:
    """A config named by a path rather than by a name: it ends in .yaml/.yml or has a folder in it."""
    return text.endswith((".yaml", ".yml")) or os.sep in text


def resolve(kind: str, name_or_path: str | os.PathLike) -> Path:
    """Map a config name or a path to an existing YAML file, or fail with the allowed names."""
    if kind not in KINDS:
        raise ValueError(f"unknown config kind {kind!r}")
    text = str(name_or_path)
    candidate = Path(text)
    noun = "validation suite" if kind == "validation" else kind[:-1]
    if is_path(text) or candidate.is_file():
        if not candidate.is_file():
            raise PhazeError(f"{text}: no such {noun} file")
        return candidate
    path = find(kind, text)
    if path is None:
        raise PhazeError(unknown_choice(noun, text, available(kind), "or give a path to a YAML file"))
    return path


MAX_CONFIG_BYTES = 4 * 2**20  # far above any config; a larger file is refused before it is parsed


class _StrictLoader(yaml.SafeLoader):
    """YAML without aliases or repeated keys. Aliases: `*name` makes one node stand for a shared
    copy, so a small file can expand to billions of elements ("billion laughs") wherever the value
    is walked or printed; no config needs them. A key given twice in one mapping would silently
    take its last value (`layers: 48`, then `layers: 49` a screen further down)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:  # an unhashable key: the constructor below says so
                    continue
                if seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown(key)} given twice (first at line {first[key] + 1})",
                        key_node.start_mark)
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse one UTF-8 YAML file; malformed YAML, aliases, a key repeated in a mapping, nesting too deep, a file over
    `MAX_CONFIG_BYTES`, text that is not UTF-8, a folder or an unreadable file is a one-line error
    naming it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise PhazeError(f"{path}: {size:,} bytes; a config may have at most {MAX_CONFIG_BYTES:,}")
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 - safe, no aliases
    except RecursionError:
        raise PhazeError(f"{path}: malformed YAML: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise PhazeError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise PhazeError(f"{path}: malformed YAML{where}: {problem}") from None
    except OSError as exc:
        raise PhazeError(f"{path}: cannot read: {exc.strerror}") from None


def load(kind: str, name_or_path: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    """Read a config as a mapping; returns (data, path). Malformed YAML is a one-line error."""
    path = resolve(kind, name_or_path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise PhazeError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return data, path


def check_keys(data: Mapping[str, Any], file, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    """Reject unknown and missing keys, naming the first offender and what is allowed."""
    required = list(required)
    allowed = set(required) | set(optional)
    for key in data:
        if key not in allowed:
            raise config_error(file, key, f"unknown field; allowed fields are {', '.join(sorted(allowed))}")
    for key in required:
        if key not in data:
            raise config_error(file, key, "missing required field")


@dataclass(frozen=True)
class Limit:
    """The largest value a size may take, and why no real system needs more (said in the error)."""

    maximum: int | float
    why: str

    def exceeded(self, value) -> str | None:
        """None when `value` is within the limit, else the problem, e.g. 'must be at most 1,024 (...)'."""
        if value <= self.maximum:
            return None
        return f"must be at most {self.maximum:,} ({self.why}), got {value:,}"


def _int_problem(value: Any, limit: Limit | None) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"must be a positive integer, got {shown(value)}"
    return limit.exceeded(value) if limit else None


def positive_int(data: Mapping[str, Any], key: str, file, default: Any = None, limit: Limit | None = None,
                 field: str | None = None) -> int:
    """`data[key]` as a positive integer no larger than `limit`; `field` names it in errors (default `key`)."""
    value = data.get(key, default)
    problem = _int_problem(value, limit)
    if problem:
        raise config_error(file, field or key, problem)
    return value


def positive_number(data: Mapping[str, Any], key: str, file, default: Any = None, limit: Limit | None = None,
                    field: str | None = None) -> float:
    """`data[key]` as a finite positive number no larger than `limit` (`.inf` and `.nan` are refused)."""
    value = data.get(key, default)
    field = field or key
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise config_error(file, field, f"must be a positive number, got {shown(value)}")
    if not math.isfinite(value):
        raise config_error(file, field, f"must be a finite number, got {shown(value)}")
    problem = limit and limit.exceeded(value)
    if problem:
        raise config_error(file, field, problem)
    return float(value)


def positive_arg(value: Any, name: str, limit: Limit | None = None) -> int:
    """An integer argument, e.g. the flag `--seq`: positive and within `limit`, else a one-line error
    naming it (`name`)."""
    problem = _int_problem(value, limit)
    if problem:
        raise PhazeError(f"{name} {problem}")
    return value


def one_of(data: Mapping[str, Any], key: str, file, choices: Iterable[Any], default: Any = None) -> Any:
    choices = list(choices)
    value = data.get(key, default)
    if value not in choices:
        raise config_error(file, key, f"must be one of {', '.join(map(str, choices))}, got {shown(value)}")
    return value
