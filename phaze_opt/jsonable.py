"""Strict JSON for results: one converter for CLI output, Optuna attributes and files."""

from __future__ import annotations

import math


def jsonable(value):
    """Strict-JSON form of results (no NaN/inf, tuples or numpy scalars), for Optuna attrs and files."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "to_json") and callable(value.to_json):
        return jsonable(value.to_json())
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
