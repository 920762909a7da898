"""The published comparison (Phaze, ICML 2024) in one command, with its wall time and machine.

    python benchmarks/published_comparison.py [--trials N] [--model M ...] [--system S ...] [--resume]

The same as `phaze-opt published` (see `phaze_opt/experiments/published.py` for what each row is), plus a
header with the command, the wall time and the machine, written beside the table in
studies/published/published.md.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from phaze_opt.cli import build_parser  # noqa: E402
from phaze_opt.errors import PhazeError  # noqa: E402


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, load average at the end {load}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(["published", *argv])
    module = args._module
    t0 = time.perf_counter()
    try:
        result = module.run(args)
    except PhazeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    command = " ".join(["python benchmarks/published_comparison.py", *argv])
    header = f"Command: `{command}`; wall time {wall / 60:.1f} min ({wall:.0f} s); machine: {machine()}.\n\n"
    md = Path(result["files"]["markdown"])
    md.write_text(header + md.read_text())
    print(header + module.render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
