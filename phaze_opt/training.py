"""How a model is trained on a design: the training recipe, validated once.

`Training` is the noun every layer that needs the recipe takes: the workload graph builder (the
microbatch), the placement DP's problem (microbatch and recompute), design evaluation (all of it)
and the search space (which of its fields a study samples). It sits at the bottom of the package
stack (it imports only `errors`), so every layer can take it without importing upward.

Today it holds

- `mbs`: sequences per microbatch (a positive integer);
- `recompute`: whether activations are recomputed in the backward pass instead of stashed;
- `placement`: "optimal" (the placement DP chooses TP/PP/DP and the stages), "expert" (the
  model config's own TP/PP/DP, layers split evenly) or a fixed "tp=T,pp=P,dp=D".

It is meant to grow: the recompute mode, sequence parallelism, virtual pipeline stages, optimizer
sharding, gradient-reduce overlap and the attention kernel are further fields of the same recipe.
A new field gets a default that means today's behaviour (so every caller and stored study keeps
working), its check in `__post_init__`, and, when a search space may sample it, its name in
`SAMPLED_FIELDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from .errors import PhazeError

# Training fields a search space samples (a space must list each; a one-item list fixes it).
SAMPLED_FIELDS = ("mbs", "recompute")
PLACEMENTS = ("optimal", "expert")  # besides a fixed "tp=T,pp=P,dp=D"


def is_mbs(value: Any) -> bool:
    """A valid microbatch size: a positive integer (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 1


def check_mbs(value: Any, name: str = "microbatch size", error: type[Exception] = PhazeError) -> int:
    """The microbatch check, the one every layer uses: `value` as an int, or `error` naming `name`
    (the flag, field or argument the caller knows it by)."""
    if not is_mbs(value):
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def recompute_flag(value: Any) -> bool:
    """Spaces may write recompute as a boolean or as on/off; the recipe holds a bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("on", "true", "yes", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("off", "false", "no", "0"):
        return False
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"recompute value {value!r} is not on/off")


def parse_placement_spec(text: str) -> dict:
    """`tp=8,pp=16,dp=8` -> {"tp": 8, "pp": 16, "dp": 8}; a one-line PhazeError otherwise."""
    allowed = ("tp", "pp", "dp")
    out: dict[str, int] = {}
    for part in str(text).split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in allowed:
            raise PhazeError(f"placement {text!r}: expected tp=T,pp=P,dp=D (positive integers), got {part.strip()!r}")
        if key in out:
            raise PhazeError(f"placement {text!r}: {key} given twice")
        try:
            number = int(value.strip())
        except ValueError:
            number = 0
        if number < 1:
            raise PhazeError(f"placement {text!r}: {key} must be a positive integer, got {value.strip()!r}")
        out[key] = number
    missing = [k for k in allowed if k not in out]
    if missing:
        raise PhazeError(f"placement {text!r}: missing {', '.join(missing)}; expected tp=T,pp=P,dp=D")
    return out


@dataclass(frozen=True)
class Training:
    """The recipe for running a model on a design (see the module docstring); immutable, hashable."""

    mbs: int = 1
    recompute: bool = False
    placement: str = "optimal"
    # "expert", or the parsed {"tp", "pp", "dp"} of a fixed placement; None for "optimal"
    fixed: str | dict | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "mbs", check_mbs(self.mbs))
        object.__setattr__(self, "recompute", recompute_flag(self.recompute))
        placement = str(self.placement)
        object.__setattr__(self, "placement", placement)
        if placement == "expert":
            object.__setattr__(self, "fixed", "expert")
        elif placement != "optimal":
            object.__setattr__(self, "fixed", parse_placement_spec(placement))

    @classmethod
    def from_point(cls, point: Mapping[str, Any], placement: str = "optimal") -> "Training":
        """The recipe of a search-space point (its sampled training fields)."""
        return cls(mbs=int(point["mbs"]), recompute=recompute_flag(point["recompute"]), placement=placement)

    def with_placement(self, placement: str) -> "Training":
        return replace(self, placement=placement)
