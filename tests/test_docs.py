"""The documentation a newcomer reads stays whole: every relative link and anchor resolves, the README's
quick start is the Makefile's, every benchmark script has its section in BENCHMARKS.md, and no comment
or page cites an issue number in place of a reason (a number means nothing to a reader of the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-heading-with-code) [gone](c.md) [wrong](b.md#elsewhere) [web](https://x.org/y)\n")
    assert broken_links(page) == ["c.md (no such file)", "b.md#elsewhere (no such heading)"]


def test_readme_quick_start_is_the_makefiles_two_targets():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("study", "test"):
        assert f"    make {target} " in readme, f"README's quick start lacks `make {target}`"
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no `{target}` target"


def test_readme_stays_short_enough_to_read():
    """The README is the newcomer's page (what it is, the two commands, MLflow, one example, where to
    read more); the rest belongs in docs/."""
    assert len((REPO / "README.md").read_bytes()) <= 15_000


def test_every_benchmark_script_has_its_section():
    text = (REPO / "BENCHMARKS.md").read_text()
    scripts = sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))
    assert scripts
    assert [s for s in scripts if f"benchmarks/{s}" not in text and f"`{s}" not in text] == []


def cites_an_issue(line: str) -> bool:
    return any(not re.search(r"[\w.-]+/[\w.-]+ $", line[:m.start()]) for m in re.finditer(r"\bissues?[ -]?#?\d+", line, re.I))


def test_the_issue_check_tells_a_tracker_number_from_a_source():
    assert cites_an_issue("# the placement (issue 19): why") and cites_an_issue("Issue 7 acceptance")
    assert cites_an_issue("the issue-6 flow") and not cites_an_issue("(NVIDIA/nccl issue #412)")


def test_no_comment_or_page_cites_an_issue_number():
    sources = [p for d in ("phaze_opt", "tests", "benchmarks") for p in (REPO / d).rglob("*")
               if p.suffix in (".py", ".yaml", ".md") and p.is_file()]
    found = [f"{p.relative_to(REPO)}:{n}" for p in [*sources, *PAGES]
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if cites_an_issue(line) and p.name != "test_docs.py"]
    assert found == []


def test_every_shipped_preset_is_in_models_md():
    """docs/models.md names every shipped model, arch, space and system (a `megatron-gpt-*` pattern
    counts for the names it matches), so a new preset cannot ship undocumented."""
    import fnmatch

    named = set(re.findall(r"`([^`\s]+)`", (REPO / "docs" / "models.md").read_text()))
    missing = [f"{kind}/{path.stem}" for kind in ("models", "archs", "spaces", "systems")
               for path in sorted((REPO / "phaze_opt" / "presets" / kind).glob("*.yaml"))
               if not any(fnmatch.fnmatchcase(path.stem, name) for name in named)]
    assert not missing, f"docs/models.md does not name: {', '.join(missing)}"


def test_readme_and_operations_agree_on_how_long_make_test_takes():
    said = {page: re.findall(r"`make test` about (\d+) min", (REPO / page).read_text())
            for page in ("README.md", "docs/operations.md")}
    assert all(said.values()) and len({n for found in said.values() for n in found}) == 1, said
