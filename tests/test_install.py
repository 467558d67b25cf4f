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


# --- install hints and dependencies ------------------------------------------------------------


def _text_files():
    for pattern in ("README.md", "docs/**/*.md", "backpack/**/*.py", "examples/**/*.py"):
        yield from ROOT.glob(pattern)


def test_no_install_hint_names_the_unpublished_distribution():
    """`pip install backpack-torch[...]` fails: the package installs from a checkout."""
    for path in _text_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert "backpack-torch[" not in line, f"{path.relative_to(ROOT)}:{number}: {line}"
    laplace = (ROOT / "docs" / "laplace.md").read_text()
    assert 'pip install -e ".[laplace]"' in laplace


def test_dependencies_cover_the_modules_the_library_imports():
    """Every third-party module imported at the top of a library module is a dependency."""
    import ast
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=!~ ;\[]", dep)[0] for dep in project["dependencies"]}
    # numpy: torch's wheels do not depend on it, and torch warns on every import without it
    assert {"torch", "numpy"} <= required
    imported = {}
    for path in (ROOT / "backpack").rglob("*.py"):
        if "utils/data" in path.as_posix():  # the script that made the bundled digits
            continue
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "backpack":
                    imported.setdefault(top, path.name)
    assert set(imported) <= required, imported


# --- the Makefile keeps a compatible torch -----------------------------------------------------


def _load_torch_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_check", ROOT / "tools" / "torch_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_check_versions():
    check = _load_torch_check()
    assert check.release("2.13.0+cpu") == (2, 13, 0)
    assert check.release("2.5.0a0+git123") == (2, 5, 0)
    assert check.satisfies("2.14.1+cu130", ">=2.14.0")
    assert check.satisfies("2.13.0+cpu", "==2.13.0")
    assert not check.satisfies("2.13.0+cpu", "==2.14.1")
    assert check.satisfies("2.13.1", "==2.13.*") and not check.satisfies("2.14.0", "==2.13.*")
    assert not check.satisfies("2.14.0", ">=2.4,<2.14")
    assert check.torch_requirement(["numpy", "torch (>=2.14.0)", "pillow"]) == ">=2.14.0"
    assert check.torch_requirement(["torch==2.13.0", "scipy; extra == 'x'"]) == "==2.13.0"
    assert check.torch_requirement(["torchaudio==2.13.0", "torch; extra == 'x'"]) is None


def _fake_versions(monkeypatch, torch_version, requires):
    """Installed torch of `torch_version`; torchvision requiring `requires` (None: none)."""
    real_version, real_requires = importlib.metadata.version, importlib.metadata.requires

    def version(name):
        if name == "torch":
            return torch_version
        if name == "torchvision":
            if requires is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return "0.99.0"
        return real_version(name)

    def requires_(name):
        return requires if name == "torchvision" else real_requires(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "requires", requires_)


def test_torch_check_decides_what_to_keep(monkeypatch, tmp_path, capsys):
    pytest.importorskip("torchvision")
    check = _load_torch_check()
    _fake_versions(monkeypatch, "2.13.0+cpu", None)
    kept, reason, version = check.check()
    assert kept is None and "no torchvision" in reason and version == "2.13.0+cpu"
    assert check.check(torch_only=True)[0] == {"torch": "2.13.0+cpu"}
    assert check.main([str(tmp_path / "c.txt")]) == 1
    out = capsys.readouterr().out
    assert "torch==2.14.1 torchvision==0.29.1" in out
    assert "pip install torchvision --index-url https://download.pytorch.org/whl/cpu" in out

    _fake_versions(monkeypatch, "2.13.0+cpu", ["numpy", "torch==2.14.1"])
    kept, reason, _ = check.check()
    assert kept is None and "needs torch ==2.14.1, not 2.13.0+cpu" in reason

    _fake_versions(monkeypatch, "2.13.0+cpu", ["numpy", "torch==2.13.0"])
    assert check.check()[0] == {"torch": "2.13.0+cpu", "torchvision": "0.99.0"}
    assert check.main([str(tmp_path / "c.txt")]) == 0
    # pip's versions, not torch.__version__ (whose "+cu130" an installed "2.14.1" would not meet)
    assert (tmp_path / "c.txt").read_text() == "torch==2.13.0+cpu\ntorchvision==0.99.0\n"
    assert "keeping torch 2.13.0+cpu and torchvision 0.99.0" in capsys.readouterr().out

    _fake_versions(monkeypatch, "2.3.1", None)
    kept, reason, _ = check.check(torch_only=True)
    assert kept is None and "older than 2.4" in reason


_FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
if [ "$1" = tools/torch_check.py ]; then
    grep -q -- "-r requirements-torch.txt" "$FAKE_LOG" && exit 0
    exit "$FAKE_CHECK_RC"
fi
exit 0
"""


def _make(tmp_path, target, check_rc, *variables):
    """Runs a make target with a stand-in for the venv's python that logs its calls."""
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_FAKE_PYTHON)
    python.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    env = {**os.environ, "FAKE_LOG": str(log), "FAKE_CHECK_RC": str(check_rc)}
    # the outer make's variables (`make test PIN_TORCH=1` in CI) reach a nested make through
    # MAKEFLAGS: this make starts from none
    for name in ("PIN_TORCH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
        env.pop(name, None)
    result = subprocess.run(
        ["make", "-C", str(ROOT), f"VENV={venv}", target, *variables],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return log.read_text().splitlines(), venv


def test_make_install_keeps_a_compatible_torch(tmp_path):
    calls, venv = _make(tmp_path, "install", 0)
    assert not any("requirements-torch.txt" in call for call in calls), calls
    constraints = venv / "torch-constraints.txt"
    assert f"tools/torch_check.py {constraints}" in calls
    assert f"-m pip install -q -r requirements-dev.txt -c {constraints}" in calls


def test_make_install_installs_the_pins_without_a_compatible_torch(tmp_path):
    calls, venv = _make(tmp_path, "install", 1)
    constraints = venv / "torch-constraints.txt"
    pins = calls.index("-m pip install -q -r requirements-torch.txt")
    assert calls.index(f"tools/torch_check.py {constraints}") < pins
    assert calls.index(f"-m pip install -q -r requirements-dev.txt -c {constraints}") > pins
    assert calls.count(f"tools/torch_check.py {constraints}") == 2  # again, to pin them


def test_make_install_pins_torch_on_request(tmp_path):
    calls, _ = _make(tmp_path, "install", 0, "PIN_TORCH=1")
    assert "-m pip install -q -r requirements-torch.txt" in calls
    assert "PIN_TORCH=1" in (ROOT / ".ci" / "run").read_text()  # CI tests the pinned versions


def test_make_demo_needs_no_test_requirements(tmp_path):
    calls, venv = _make(tmp_path, "demo", 0)
    constraints = venv / "torch-constraints.txt"
    assert f"tools/torch_check.py --torch-only {constraints}" in calls
    assert not any("requirements" in call for call in calls), calls
    assert calls[-1] == "-m backpack"


def test_torch_pins_live_outside_the_dev_requirements():
    dev = (ROOT / "requirements-dev.txt").read_text()
    assert not re.search(r"^torch(vision)?\b", dev, flags=re.M)
    pins = (ROOT / "requirements-torch.txt").read_text()
    assert re.search(r"^torch==2\.14\.1$", pins, flags=re.M)
    assert re.search(r"^torchvision==0\.29\.1$", pins, flags=re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.4" in project["dependencies"]  # the library's requirement stays a range
    readme = (ROOT / "README.md").read_text()
    development = readme[readme.index("## Development") :]
    for needle in ("requirements-torch.txt", "PIN_TORCH=1", "torchvision --index-url"):
        assert needle in development, needle
