"""Installation details: the original BackPACK next to this package, license and metadata."""

import importlib.metadata
import re
import warnings
from pathlib import Path

import pytest
import tomllib

import backpack

ROOT = Path(__file__).resolve().parents[1]


def _fake_distributions(monkeypatch, installed):
    real = importlib.metadata.distribution

    def distribution(name):
        if name in installed:
            return object()
        if name == "backpack-for-pytorch":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_warns_when_the_original_backpack_is_installed_too(monkeypatch):
    _fake_distributions(monkeypatch, {"backpack-for-pytorch"})
    with pytest.warns(UserWarning, match=r"backpack-for-pytorch.*pip uninstall -y backpack-for"):
        backpack._warn_if_original_installed()


def test_silent_without_the_original_backpack(monkeypatch):
    _fake_distributions(monkeypatch, set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backpack._warn_if_original_installed()


def test_readme_install_section_explains_the_clash():
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quickstart")]
    for needle in (
        "python -m venv",
        "--index-url https://download.pytorch.org/whl/cpu",
        "backpack-for-pytorch",
        "pip uninstall",
    ):
        assert needle in install, needle


def test_license_file_and_project_metadata():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    assert "the backpack authors" in license_text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license-files"] == ["LICENSE"]
    assert project["urls"] and all(u.startswith("https://") for u in project["urls"].values())
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])
    # the SPDX `license` field replaces license classifiers (setuptools refuses both)
    assert not any(c.startswith("License ::") for c in project["classifiers"])


def test_readme_shows_the_command_line_and_links_existing_docs():
    readme = (ROOT / "README.md").read_text()
    assert "python -m backpack verify" in readme and "make docs" in readme
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 8
    for link in links:
        assert (ROOT / link).is_file(), link
    # pages are named by links, not in quotes
    for page in ("Good to know", "Real training loops", "Curvature of a data set"):
        assert f'"{page}"' not in readme, page


def test_docs_home_lists_the_guides():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in (
        "training-loops.md",
        "distributed.md",
        "transformers.md",
        "hugging-face.md",
        "curvature.md",
        "which-extension.md",
    ):
        assert f"]({page})" in index, page
    assert "which-extension.md" in (ROOT / "mkdocs.yml").read_text()
