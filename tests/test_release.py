"""Version, changelog and documentation details that must stay consistent."""

import datetime
import importlib.util
import re
from pathlib import Path

import tomllib

import backpack
from backpack import _version

ROOT = Path(__file__).resolve().parents[1]


def test_one_source_of_the_version():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "backpack._version.__version__"
    }
    assert backpack.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", backpack.__version__)
    # SPDX string: the TOML-table form makes setuptools warn on every build
    assert pyproject["project"]["license"] == "MIT"


def test_changelog_starts_with_the_current_version():
    """The first version heading (after an optional "Unreleased" one) is the current version;
    every version heading carries its release date, `## 0.3.0 (2026-11-27)`, newest first."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.*)$", changelog, re.MULTILINE)
    assert "Unreleased" not in headings[1:]  # only at the top
    versions = [h for h in headings if h != "Unreleased"]
    dated = [re.fullmatch(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)", h) for h in versions]
    assert all(dated), [h for h, m in zip(versions, dated) if not m]
    assert dated[0].group(1) == backpack.__version__
    dates = [m.group(2) for m in dated]
    assert dates == sorted(dates, reverse=True)
    for date in dates:
        datetime.date.fromisoformat(date)


def test_home_page_shows_the_version():
    spec = importlib.util.spec_from_file_location("gen_layers_v", ROOT / "docs" / "gen_layers.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    VERSION_MARKER, on_page_markdown = gen.VERSION_MARKER, gen.on_page_markdown
    index = (ROOT / "docs" / "index.md").read_text()
    assert VERSION_MARKER in index
    rendered = on_page_markdown(index, None, None, None)
    assert f"Version {backpack.__version__}" in rendered


def test_table_code_cells_do_not_break_identifiers():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "stylesheets/extra.css" in config
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rule = css[css.index("table") : css.index("}")]
    assert "code" in rule and "white-space: nowrap" in rule and "word-break: keep-all" in rule
