"""Whether `make install` can keep the torch that its virtual environment already has.

The Makefile runs this with the venv's interpreter before installing the development
requirements. It exits 0 when torch >= 2.4 imports together with a torchvision built for it
(the test dependencies timm and torchvision need both), and writes a pip constraints file that
pins those two versions for the rest of the install, so that no later requirement swaps them.
Otherwise it exits 1 and says why; the Makefile then installs the pinned versions of
requirements-torch.txt (on Linux, torch's CUDA build with its NVIDIA libraries: several GB).

Usage: python tools/torch_check.py [--torch-only] CONSTRAINTS_OUT
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import warnings
from pathlib import Path

#: the oldest torch the library supports (pyproject.toml: torch>=2.4)
MIN_TORCH = (2, 4)
#: where the CPU-only wheels of torch and torchvision live
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: the pinned versions of the development environment and CI
PINS = Path(__file__).resolve().parents[1] / "requirements-torch.txt"


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: "2.13.0+cpu" -> (2, 13, 0), "2.5.0a0" -> (2, 5, 0)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets a comma-separated specifier such as ">=2.14.0" or "==2.13.0".

    Compares numeric releases only (local labels like "+cpu" are ignored, as pip does for a
    specifier without one); "==2.13.*" prefix matches are understood.
    """
    have = release(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = re.fullmatch(r"(===|==|!=|<=|>=|~=|<|>)\s*([^\s]+)", clause)
        if match is None:
            return False
        op, text = match.groups()
        if text.endswith(".*"):
            prefix = release(text[:-2])
            equal = have[: len(prefix)] == prefix
            if (op == "==" and not equal) or (op == "!=" and equal):
                return False
            continue
        want = release(text)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {
            "==": a == b,
            "===": a == b,
            "!=": a != b,
            "<=": a <= b,
            ">=": a >= b,
            "<": a < b,
            ">": a > b,
            "~=": a >= b and a[: len(want) - 1] == b[: len(want) - 1],
        }[op]
        if not ok:
            return False
    return True


def torch_requirement(requirements: list[str]) -> str | None:
    """The version specifier on `torch` among a distribution's requirements (None: unpinned)."""
    for requirement in requirements:
        if ";" in requirement:  # an extra's or a platform's requirement
            continue
        match = re.fullmatch(r"torch(?![\w.-])\s*\(?\s*([^)]*?)\s*\)?", requirement.strip())
        if match is not None:
            return match.group(1)
    return None


def check(torch_only: bool = False) -> tuple[dict[str, str] | None, str, str | None]:
    """The installed versions to keep (or None, and why not), and the installed torch's version.

    With `torch_only`, torchvision is neither needed nor pinned (`make demo`).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's NumPy warning in a venv without numpy
        try:
            import torch
        except Exception as error:  # noqa: BLE001 - any failure means: install the pinned one
            return None, f"no importable torch ({type(error).__name__}: {error})", None
        try:  # the version pip knows (torch.__version__ may add a local label like "+cu130")
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            version = torch.__version__
        if release(version) < MIN_TORCH:
            minimum = ".".join(map(str, MIN_TORCH))
            return None, f"torch {version} is older than {minimum}", version
        if torch_only:
            return {"torch": version}, "", version
        try:
            vision = importlib.metadata.version("torchvision")
        except importlib.metadata.PackageNotFoundError:
            return None, f"torch {version} but no torchvision", version
        specifier = torch_requirement(importlib.metadata.requires("torchvision") or [])
        if specifier is not None and not satisfies(version, specifier):
            return None, f"torchvision {vision} needs torch {specifier}, not {version}", version
        try:
            import torchvision  # noqa: F401 - a torchvision built for another torch fails here
        except Exception as error:  # noqa: BLE001
            reason = (
                f"torchvision {vision} does not import with torch {version} "
                f"({type(error).__name__}: {error})"
            )
            return None, reason, version
    return {"torch": version, "torchvision": vision}, "", version


def main(argv: list[str]) -> int:
    """Write the constraints file and return 0, or explain and return 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("constraints", type=Path, help="where to write the kept versions")
    parser.add_argument("--torch-only", action="store_true", help="torchvision is not needed")
    args = parser.parse_args(argv)
    kept, reason, torch_version = check(args.torch_only)
    if kept is not None:
        args.constraints.write_text("".join(f"{k}=={v}\n" for k, v in kept.items()))
        names = " and ".join(f"{k} {v}" for k, v in kept.items())
        print(f"make: keeping {names} of the venv (PIN_TORCH=1 installs {PINS.name} instead)")
        return 0
    wanted = " ".join(
        line.split("#")[0].strip()
        for line in PINS.read_text().splitlines()
        if line.split("#")[0].strip()
    )
    advice = ""
    if torch_version is not None and release(torch_version) >= MIN_TORCH:
        source = (
            f"pip install torchvision --index-url {CPU_INDEX}"
            if torch_version.endswith("+cpu")
            else "from the index that torch came from"
        )
        advice = f" To keep torch {torch_version}, install the torchvision built for it ({source})."
    print(
        f"make: {reason}: installing {wanted} ({PINS.name}; on Linux the CUDA build with its "
        f"NVIDIA libraries, several GB).{advice}"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
