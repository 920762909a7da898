"""Run infrastructure: what keeps a study's runs safe and visible, whatever search drives them.

MLflow logging (`tracking`), Optuna/MLflow agreement after any stop (`reconcile`), start-up locks
(`locks`), signals and worker lifetimes (`signals`, `processes`), progress lines (`progress`),
redacted URLs (`urls`) and the MLflow UI server (`ui_server`). Nothing here knows a design or a
search strategy, so `search/` sits above it. Packages above `search/` import the names below, not
the modules.
"""

from .locks import OPTUNA_TABLES, check_sqlite_storage, probe_database, sqlite_read_uri
from .progress import Heartbeat, say
from .tracking import (DEFAULT_TRACKING_URI, MlflowTracker, design_fields, driver_url, redact, sqlite_path,
                       tracking_enabled, trial_record)
from .ui_server import serve, serve_optuna

__all__ = [
    "DEFAULT_TRACKING_URI",
    "Heartbeat",
    "MlflowTracker",
    "OPTUNA_TABLES",
    "check_sqlite_storage",
    "probe_database",
    "design_fields",
    "driver_url",
    "redact",
    "say",
    "serve",
    "serve_optuna",
    "sqlite_path",
    "sqlite_read_uri",
    "tracking_enabled",
    "trial_record",
]
