"""The documentation site (mkdocs.yml, docs/) builds in strict mode, so a broken link or
anchor, a page missing from the navigation or an API reference (mkdocstrings) that no
longer resolves fails the suite; the README and the pages read as a manual: short README,
no development history, every benchmark plot shown with its command, machine and date.
(tests/test_readme.py runs the pages' code blocks.) About 20 s on 2 cores."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md"] + sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("*/*.md"))
PAGES = [p for p in PAGES if p.parent.name not in ("timelines", "tfra_cuckoo_race")]
README_MAX_LINES = 200


@pytest.mark.timeout(600)
def test_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs requirements (make test installs "
                        "requirements-docs.txt first; by hand: pip install -r requirements-docs.txt)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site"), "--config-file", str(REPO_ROOT / "mkdocs.yml")],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{text[-6000:]}"
    site = tmp_path / "site"
    # The API reference rendered the docstrings (not an empty page per module).
    layers = (site / "reference" / "layers" / "index.html").read_text()
    assert "FusedEmbedding" in layers and "doc-heading" in layers, layers[:2000]
    for name in ("benchmarks", "guide/getting-started", "guide/troubleshooting"):
        assert (site / name / "index.html").exists(), name


def test_readme_is_short():
    lines = (REPO_ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


# Development history has no place in a manual: commit hashes, issue numbers, "this
# session", figures "before" a change.
HISTORY = [
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"), "a commit hash"),
    (re.compile(r"\b[Ii]ssues? #?\d+"), "an issue number"),
    (re.compile(r"(?<![\w&])#\d+\b"), "an issue number"),
    (re.compile(r"\bthis session\b|\bprevious session\b", re.I), "a session"),
    (re.compile(r"\bcommit\b", re.I), "a commit"),
]


def test_pages_carry_no_development_history():
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for pattern, what in HISTORY:
                if pattern.search(line):
                    found.append(f"{page.relative_to(REPO_ROOT)}:{n}: {what}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_benchmark_page_shows_every_plot_with_its_json_and_date():
    page = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^## ", page, flags=re.M)
    plots = sorted((DOCS / "plots").glob("*.png"))
    assert plots
    for plot in plots:
        holding = [s for s in sections if f"(plots/{plot.name})" in s]
        assert holding, f"docs/benchmarks.md does not show docs/plots/{plot.name}"
        section = " ".join(holding[0].split())
        assert "python -m tf_fusedemb.benchmarks." in section, f"{plot.name}: no command"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"{plot.name}: no date"
        assert "vCPU" in section, f"{plot.name}: no machine"
        json_file = plot.with_suffix(".json")
        assert json_file.exists() and f"docs/plots/{json_file.name}" in section, \
            f"{plot.name}: its JSON file is not named beside it"


def test_readme_figures_name_their_json_file():
    """Each headline figure row names a committed JSON file with a machine and a date."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in section.splitlines() if l.startswith("| ") and "`docs/" in l]
    assert rows, "the README's headline figures table is gone"
    for row in rows:
        path = re.search(r"`(docs/[^`]+\.json)`", row)
        assert path and (REPO_ROOT / path.group(1)).exists(), row
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row) and "vCPU" in row, row


@pytest.mark.parametrize("module", ["train", "serve"])
def test_commands_page_lists_every_option(module):
    """docs/guide/commands.md documents every option of the command's --help."""
    out = subprocess.run([sys.executable, "-m", f"tf_fusedemb.{module}", "--help"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    options = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", out.stdout, re.M)) - {"--help"}
    assert options, out.stdout
    page = (DOCS / "guide" / "commands.md").read_text()
    section = page.split(f"## `python -m tf_fusedemb.{module}`", 1)[1].split("\n## ", 1)[0]
    missing = sorted(o for o in options if f"| `{o}` |" not in section)
    assert not missing, f"tf_fusedemb.{module} options missing from docs/guide/commands.md: {missing}"
