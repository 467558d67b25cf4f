"""Running backward passes in several threads at once against single-threaded results."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def assert_threads_reproduce(step: Callable[[int], dict], count: int, repeats: int) -> None:
    """`step(i)` (a dict of tensors) run `repeats` times in each of `count` threads at once
    gives bit for bit what it gave single-threaded.

    Build models and data before: the global RNG is not thread-safe.
    """
    expected = [step(i) for i in range(count)]
    failures: list = []

    def worker(i: int) -> None:
        try:
            for _ in range(repeats):
                got = step(i)
                if got.keys() != expected[i].keys():
                    failures.append((i, "attributes", set(got) ^ set(expected[i])))
                    continue
                wrong = [k for k, v in got.items() if not torch.equal(v, expected[i][k])]
                failures.extend((i, k) for k in wrong)
        except Exception as err:  # noqa: BLE001 - reported below
            failures.append((i, repr(err)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
