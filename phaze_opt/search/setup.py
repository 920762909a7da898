"""A study's settings, their validation, and opening its Optuna storage and sampler.

Everything here runs before the first trial, so every user mistake (unknown sampler, model, space
or system, bad objectives, an empty space, a study name reused with other settings) becomes one
`PhazeError` line instead of a failed trial or a traceback.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from sqlalchemy import event

from ..design.evaluate import check_ilp_time_limit, design_evaluator
from ..design.protocols import BoundedEvaluator, Evaluator, GridSpace, SearchSpace
from ..design.space import load_space
from .. import interrupt
from ..errors import PhazeError, shown, unknown_choice
from ..hardware.accelerator import Accelerator
from ..hardware.arch import load_arch
from ..hardware.cost import load_constants as load_cost_constants
from ..system import load_system
from ..training import SAMPLED_FIELDS, bound_obstacles
from ..workload.features import feature_fields
from ..workload.models import load_model
from .config import (  # noqa: F401  (StudyConfig and its choices: re-exported)
    ORDERS,
    PHAZE_AREA_GROUP_MM2,
    SAMPLERS,
    SINGLE_OBJECTIVE_SAMPLERS,
    StudyConfig,
)
from ..runs.locks import check_sqlite_storage, create_schema, prebuild_optuna_sqlite, probe_database, probe_tracking_uri
from .objective import metric_names, parse_objectives
from .strategy import AUTO, AUTO_SWEEP_NAME, BRANCH_AND_BOUND_NAME, GRID_NAME, STRATEGY_NAMES
from ..runs.cluster import check_address
from ..runs.disk import DATABASE_HEADROOM_BYTES, DiskFull, is_full
from ..runs.tracking import driver_url, redact, sqlite_path, tracking_enabled

HEARTBEAT_S = 30
GRACE_S = 120
_NAME_BAD = re.compile(r"[^A-Za-z0-9._+-]+")
_UNSAFE_NAME = re.compile(r"^\.|[/\\\x00]")  # would name a file outside --output-dir (or a hidden one)
MAX_SEED = 2**32 - 1


@dataclass
class Backend:
    """The pieces a study calls, injectable so the study machinery can be tested on its own.

    Left as None they are the real ones: `design.evaluate.DesignEvaluator` (at the config's ILP
    time limit), the space named by the config, `load_arch(config.reference_arch)`, `load_model`
    to check model names and `feature_fields` to describe a model to MLflow. Worker processes get a
    copy, so anything put here must be picklable (module-level functions and classes).
    """

    evaluator: Evaluator | None = None
    space: SearchSpace | None = None
    reference_arch: Accelerator | None = None
    check_model: Callable[[str], Any] | None = None
    describe_model: Callable[[str], Mapping[str, str]] | None = None

    def resolved(self, config: StudyConfig) -> "Backend":
        evaluator = self.evaluator
        if evaluator is None:
            evaluator = design_evaluator(config.ilp_time_limit_s)
        space = self.space
        if space is None:
            space = load_space(config.space)
        reference = self.reference_arch
        if reference is None:
            reference = load_arch(config.reference_arch)
        describe = self.describe_model or feature_fields
        return replace(self, evaluator=evaluator, space=space, reference_arch=reference, describe_model=describe)


@dataclass
class Prepared:
    """A study ready for its first trial: the checked config, the resolved backend, the open study."""

    config: StudyConfig
    backend: Backend
    name: str
    url: str
    storage: optuna.storages.RDBStorage
    study: optuna.Study
    resumed: bool


def prepare(config: StudyConfig, backend: Backend | None = None) -> Prepared:
    """Everything before the first trial, in one call: validate the settings, resolve the backend,
    check the space, then name, open (or resume) the study in its storage with this process's sampler."""
    backend = backend or Backend()
    config, name, url = locate(config, backend)
    backend = backend.resolved(config)
    check_space(backend.space)
    if tracking_enabled(config.tracking_uri):  # a tracking server that fails stops the start before any store changes
        probe_tracking_uri(config.tracking_uri)
    storage = make_storage(url)
    sampler = config.searcher.optuna_sampler(config, backend.space)
    with interrupt.deferred():  # a study is created with its identity, whole
        study, resumed = open_study(config, storage, backend.space, sampler)
    return Prepared(config, backend, name, url, storage, study, resumed)


def locate(config: StudyConfig, backend: Backend) -> tuple[StudyConfig, str, str]:
    """(the validated config, the study's name, its storage URL): where a study is, before opening it."""
    config = validate(config, backend)
    return config, study_name(config), storage_url(config)


def load_study(config: StudyConfig, url: str, name: str, worker: int | None = None, space=None) -> optuna.Study:
    """The study a worker process runs: its storage, and (with `worker`) worker's own sampler for `space`."""
    storage = make_storage(url)
    if worker is None:
        return optuna.load_study(study_name=name, storage=storage)
    sampler = config.searcher.optuna_sampler(config, space, worker)
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler)


def _stem(name: str) -> str:
    text = str(name)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        text = Path(text).stem
    return text


def clean_name(text: str) -> str:
    return _NAME_BAD.sub("_", text).strip("_") or "study"


def default_study_name(config: StudyConfig) -> str:
    models = "+".join(_stem(m) for m in config.models)
    parts = [models, _stem(config.space)]
    if _stem(config.system) != "default":
        parts.append(_stem(config.system))
    if _stem(config.reference_arch) != "tpuv4":  # its baselines are another chip's
        parts.append("ref-" + _stem(config.reference_arch))
    parts += config.searcher.name_parts(config)
    if tuple(config.objectives) != ("throughput",):
        parts.append("+".join(config.objectives))
    return clean_name("-".join(parts))


def study_name(config: StudyConfig) -> str:
    return config.study_name or default_study_name(config)


def default_storage(name: str, output_dir: str = "studies") -> str:
    return f"sqlite:///{Path(output_dir) / name}.db"


def storage_url(config: StudyConfig) -> str:
    return config.storage or default_storage(study_name(config), config.output_dir)


def parse_hysteresis(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().lower()
        if text in ("off", "none"):
            return None
        try:
            number = int(text)
        except ValueError:
            raise PhazeError(f"--hysteresis: expected a positive whole number of area groups or 'off', got '{value}'") from None
    if number <= 0:
        raise PhazeError(f"--hysteresis: expected a positive whole number of area groups or 'off', got '{value}'")
    return number


WORKER_BYTES = 400 * 2**20  # a worker process's resident memory (measured: about 330 MB), with a margin
MIN_WORKERS_LIMIT = 4  # two workers per core beyond this buy nothing; below it a small machine still runs tests


def _available_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return math.inf


def max_workers() -> int:
    """The most worker processes this machine can hold: twice its cores (at least
    `MIN_WORKERS_LIMIT`), and no more than its free memory at `WORKER_BYTES` each (at least one)."""
    cores = max(MIN_WORKERS_LIMIT, 2 * (os.cpu_count() or 1))
    memory = _available_bytes() / WORKER_BYTES
    return max(1, int(min(cores, memory)))


def validate(config: StudyConfig, backend: Backend | None = None) -> StudyConfig:
    """Check every user-given setting; returns the config with normalised values and the strategy
    resolved (`resolve_strategy`)."""
    if not isinstance(config.strategy, str) or config.strategy not in STRATEGY_NAMES:
        raise PhazeError(f"strategy: {unknown_choice('strategy', config.strategy, STRATEGY_NAMES)}")
    sampler = str(config.sampler).strip().lower()
    if sampler not in (AUTO, *SAMPLERS):
        raise PhazeError(f"--sampler: {unknown_choice('sampler', config.sampler, (AUTO, *SAMPLERS))}")
    sampler = resolve_sampler(replace(config, objectives=parse_objectives(config.objectives),
                                      models=tuple(str(m) for m in config.models)), backend)
    objectives = parse_objectives(config.objectives)
    if not config.models:
        raise PhazeError("--model: give at least one model")
    if len(set(config.models)) != len(config.models):
        raise PhazeError(f"--model: a model is repeated: {', '.join(config.models)}")
    if isinstance(config.trials, bool) or not isinstance(config.trials, int) or config.trials <= 0:
        raise PhazeError(f"--trials: expected a positive whole number, got {shown(config.trials)}")
    if isinstance(config.workers, bool) or not isinstance(config.workers, int) or config.workers <= 0:
        raise PhazeError(f"--workers: expected a positive whole number, got {shown(config.workers)}")
    most = max_workers()
    if config.workers > most and not config.cluster:  # a cluster's workers are its own machines'
        raise PhazeError(f"--workers: at most {most} on this machine ({os.cpu_count() or 1} cores, "
                         f"{_available_bytes() / 2**30:.1f} GiB of memory free, about "
                         f"{WORKER_BYTES / 2**30:.2f} GiB a worker), got {config.workers}")
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
        raise PhazeError(f"--seed: expected a non-negative whole number, got {shown(config.seed)}")
    if config.seed + config.workers > MAX_SEED:  # numpy seeds are 32-bit; worker k uses seed + k
        raise PhazeError(f"--seed: at most {MAX_SEED - config.workers} (the samplers' seeds are 32-bit), got {config.seed}")
    order = str(config.order).strip().lower()
    if order not in ORDERS:
        raise PhazeError(f"--order: unknown order '{config.order}'; choose area or grid")
    hysteresis = parse_hysteresis(config.hysteresis)
    config.searcher.check(replace(config, sampler=sampler, objectives=objectives, order=order, hysteresis=hysteresis))
    if not (isinstance(config.area_group_mm2, (int, float)) and config.area_group_mm2 > 0):
        raise PhazeError(f"--area-group-mm2: expected a positive number, got {shown(config.area_group_mm2)}")
    if config.ilp_time_limit_s is not None:
        config = replace(config, ilp_time_limit_s=check_ilp_time_limit(config.ilp_time_limit_s))
    if config.study_name is not None and not str(config.study_name).strip():
        raise PhazeError("--study-name: must not be empty")
    if config.study_name is not None and _UNSAFE_NAME.search(str(config.study_name)):
        raise PhazeError(f"--study-name: '{config.study_name}' names files under --output-dir, so it may not contain "
                         "/ or \\ nor start with a dot")
    if config.storage is not None and "://" not in str(config.storage):
        raise PhazeError(f"--storage: expected a database URL such as sqlite:///studies/x.db or "
                         f"postgresql://user@host/db, got '{config.storage}'")
    check = (backend.check_model if backend and backend.check_model else None) or _check_model
    models = tuple(str(m) for m in config.models)
    for m in models:
        check(m)
    load_system(config.system)
    load_system(config.baseline_system)
    if "cost" in objectives:  # a malformed cost.yaml stops the study here, not in every trial
        load_cost_constants()
    config = replace(config, sampler=sampler, objectives=objectives, order=order, hysteresis=hysteresis, models=models)
    config = replace(config, strategy=resolve_strategy(config, backend))
    if config.cluster is not None:
        check_address(config.cluster)
        if config.strategy == GRID_NAME:
            raise PhazeError("--cluster: runs sampled studies and the pruned sweep (--prune bound); the grid "
                             "(--prune off) sweeps in this machine's processes")
    return config


# What the bound-pruned sweep and the bound-guided sampler settle: the best throughput, or the throughput-area front (its area
# is exact per design, `search.pareto`). Energy has no proven lower bound, so it is not pruned; cost is exact
# per design but the area order that proves the front is built for area alone (`search.pareto`).
SWEEP_OBJECTIVES = (("throughput",), ("throughput", "area"))


def bound_obstacle(config: StudyConfig, backend: Backend | None, objectives=(("throughput",),)) -> str | None:
    """Why the proven throughput bounds do not apply to a study, or None when they do.

    They bound one model's throughput under the real hardware model and placement DP, so they need
    one model, objectives among `objectives` (the bound-guided sampler and the sweep:
    `SWEEP_OBJECTIVES`), the real evaluator and a space with HBM capacities, no system axes, and
    recipe choices the bounds cover (`training.bound_obstacles`).
    """
    evaluator = backend.evaluator if backend else None
    space = backend.space if backend else None
    if space is None:
        try:
            space = load_space(config.space)
        except PhazeError:
            space = None  # reported where the space is loaded
    if len(config.models) != 1:
        return "it bounds one model's throughput; a common design over several models is not bounded"
    if tuple(config.objectives) not in objectives:
        if "energy" in config.objectives:
            return "energy has no proven lower bound; every point is evaluated"
        if "cost" in config.objectives:
            return "its fronts are throughput-area fronts; with cost every point is evaluated"
        return "it bounds throughput only; other objectives need every point evaluated"
    if evaluator is not None and not isinstance(evaluator, BoundedEvaluator):
        return "a custom evaluator has no throughput bound"
    if space is not None and not (isinstance(space, GridSpace) and "hbm_gib" in space.params):
        return "the space has no architecture grid with HBM capacities"
    # The bounds are built per system (its links, its device count); a space varying it would need
    # one set per cluster, which they are not.
    if getattr(space, "system_params", None):
        return (f"its bounds are proven for the study's one system; the space samples the cluster "
                f"({', '.join(space.system_params)})")
    # A recipe field whose bounds hold only at its default (training.AT_DEFAULT), sampled beyond it.
    obstacles = bound_obstacles(getattr(space, "params", {})) if space is not None else []
    return f"its bounds do not cover the space's recipes: {obstacles[0]}" if obstacles else None


def resolve_strategy(config: StudyConfig, backend: Backend | None) -> str:
    """`auto` (what `--exhaustive --prune auto` names) becomes branch and bound where the proven
    throughput bounds apply (`bound_obstacle`, and no hysteresis, which depends on the visiting
    order), else the grid; branch and bound asked for where they do not is refused with the reason."""
    if config.strategy not in (AUTO_SWEEP_NAME, BRANCH_AND_BOUND_NAME):
        return config.strategy
    if config.hysteresis is not None:
        why = "--hysteresis stops by area order; bound pruning visits best-first (use --hysteresis off)"
    else:
        why = bound_obstacle(config, backend, SWEEP_OBJECTIVES)
    if why is None:
        return BRANCH_AND_BOUND_NAME
    if config.strategy == BRANCH_AND_BOUND_NAME:
        raise PhazeError(f"--prune bound: {why}")
    return GRID_NAME


def resolve_sampler(config: StudyConfig, backend: Backend | None) -> str:
    """`auto` becomes the bound-guided sampler where the proven bounds apply (throughput, or
    throughput and area: `front_sampler`), else TPE; `bound` where they do not is refused with the reason."""
    sampler = str(config.sampler).strip().lower()
    if sampler not in (AUTO, "bound") or config.mode != "sampled":  # a sweep samples nothing
        return sampler
    return _where_bounds_apply(sampler, bound_obstacle(config, backend, SWEEP_OBJECTIVES), "--sampler", "bound", "tpe",
                               f"; choose another sampler ({', '.join(SAMPLERS[1:])})")


def _where_bounds_apply(asked: str, why: str | None, flag: str, bounded: str, otherwise: str, hint: str = "") -> str:
    """`bounded` where the bounds apply (`why` is None); else `otherwise`, or, when `bounded` itself
    was asked for, the one-line reason it cannot be."""
    if why is None:
        return bounded
    if asked == bounded:
        raise PhazeError(f"{flag} {bounded}: {why}{hint}")
    return otherwise


def _check_model(name: str):
    return load_model(name)


def check_space(space: SearchSpace) -> None:
    params = space.params
    if not params:
        raise PhazeError(f"space '{space.name}': it has no parameters to search")
    for name, choices in params.items():
        if not list(choices):
            raise PhazeError(f"space '{space.name}': parameter '{name}' has no choices")
    for needed in SAMPLED_FIELDS:
        if needed not in params:
            raise PhazeError(f"space '{space.name}': parameter '{needed}' is missing")


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """An RDB storage with heartbeats, so trials of a killed process are failed and retried on resume."""
    kwargs: dict[str, Any] = {}
    check_sqlite_storage(url)
    if not url.startswith("sqlite:"):  # a server: one line within seconds, not the driver's minutes
        probe_database(url, option="--storage")
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):].split("?", 1)[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    try:
        prebuild_optuna_sqlite(url, lambda aside: RDBStorage(aside, **kwargs))  # a new file appears whole
        storage = create_schema(lambda: RDBStorage(  # under a lock, retried: several processes may create it
            driver_url(url), heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3), **kwargs), url)
    except Exception as exc:  # noqa: BLE001 - a bad URL or unreachable server is user input
        if is_full(exc):
            raise DiskFull(database_place(url), DATABASE_HEADROOM_BYTES) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PhazeError(f"--storage {redact(url)}: cannot open: {first}") from None
    if url.startswith("sqlite:"):
        _sqlite_wal(storage)
    return storage


def database_place(url: str) -> str:
    """Where a storage's data lives, for a message: a SQLite file's path, else the URL without password."""
    path = sqlite_path(url)
    return str(path) if path is not None else redact(url)


def release_storage(study_or_storage) -> None:
    """Close this process's connections to a study's database, rolling back whatever transaction an
    interrupt cut short. With SQLite every transaction takes the write lock (`BEGIN IMMEDIATE`), so a
    connection that Ctrl-C or SIGTERM leaves inside one would block every other process of the study
    for good (seen: an interrupted worker kept it while its peer waited and the parent waited for
    both). The storage reconnects on its next use."""
    storage = getattr(study_or_storage, "_storage", study_or_storage)
    backend = getattr(storage, "_backend", storage)
    for close in (lambda: backend.scoped_session.remove(), lambda: backend.engine.dispose()):
        try:
            close()
        except Exception:  # noqa: BLE001 - best effort on the way out; the caller's error matters
            pass


def _sqlite_wal(storage) -> None:
    """WAL journal and NORMAL sync: a trial's dozen small writes cost a third less, and readers
    (the progress poll, other workers) do not block the writer (WAL lets them read beside it)."""
    def pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()
        dbapi_conn.isolation_level = None  # transactions begin where SQLAlchemy says (`immediate`)

    def immediate(conn):
        # Every transaction takes the write lock at its start, so a read-check-write (popping a queued
        # trial: WAITING -> RUNNING) is atomic across processes; pysqlite otherwise reads outside any
        # transaction and two workers pop the same queued trial.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(storage.engine, "connect", pragmas)
    event.listen(storage.engine, "begin", immediate)
    storage.engine.dispose()


IDENTITY_KEYS = ("mode", "models", "space", "system", "objectives")
# A study this project creates gets its identity in the writes right after `create_study`; another
# process opening it in between sees none yet, so an empty study without them is looked at again
# for this long before it counts as another program's.
IDENTITY_WAIT_S = 5.0


def study_identity(config: StudyConfig, space) -> dict:
    return {
        "mode": config.mode,
        "models": list(config.models),
        "space": space.name or _stem(config.space),
        "system": _stem(config.system),
        "objectives": list(config.objectives),
    }


def _own_attrs(study: optuna.Study, name: str, url: str) -> dict:
    """The study's attributes, once they show it is this project's: an Optuna study of the same name
    made by another program carries none of the identity keys and is refused, never adopted (its
    trials would be scored, summarised and logged to MLflow as the study's)."""
    deadline = time.monotonic() + IDENTITY_WAIT_S
    while True:
        attrs = study.user_attrs
        if any(key in attrs for key in IDENTITY_KEYS):
            return attrs
        if study.get_trials(deepcopy=False) or time.monotonic() > deadline:
            raise PhazeError(f"study '{name}' in {redact(url)} was not made by phaze-opt (it has none of the "
                             f"attributes {', '.join(IDENTITY_KEYS)}); choose another --study-name")
        time.sleep(0.1)


def _name_metrics(study: optuna.Study, config: StudyConfig) -> None:
    names = metric_names(config.objectives, len(config.models))
    if study.metric_names != names:
        study.set_metric_names(names)


def open_study(config: StudyConfig, storage, space, sampler) -> tuple[optuna.Study, bool]:
    """Create the study, or load it when it exists with the same settings; returns (study, resumed)."""
    name = study_name(config)
    identity = study_identity(config, space)
    try:
        existing = optuna.study.get_all_study_names(storage)
    except Exception as exc:  # noqa: BLE001
        raise PhazeError(f"--storage {redact(storage_url(config))}: cannot read: {exc}") from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        attrs = _own_attrs(study, name, storage_url(config))
        for key in IDENTITY_KEYS:
            if key in attrs and attrs[key] != identity[key]:
                raise PhazeError(f"study '{name}' in {redact(storage_url(config))} was run with {key} "
                                 f"{attrs[key]}, not {identity[key]}; choose another --study-name")
        if list(study.directions) != [optuna.study.StudyDirection[d.upper()] for d in config.directions]:
            raise PhazeError(f"study '{name}' has other objective directions; choose another --study-name")
        _name_metrics(study, config)  # a study made before the names were set gets them
        return study, True
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                directions=config.directions, load_if_exists=True)
    _name_metrics(study, config)
    for key, value in identity.items():
        study.set_user_attr(key, value)
    study.set_user_attr("sampler", config.searcher.sampler_label(config))
    study.set_user_attr("seed", config.seed)
    for key, value in config.searcher.settings(config).items():
        study.set_user_attr(key, value)
    return study, False
