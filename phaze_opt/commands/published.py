"""`phaze-opt published` (also `python benchmarks/published_comparison.py`): the published comparison table."""

from __future__ import annotations

from . import add_ilp_time_limit
from ..experiments.published import DEFAULT_TRIALS, EXTRA_MODELS, MODELS, SYSTEMS

HELP = "the published comparison: TPUv4 vs expert-placement search vs co-optimised vs common design"
DESCRIPTION = (
    "For each system and model: TPUv4 with the expert and with the optimal placement, the best design with the "
    "expert placement fixed, the co-optimised design per model and one common design across the models "
    "(TPE studies with --trials each), as throughput and ratio to TPUv4 with the expert placement, beside "
    "Phaze's published 3.6x and 2.9x. Writes <output-dir>/published.json and published.md."
)


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", metavar="NAME",
                   help=f"model config name or YAML path; repeat (default {', '.join(MODELS)})")
    p.add_argument("--system", action="append", metavar="NAME",
                   help=f"system config name or YAML path; repeat (default {', '.join(SYSTEMS)})")
    p.add_argument("--space", default="phaze", help="search space (default phaze)")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"trials per study: rows 3 and 4 per model, row 5 once per system (default {DEFAULT_TRIALS})")
    p.add_argument("--seed", type=int, default=0, help="TPE seed of every study (default 0)")
    p.add_argument("--workers", type=int, default=1, help="processes per study (default 1)")
    p.add_argument("--tracking-uri", default="off", metavar="URL",
                   help="MLflow tracking URI for the studies, or 'off' (default off)")
    p.add_argument("--output-dir", default="studies/published",
                   help="study storages, published.json and published.md (default studies/published)")
    p.add_argument("--extra-model", action="append", metavar="NAME",
                   help=f"a model compared as TPUv4 against its co-designed chip only (rows 1, 2, 4); repeat "
                        f"(default {', '.join(EXTRA_MODELS)}: a mixture of experts and a 32K-token context)")
    p.add_argument("--no-extra", action="store_true", help="leave out the MoE and long-context models")
    add_ilp_time_limit(p)
    p.add_argument("--reference-system", default=None, metavar="NAME",
                   help="system rows 1 and 2 (TPUv4) run on (default tpuv4-pod, the TPU v4 pod's torus)")
    p.add_argument("--resume", action="store_true",
                   help="reuse this table's studies in --output-dir instead of starting them afresh")


def config_from_args(args):
    from ..experiments.published import PublishedConfig

    return PublishedConfig(
        models=tuple(args.model or MODELS), systems=tuple(args.system or SYSTEMS), space=args.space,
        trials=args.trials, seed=args.seed, workers=args.workers, tracking_uri=args.tracking_uri,
        output_dir=args.output_dir, fresh=not args.resume, ilp_time_limit_s=args.ilp_time_limit,
        extra_models=() if args.no_extra else tuple(args.extra_model or EXTRA_MODELS),
        reference_system=args.reference_system,
    )


def run(args) -> dict:
    from ..experiments.published import run_published, write_outputs

    result = run_published(config_from_args(args))
    result["files"] = write_outputs(result, args.output_dir)
    return result


def render(result: dict) -> str:
    from ..experiments.published import render as _render

    files = result.get("files") or {}
    tail = f"\nwrote {files.get('json')} and {files.get('markdown')}" if files else ""
    return _render(result) + tail


def heartbeat(args) -> str:
    """The label of the line `phaze-opt` prints every 10 s while the comparison's studies run."""
    return "published"
