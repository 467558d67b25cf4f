"""The documentation: generated layer table, runnable snippets, and (if installed) the build.

Code blocks fenced as ```python in the pages listed in RUNNABLE_PAGES are executed in order,
one namespace per page; fragments that are not meant to run use ```py instead.
"""

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from torch import nn

from backpack.rules import registered_module_classes
from backpack.rules.activations import _RULES as ACTIVATION_RULES
from backpack.rules.losses import _LOSS_RULES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE_PAGES = [
    "getting-started.md",
    "extensions.md",
    "good-to-know.md",
    "residual-networks.md",
    "transformers.md",
    "curvature.md",
    "influence.md",
    "verify.md",
]


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "backpack_docs_gen_layers", DOCS / "gen_layers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table():
    return load_generator().render_layer_table()


def rows(table):
    """First cell -> row cells, for every table row naming a module."""
    result = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            result[cells[0].strip("`")] = cells[1:]
    return result


def test_table_lists_common_layers(table):
    names = rows(table)
    for cls in [
        "Linear",
        "Conv2d",
        "ConvTranspose1d",
        "BatchNorm2d",
        "Embedding",
        "MaxPool2d",
        "ReLU",
        "Tanh",
        "Flatten",
        "CrossEntropyLoss",
        "MSELoss",
    ]:
        assert f"torch.nn.{cls}" in names, cls
    if nn.LSTM in registered_module_classes():
        assert "torch.nn.LSTM" in names
    assert "backpack.custom_module.branching.SumModule" in names


def test_table_covers_every_registry_entry(table):
    names = rows(table)
    for cls in [*registered_module_classes(), *ACTIVATION_RULES, *_LOSS_RULES]:
        assert any(name.endswith(f".{cls.__name__}") for name in names), cls


def test_table_cells_follow_the_rules(table):
    names = rows(table)
    assert names["torch.nn.Linear"] == ["✓", "✓", "✓", "✓"]
    assert names["torch.nn.Embedding"][2] == "✓ (for `weight.T`)"  # Linear on one-hot inputs
    for norm in ("LayerNorm", "GroupNorm", "InstanceNorm2d"):
        assert names[f"torch.nn.{norm}"][2] == "✓ (one dense block per parameter)", norm
        assert names[f"torch.nn.{norm}"][3].startswith("✗")
    attention = names["torch.nn.MultiheadAttention"]
    assert attention[:3] == ["✓", "✓", "✓ (dense blocks for some parameters, see notes)"]
    assert attention[3].startswith("✗")
    assert names["torch.nn.Tanh"][3].startswith("✓")
    batchnorm = names["torch.nn.BatchNorm1d"]
    assert batchnorm[0] == "✓¹" and batchnorm[2] == "✗"
    assert "¹ only when a call does not mix the samples" in table
    if nn.RNN in registered_module_classes():
        assert names["torch.nn.RNN"][3].startswith("✗")


def test_hook_replaces_marker_only_on_its_page():
    gen = load_generator()
    page = (DOCS / "supported-layers.md").read_text()
    assert gen.MARKER in page
    rendered = gen.on_page_markdown(page, None, None, None)
    assert gen.MARKER not in rendered and "torch.nn.Linear" in rendered
    assert gen.on_page_markdown("# other", None, None, None) == "# other"


def test_every_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in config, page


def test_every_example_is_documented():
    page = (DOCS / "examples.md").read_text()
    for script in (ROOT / "examples").glob("example_*.py"):
        assert f'--8<-- "examples/{script.name}"' in page, script.name


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_python_snippets_run(page, tmp_path, monkeypatch, capsys):
    text = (DOCS / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks, f"{page} has no runnable snippet"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page}"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # snippets must run without warnings
        for block in blocks:
            exec(compile(block, f"{page}", "exec"), namespace)  # noqa: S102


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    layers = (tmp_path / "site" / "supported-layers" / "index.html").read_text()
    assert "torch.nn.Linear" in layers and "layer-table" not in layers
    api = (tmp_path / "site" / "api" / "extensions" / "index.html").read_text()
    assert "DiagGGNExact" in api


def test_table_lists_layers_registered_by_name(table):
    """Layers of transformers and timm appear by their qualified names, imported or not."""
    from backpack.rules.base import registered_class_names, standard_forward_names

    names = rows(table)
    for name in registered_class_names():
        assert name in names, name
    conv1d = names["transformers.pytorch_utils.Conv1D"]
    assert conv1d == ["✓", "✓", "✓ (of the stored `[in, out]` weight, see notes)", "✓"]
    assert names["timm.layers.layer_scale.LayerScale"][3] == "✓"
    llama = names["transformers.models.llama.modeling_llama.LlamaRMSNorm"]
    assert llama[2] == "✓ (one dense block per parameter)" and llama[3].startswith("✗")
    assert names["torch.nn.LSTM"][2] == "✓"
    for name in standard_forward_names():
        assert f"`{name}`" in table


#: sections of Google-style docstrings, whose indented items are not code blocks
_SECTIONS = {"Args:", "Returns:", "Raises:", "Yields:", "Attributes:", "Example:", "Examples:"}
#: private names a public docstring may mention: the method subclasses implement
_PRIVATE_ALLOWED = {"_matmat"}


def _api_objects():
    """Every public function, class and method on the API reference pages (docs/api)."""
    import importlib
    import inspect

    targets = []
    for page in (DOCS / "api").glob("*.md"):
        targets += re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M)
    for target in targets:
        try:
            module = importlib.import_module(target)
            members = [
                (name, obj)
                for name, obj in vars(module).items()
                if not name.startswith("_")
                and getattr(obj, "__module__", None) == module.__name__
                and (inspect.isfunction(obj) or inspect.isclass(obj))
            ]
        except ModuleNotFoundError:
            parent, _, name = target.rpartition(".")
            members = [(name, getattr(importlib.import_module(parent), name))]
        for name, obj in members:
            yield f"{target}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and (
                        inspect.isfunction(member) or isinstance(member, property)
                    ):
                        yield f"{target}.{name}.{attr}", member


def test_api_docstrings_render_as_prose():
    """No private helper named, no indented paragraph (Markdown would make it a code block)."""
    import inspect

    found = []
    for name, obj in _api_objects():
        doc = inspect.cleandoc(obj.__doc__ or "")
        for private in set(re.findall(r"`(_[A-Za-z]\w*)`", doc)) - _PRIVATE_ALLOWED:
            found.append(f"{name}: names the private {private}")
        lines, section = doc.splitlines(), False
        for i, line in enumerate(lines):
            if line and not line.startswith(" "):
                section = line.strip() in _SECTIONS
            if line.startswith("    ") and not lines[i - 1].strip() and not section:
                found.append(f"{name}: indented block {line.strip()[:40]!r}")
    assert not found, "\n".join(found)


def test_gpt2_snippet_builds_its_model_without_warnings():
    """The Hugging Face page's GPT-2: a small vocabulary with token ids inside it."""
    pytest.importorskip("transformers")
    import logging

    text = (DOCS / "hugging-face.md").read_text()
    blocks = re.findall(r"^```py\n(.*?)^```", text, flags=re.S | re.M)
    block = next(b for b in blocks if "GPT2Config" in b)
    setup = block[: block.index(".eval()") + len(".eval()")]
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers")  # transformers logs to its own handler
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            namespace = {}
            exec(compile(setup, "hugging-face.md", "exec"), namespace)  # noqa: S102
    finally:
        logger.removeHandler(handler)
    assert namespace["gpt"].config.vocab_size == 1000
    assert not messages, messages


def test_curvature_page_starts_with_what_a_user_reaches_for():
    text = (DOCS / "curvature.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[0] == "What do you need?", headings
    opening = text[: text.index("## The data-set loss")]
    for task in ("Curvature of a loader", "Top eigenvalues", "Trace", "Laplace", "Influence"):
        assert f"\n### {task}\n" in opening, task
    assert len(opening.splitlines()) < 130  # the reference follows, not precedes
    # sweeps on several processes have a page of their own
    assert "fully_shard" not in text and "](curvature-distributed.md)" in text
    distributed = (DOCS / "curvature-distributed.md").read_text()
    assert distributed.startswith("# Distributed sweeps") and "fully_shard" in distributed
    for page in DOCS.glob("*.md"):
        assert "curvature.md#distributed-sweeps" not in page.read_text(), page.name
