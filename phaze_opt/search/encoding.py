"""How a search-space point becomes Optuna parameters and back.

A space lists ordered choices per parameter (`SearchSpace.params`). Handing every one to Optuna as
an unordered categorical would throw away what a hardware architect knows: 64 tensor cores lie
between 32 and 128. So ordered numeric choices are sampled as integers, which TPE, CMA-ES, QMC and
GP models all treat as ordered:

- powers of two with consecutive exponents (the published space is all of these) are sampled by
  exponent, as `log2_<name>`, so a Parzen window is as wide for 2..4 as for 1024..2048;
- other monotone numeric lists are sampled by position, as `<name>_idx`;
- everything else (booleans, strings, unordered lists) stays categorical under its own name; a
  choice that is itself a list (a recipe's `recompute_modules`) by a text label, its names joined
  by `+`, since Optuna's categorical choices are plain values;
- a parameter with one choice is fixed and never sampled.

The decoded point (the values the space itself uses) is what every report, MLflow run and
evaluator sees; the encoded names only live inside Optuna's storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from ..errors import PhazeError, shown

LOG2, INDEX, CATEGORICAL, FIXED = "log2", "index", "categorical", "fixed"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _power_of_two_exponents(choices: tuple) -> list[int] | None:
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in choices):
        return None
    exps = []
    for c in choices:
        if c & (c - 1):
            return None
        exps.append(c.bit_length() - 1)
    if exps != list(range(exps[0], exps[0] + len(exps))):
        return None
    return exps


def _monotone(choices: tuple) -> bool:
    pairs = list(zip(choices, choices[1:]))
    return all(a < b for a, b in pairs) or all(a > b for a, b in pairs)


@dataclass(frozen=True)
class ParamCoding:
    name: str  # the space's parameter name
    key: str  # the Optuna parameter name
    kind: str  # log2 | index | categorical | fixed
    choices: tuple
    first_exponent: int = 0  # log2 only
    labels: tuple = ()  # categorical with list choices: each choice's text label, in Optuna's storage

    def distribution(self) -> BaseDistribution | None:
        if self.kind == LOG2:
            return IntDistribution(self.first_exponent, self.first_exponent + len(self.choices) - 1)
        if self.kind == INDEX:
            return IntDistribution(0, len(self.choices) - 1)
        if self.kind == CATEGORICAL:
            return CategoricalDistribution(self.labels or self.choices)
        return None

    def encode(self, value: Any) -> Any:
        position = self._position(value)
        if self.kind == LOG2:
            return self.first_exponent + position
        if self.kind == INDEX:
            return position
        return (self.labels or self.choices)[position]

    def decode(self, internal: Any) -> Any:
        if self.kind == LOG2:
            return self.choices[int(internal) - self.first_exponent]
        if self.kind == INDEX:
            return self.choices[int(internal)]
        if self.kind == FIXED:
            return self.choices[0]
        if self.labels:
            return self.choices[self.labels.index(internal)]
        return internal

    def suggest(self, trial) -> Any:
        if self.kind == LOG2:
            lo = self.first_exponent
            return self.decode(trial.suggest_int(self.key, lo, lo + len(self.choices) - 1))
        if self.kind == INDEX:
            return self.decode(trial.suggest_int(self.key, 0, len(self.choices) - 1))
        if self.kind == CATEGORICAL:
            return self.decode(trial.suggest_categorical(self.key, self.labels or self.choices))
        return self.choices[0]

    def _position(self, value: Any) -> int:
        if hasattr(value, "item") and callable(value.item):  # numpy scalars
            value = value.item()
        for i, c in enumerate(self.choices):
            # `True == 1` in Python; a point must not match a bool choice with an int or back.
            if type(c) is type(value) and c == value:
                return i
        for i, c in enumerate(self.choices):
            if _is_number(c) and _is_number(value) and c == value:
                return i
            if isinstance(c, (list, tuple)) and isinstance(value, (list, tuple)) and tuple(c) == tuple(value):
                return i  # a list choice read back from JSON
        raise ValueError(f"value {shown(value)} of '{self.name}' is not one of its choices {list(self.choices)}")


def coding_for(name: str, choices) -> ParamCoding:
    choices = tuple(choices)
    if not choices:
        raise PhazeError(f"search space parameter '{name}' has no choices")
    if len(set(map(repr, choices))) != len(choices):
        raise PhazeError(f"search space parameter '{name}' repeats a choice: {list(choices)}")
    if len(choices) == 1:
        return ParamCoding(name, name, FIXED, choices)
    exps = _power_of_two_exponents(choices)
    if exps is not None:
        return ParamCoding(name, f"log2_{name}", LOG2, choices, first_exponent=exps[0])
    if all(_is_number(c) for c in choices) and _monotone(choices):
        return ParamCoding(name, f"{name}_idx", INDEX, choices)
    for c in choices:
        if isinstance(c, (list, tuple)) and all(isinstance(x, str) for x in c):
            continue
        if not (c is None or isinstance(c, (bool, int, float, str))):
            raise PhazeError(f"search space parameter '{name}': choice {shown(c)} is not a number, string, "
                             "boolean or list of names")
    if any(isinstance(c, (list, tuple)) for c in choices):
        labels = tuple("+".join(c) if isinstance(c, (list, tuple)) else c for c in choices)
        if len(set(map(repr, labels))) != len(labels):
            raise PhazeError(f"search space parameter '{name}': choices {list(choices)} share a label once joined by '+'")
        return ParamCoding(name, name, CATEGORICAL, choices, labels=labels)
    return ParamCoding(name, name, CATEGORICAL, choices)


class SpaceCodec:
    """Encodes the points of one search space for Optuna (see the module docstring)."""

    def __init__(self, params: Mapping[str, Any]):
        if not params:
            raise PhazeError("the search space has no parameters")
        self.codings = [coding_for(name, choices) for name, choices in params.items()]
        keys = [c.key for c in self.codings if c.kind != FIXED]
        if len(set(keys)) != len(keys):
            raise PhazeError(f"search space parameter names collide once encoded: {sorted(keys)}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.codings]

    def distributions(self) -> dict[str, BaseDistribution]:
        return {c.key: c.distribution() for c in self.codings if c.kind != FIXED}

    def encode(self, point: Mapping[str, Any]) -> dict[str, Any]:
        missing = [c.name for c in self.codings if c.name not in point]
        if missing:
            raise ValueError(f"point lacks parameters {missing}")
        return {c.key: c.encode(point[c.name]) for c in self.codings if c.kind != FIXED}

    def decode(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {c.name: c.decode(params[c.key]) if c.kind != FIXED else c.choices[0] for c in self.codings}

    def suggest(self, trial) -> dict[str, Any]:
        return {c.name: c.suggest(trial) for c in self.codings}

    def contains(self, point: Mapping[str, Any]) -> bool:
        try:
            self.encode(point)
        except ValueError:
            return False
        return True

    def describe(self) -> list[dict]:
        return [{"name": c.name, "optuna_name": c.key, "kind": c.kind, "choices": list(c.choices)} for c in self.codings]
