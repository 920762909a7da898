"""A tiny search space and a cheap deterministic evaluator that follow the real interfaces exactly.

They let the study machinery (resume, constraints, failures, workers, MLflow, compare) be tested
in seconds and without the workload/ILP/placement pipeline. Module-level so worker processes can
unpickle them. No tests live here.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import asdict, dataclass, field

from phaze_opt.errors import PhazeError
from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.training import Training

MIB, GIB = 2**20, 2**30
# (model, compute_key, hbm_bytes, mbs, recomputes, placement, training, system) of every evaluation
CALLS: list = []


@dataclass
class FakeResult:
    feasible: bool
    reason: str
    throughput: float
    tokens_per_s: float
    time_per_batch_s: float
    area_mm2: float
    mfu: float
    placement: dict
    timings: dict
    layers: list = field(default_factory=list)
    model: str = ""
    energy_j: float | None = None
    proven: bool = True
    throughput_bound: float | None = None  # None: equal to throughput
    unproven: list = field(default_factory=list)

    def __post_init__(self):
        if self.throughput_bound is None:
            self.throughput_bound = self.throughput

    def to_json(self) -> dict:
        return asdict(self)


class FakeSpace:
    """num_tc x tc_x (square PE arrays, vector width tied) x GLB x HBM x mbs x recompute."""

    def __init__(self, budget: float = 100.0, params: dict | None = None, name: str = "fake"):
        self.name = name
        self.params = params if params is not None else {
            "num_tc": [1, 2, 4, 8], "tc_x": [8, 16, 32], "glb_mib": [2, 4], "hbm_gib": [16, 32],
            "mbs": [1, 2], "recompute": [False, True]}
        self.area_budget_mm2 = budget

    def accelerator(self, point: dict) -> Accelerator:
        x = point["tc_x"]
        return Accelerator(num_tc=point["num_tc"], tc_x=x, tc_y=x, num_vc=2, vc_width=x,
                           glb_bytes=point["glb_mib"] * MIB, glb_bw=1e12, hbm_bytes=point["hbm_gib"] * GIB,
                           hbm_bw=1e12 if point["hbm_gib"] == 16 else 2e12, clock_hz=1e9)

    def area(self, point: dict) -> float:
        return point["num_tc"] * point["tc_x"] ** 2 / 64 + 2 * point["glb_mib"]

    def area_check(self, point: dict):
        a = self.area(point)
        if a > self.area_budget_mm2:
            return False, a, f"area {a:.1f} mm² exceeds the {self.area_budget_mm2:.1f} mm² budget"
        return True, a, ""

    def constant_arch_fields(self) -> dict:
        """As SearchSpace's: `accelerator` fixes num_vc, glb_bw and clock_hz; the rest follow the params."""
        return {"num_vc": 2, "glb_bw": 1e12, "clock_hz": 1e9}

    def grid_points(self, order: str = "area") -> list[dict]:
        names = list(self.params)
        pts = [dict(zip(names, vals)) for vals in itertools.product(*(self.params[n] for n in names))]
        pts = [p for p in pts if self.area_check(p)[0]]
        if order == "area":
            pts.sort(key=lambda p: -self.area(p))
        return pts

    reference_arch = {"num_tc": 4, "tc_x": 16, "glb_mib": 4, "hbm_gib": 32}

    def reference_point(self, arch="tpuv4", recipe=None) -> dict:
        """The reference chip at `recipe` (point values); a recipe field it leaves out takes the
        space's first choice (recompute: off)."""
        recipe = dict(recipe or {})
        point = dict(self.reference_arch)
        for name, choices in self.params.items():
            if name in point:
                continue
            default = False if name == "recompute" else choices[0]
            point[name] = recipe.get(name, default)
        return point


REFERENCE = Accelerator(num_tc=4, tc_x=16, tc_y=16, num_vc=2, vc_width=16, glb_bytes=4 * MIB, glb_bw=1e12,
                        hbm_bytes=32 * GIB, hbm_bw=2e12, clock_hz=1e9, name="tpuv4")


def model_factor(model: str) -> float:
    return {"m-small": 1.0, "m-big": 0.25}.get(model, 0.5)


# Each recipe field moves the fake throughput (1.0 at the field's default), so a test can tell
# whether an evaluator saw the whole recipe.
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 0.9, "full": 0.8}
ZERO_FACTOR = {0: 1.0, 1: 0.99, 2: 0.97, 3: 0.95}


def training_throughput(model: str, arch: Accelerator, training: Training) -> float:
    """A made-up but deterministic throughput with interactions, so samplers have something to learn."""
    peak = arch.num_tc * arch.tc_x * arch.tc_y
    glb = arch.glb_bytes / MIB
    eff = (1.0 + 0.1 * glb) * (1.0 + 0.3 * (training.mbs - 1)) * RECOMPUTE_FACTOR[training.recompute]
    eff *= (arch.hbm_bw / 2e12) ** 0.5
    eff *= 0.7 if training.placement.spec() == "expert" else 1.0
    eff *= (1.03 if training.sequence_parallel else 1.0) * (1.0 + 0.02 * (training.virtual_stages - 1))
    eff *= ZERO_FACTOR[training.zero] * (1.04 if training.overlap_grad_reduce else 1.0)
    eff *= 1.02 if training.overlap_param_gather else 1.0
    eff *= 1.05 if training.attention == "flash" else 1.0
    eff /= training.capacity_factor * training.load_imbalance
    return round(peak * eff * model_factor(model), 6)


def fake_throughput(model: str, arch: Accelerator, mbs: int, recompute, placement: str = "optimal",
                    **recipe) -> float:
    """`training_throughput` of the recipe given field by field (for tests' expected values)."""
    return training_throughput(model, arch, Training(mbs, recompute, placement, **recipe))


def fake_evaluate(model, arch, training: Training, system="default"):
    assert isinstance(training, Training), f"an evaluator takes a Training, got {training!r}"
    mbs, placement = training.mbs, training.placement.spec()
    CALLS.append((model, arch.compute_key, arch.hbm_bytes, mbs, training.recomputes, placement, training, system))
    if arch.num_tc == 2 and mbs == 2 and placement == "optimal":
        raise ValueError("solver exploded on this design")
    area = arch.num_tc * arch.tc_x ** 2 / 64 + 2 * arch.glb_bytes / MIB
    placement_dict = {"tp": 1, "pp": 2, "dp": 4, "microbatches": 8,
                      "stages": [{"layers": [0, 3], "devices": 4}, {"layers": [4, 7], "devices": 4}]}
    timings = {"graph_s": 0.001, "estimate_s": 0.002, "ilp_s": 0.003, "dp_s": 0.004}
    if model == "m-big" and arch.hbm_bytes == 16 * GIB and not training.recomputes:
        return FakeResult(False, "needs at least 20.0 GiB per device, HBM has 16.0 GiB", 0.0, 0.0, float("inf"),
                          area, 0.0, {}, timings, [], model, None)
    thr = training_throughput(model, arch, training)
    layers = [{"layer": i, "fwd_s": 0.001 * (i + 1), "bwd_s": 0.002 * (i + 1)} for i in range(8)]
    return FakeResult(True, "", thr, thr * 1024, 4096 / thr, area, min(1.0, thr / 5000), placement_dict, timings,
                      layers, model, energy_j=area * 10.0 + 1000.0 / thr)


# Every recipe field a space can sample, with every choice: what a trial may get, the baseline gets.
EVERY_RECIPE = {"mbs": [1, 2], "recompute": ["none", "selective", "full"], "sequence_parallel": [False, True],
                "virtual_stages": [1, 2], "zero": [0, 1, 2, 3], "overlap_grad_reduce": [False, True],
                "attention": ["unfused", "flash"], "precision": ["bf16", "fp8"], "overlap_param_gather": [False, True]}


class RecordingEvaluator:
    """Records every `Training` it is given and scores each recipe by a fixed pseudo-random number,
    so the best recipe is known only to one who tried them all, field by field."""

    def __init__(self, expert_fits=True):
        self.seen: list = []  # (training, system) of every call
        self.expert_fits = expert_fits

    @staticmethod
    def score(training: Training) -> float:
        key = repr(sorted((k, v) for k, v in training.recipe().items() if k != "placement")).encode()
        return 1.0 + int(hashlib.sha256(key).hexdigest()[:8], 16) / 2**32

    def __call__(self, model, arch, training, system="default"):
        assert isinstance(training, Training)
        self.seen.append((training, system))
        r = fake_evaluate(model, arch, training, system=system)
        if training.placement.spec() == "expert" and not self.expert_fits:
            r.feasible, r.reason, r.throughput = False, "expert placement needs 99 GiB", 0.0
        elif r.feasible:
            r.throughput = self.score(training) * (0.5 if training.placement.spec() == "expert" else 1.0)
        return r


def fake_no_energy(model, arch, training, system="default"):
    r = fake_evaluate(model, arch, training, system=system)
    r.energy_j = None
    return r


class InterruptAfter:
    """An evaluator that raises KeyboardInterrupt (as Ctrl-C would) on its n-th optimal-placement call."""

    def __init__(self, n: int):
        self.n = n
        self.count = 0

    def __call__(self, model, arch, training, system="default"):
        if training.placement.spec() == "optimal":
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt
        return fake_evaluate(model, arch, training, system=system)


def check_model(name: str):
    if name not in ("m-small", "m-big"):
        raise PhazeError(f"unknown model '{name}'; choose one of m-big, m-small, or give a path to a YAML file")
    return name


# what `feature_fields` says of the fake models (its real output is checked on the shipped configs)
FAKE_FEATURES = {"m-small": {"attention": "mha", "kv_heads": "8", "moe_experts": "0", "params": "1000000"},
                 "m-big": {"attention": "gqa", "kv_heads": "2", "moe_experts": "8", "params": "4000000"}}


def describe_model(name: str) -> dict:
    return FAKE_FEATURES[check_model(name)]


def backend(space=None, evaluator=fake_evaluate):
    from phaze_opt.search.setup import Backend

    return Backend(evaluator=evaluator, space=space or FakeSpace(), reference_arch=REFERENCE, check_model=check_model,
                   describe_model=describe_model)


def config(tmp_path, **kw):
    from phaze_opt.search.setup import StudyConfig

    base = dict(models=("m-small",), space="fake", sampler="tpe", seed=0, trials=12, tracking_uri="off",
                output_dir=str(tmp_path / "studies"), progress=False)
    base.update(kw)
    if "storage" not in base:
        base["storage"] = f"sqlite:///{tmp_path / 'studies' / 'optuna.db'}"
    return StudyConfig(**base)


SMALL_PARAMS = {"num_tc": [1, 2, 4, 8], "tc_x": [8, 16, 32], "glb_mib": [4], "hbm_gib": [16, 32],
                "mbs": [1, 2], "recompute": [False, True]}  # 11 architectures in budget x 8 = 88 points


def small_space() -> FakeSpace:
    return FakeSpace(params={k: list(v) for k, v in SMALL_PARAMS.items()})


_MLFLOW_TEMPLATE: dict = {}


def mlflow_uri(directory) -> str:
    """A fresh MLflow SQLite store in `directory`, copied from one initialised once per session.

    Creating the MLflow schema takes seconds; copying an empty, already migrated database is instant.
    """
    import shutil
    import tempfile
    from pathlib import Path

    if "path" not in _MLFLOW_TEMPLATE:
        from phaze_opt.runs.tracking import MlflowTracker

        base = Path(tempfile.mkdtemp(prefix="mlflow-template-"))
        MlflowTracker.prepare(f"sqlite:///{base / 'mlflow.db'}", "template")
        _MLFLOW_TEMPLATE["path"] = base / "mlflow.db"
    target = Path(directory) / "mlruns"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(_MLFLOW_TEMPLATE["path"], target / "mlflow.db")
    return f"sqlite:///{target / 'mlflow.db'}"


def best_score_series(client, run_id) -> list[tuple[int, float]]:
    """A parent run's `best_score` history as (step, value), in step order."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "best_score"))


def expected_best_series(trials) -> list[tuple[int, float]]:
    """The best-so-far of the feasible trials' first objective, by trial number: one point per improvement."""
    out, best = [], None
    for t in sorted(trials, key=lambda t: t.number):
        feasible = t.state.name == "COMPLETE" and all(v <= 0 for v in t.constraints.values())
        if feasible and (best is None or t.values[0] > best):
            best = t.values[0]
            out.append((t.number, best))
    return out


class KillOnce:
    """An evaluator whose first optimal-placement call in a worker process kills that process with
    SIGKILL, as the kernel's out-of-memory killer does (`marker`: the file that says it happened)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, model, arch, training, system="default"):
        import multiprocessing
        import os
        import signal

        if training.placement.spec() == "optimal" and multiprocessing.parent_process() is not None:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one worker, once
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return fake_evaluate(model, arch, training, system=system)
