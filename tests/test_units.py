"""One spelling per unit in what the package prints: area as `mm^2` (never `mm2` or `mm²`). Names of
data (MLflow metrics, JSON keys, export columns, `--area-group-mm2`) keep their ASCII `_mm2`, which
stored studies and their runs are keyed on; those are identifiers, not prose."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "phaze_opt"
# `mm2` as a word of text: not part of an identifier (area_mm2) or a flag (--area-group-mm2)
OTHER_SPELLING = re.compile(r"mm²|(?<![\w-])mm2\b")
TEXT_TOKENS = {tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())


def _strings(path: Path):
    for token in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if token.type in TEXT_TOKENS:
            yield token.start[0], token.string


def test_area_is_written_mm_caret_2_in_every_string_of_the_package():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text.strip()[:80]}"
             for path in sorted(PACKAGE.rglob("*.py")) for line, text in _strings(path)
             if OTHER_SPELLING.search(text)]
    assert not found, "\n".join(found)


def test_the_check_sees_both_other_spellings():
    assert OTHER_SPELLING.search("area 3.1 mm2") and OTHER_SPELLING.search("(mm²)")
    assert not OTHER_SPELLING.search("area_mm2 --area-group-mm2 3.1 mm^2")
