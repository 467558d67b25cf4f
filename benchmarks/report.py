"""What the markdown-report benchmarks share: their common options and how a report ends."""

from __future__ import annotations

import argparse
from pathlib import Path


def report_parser(doc: str, threads: int = 1) -> argparse.ArgumentParser:
    """A parser with `--tiny`, `--repeats`, `--threads` and `--out` (described by `doc`).

    One thread by default: with more, process CPU time also counts idle OpenMP threads'
    busy-waiting, which grows with the other jobs on a shared machine.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--out", default=None, help="write the markdown here")
    return parser


def finish(lines: list[str], out: str | None) -> int:
    """Print the report (and write it to `out`); the exit status 0."""
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)
    print(text)
    return 0
