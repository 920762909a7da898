"""`phaze-opt study` (also `python -m phaze_opt.study`): the co-design search users run."""

from __future__ import annotations

from . import add_ilp_time_limit
from ..runs import DEFAULT_TRACKING_URI
from ..search import PHAZE_AREA_GROUP_MM2, SAMPLERS, StudyConfig, render as _render, strategy_from_flags

HELP = "search accelerator designs and placements with an Optuna study (or an exhaustive sweep), logged to MLflow"
DESCRIPTION = (
    "Search the accelerator architecture, microbatch and recompute choices of a search space; every trial "
    "runs the exact per-layer ILP schedules and the optimal placement DP, and is logged to MLflow. "
    "Re-running with the same study name and storage resumes the study; --trials is the study's total."
)


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", metavar="NAME",
                   help="model config name or YAML path; repeat for one common design across models, scored by "
                        "the mean throughput relative to each model's TPUv4 expert baseline (default gpt3-175b)")
    p.add_argument("--space", default="phaze", help="search space config name or YAML path (default phaze)")
    p.add_argument("--system", default="default", help="system config name or YAML path (default default)")
    p.add_argument("--sampler", default="auto", metavar="NAME",
                   help=f"Optuna sampler: auto, {', '.join(SAMPLERS)} (default auto: bound, the bound-guided sampler, "
                        "where the proven throughput bounds apply (one model, throughput or throughput,area), else tpe)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0; a seed gives the same study)")
    p.add_argument("--trials", type=int, default=500,
                   help="finished trials the study should hold; a resumed study runs only the rest (default 500)")
    p.add_argument("--objectives", default="throughput", metavar="LIST",
                   help="throughput[,area][,energy][,cost]; several give a Pareto front, saved as a PNG (default throughput)")
    p.add_argument("--study-name", default=None,
                   help="Optuna study name (default derived from model, space, system, sampler/mode, seed)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage URL, e.g. postgresql://user@host/db (default sqlite:///studies/<study-name>.db)")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URL",
                   help=f"MLflow tracking URI, or 'off' (default {DEFAULT_TRACKING_URI}, artifacts under mlruns/)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the study through its storage (Optuna's distributed mode; default 1)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="a Dask scheduler, tcp://HOST:PORT: the pruned sweep's bounds and evaluations, or a sampled "
                        "study's --workers loops, run as tasks on its workers (one thread each; --workers N keeps "
                        "N tasks in flight). Default: this machine's processes")
    p.add_argument("--exhaustive", action="store_true",
                   help="evaluate every grid point of the space instead of sampling (--trials is ignored)")
    p.add_argument("--order", default="area", metavar="area|grid",
                   help="exhaustive order: area (decreasing area, the published sweep; default) or grid")
    p.add_argument("--prune", default="auto", metavar="bound|off|auto",
                   help="exhaustive: settle points whose proven throughput upper bound cannot beat the best "
                        "evaluated design without evaluating them (exact; they are listed in "
                        "<output-dir>/<study>-points.csv.gz); auto (default) uses it with --hysteresis off, "
                        "one model and the throughput objective")
    p.add_argument("--hysteresis", default="off", metavar="K|off",
                   help="exhaustive: stop once the best throughput of the last K area groups stops improving "
                        "(the published rule uses 5); off evaluates every point (default off)")
    p.add_argument("--area-group-mm2", type=float, default=PHAZE_AREA_GROUP_MM2,
                   help=f"exhaustive: width of an area group in mm^2 (default {PHAZE_AREA_GROUP_MM2}, the published 10,000 um^2)")
    p.add_argument("--output-dir", default="studies", help="where storages, plots and summaries go (default studies)")
    add_ilp_time_limit(p)
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="always show the progress bar (default: a bar when stderr is a terminal, else a plain "
                        "progress line every 10 s and at the end)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")
    p.add_argument("--reference-arch", default="tpuv4", metavar="NAME",
                   help="the reference chip every ratio divides by, its baseline and first trials (default tpuv4, "
                        "Phaze's; b200 for the frontier space)")
    p.add_argument("--reference-system", default=None, metavar="NAME",
                   help="system the reference chip's baseline runs on (default: tpuv4-pod, the TPU v4 pod's torus, "
                        "for tpuv4; else the study's --system)")


def heartbeat(args) -> str | None:
    """The label of the "still ..." lines while the study sets up, bounds, runs a long trial or flushes;
    none with --no-progress, which asks for silence."""
    if args.progress is False:
        return None
    return "study " + "+".join(args.model or ("gpt3-175b",))


def config_from_args(args) -> StudyConfig:
    return StudyConfig(
        models=tuple(args.model or ("gpt3-175b",)),
        space=args.space,
        system=args.system,
        sampler=args.sampler,
        seed=args.seed,
        trials=args.trials,
        objectives=args.objectives,
        study_name=args.study_name,
        storage=args.storage,
        tracking_uri=args.tracking_uri,
        workers=args.workers,
        strategy=strategy_from_flags(args.exhaustive, args.prune),
        order=args.order,
        hysteresis=args.hysteresis,
        area_group_mm2=args.area_group_mm2,
        output_dir=args.output_dir,
        progress=args.progress,
        ilp_time_limit_s=args.ilp_time_limit,
        reference_system=args.reference_system,
        cluster=args.cluster,
        reference_arch=args.reference_arch,
    )


def run(args) -> dict:
    from ..search import run_study

    return run_study(config_from_args(args))


def render(result: dict) -> str:
    if not result.get("nothing_to_run"):
        return _render(result)
    text = f"nothing run: study {result['study']} holds {result['held']} finished trials (asked for {result['requested']})"
    if "trials" not in result:  # no saved summary to show
        return text
    return f"{text}; its summary when it last ran:\n{_render(result)}"
