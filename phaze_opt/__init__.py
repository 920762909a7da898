"""phaze_opt: co-design search over a training accelerator's architecture and the device placement
of a large language model on a cluster of such chips (after Phaze, Wang et al., ICML 2024)."""

__version__ = "0.1.0"


def results(study: str, storage: str | None = None, output_dir: str = "studies"):
    """A study's finished trials as a pandas DataFrame, one row per trial: the design, the recipe,
    the placement, every metric with its unit in the column name, feasibility and reason, timings
    (`phaze-opt export` writes the same table). `study`: its name (`<output_dir>/<name>.db`), its
    `.db` file, or its name in the Optuna `storage` URL."""
    from .experiments.results import results as table

    return table(study, storage, output_dir)
