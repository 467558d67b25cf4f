"""One-off generator for the embedded ``digits.bin.gz`` file.

This script is not imported by the package. It needs scikit-learn and numpy, which ship
a copy of the UCI "Optical Recognition of Handwritten Digits" test set.

File layout (after gunzip), all unsigned bytes:

* ``N * 64`` bytes: the ``N`` images, row-major ``[N, 8, 8]``, pixel values in ``0..16``;
* ``N`` bytes: the labels ``0..9``.

With ``N = 1797``. Run with ``python backpack/utils/data/make_digits.py``.
"""

import gzip
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

NUM_SAMPLES = 1797
OUTPUT = Path(__file__).with_name("digits.bin.gz")


def main() -> None:
    """Write the images and labels as a gzip-compressed raw byte file."""
    bunch = load_digits()
    images = np.rint(bunch.images).astype(np.uint8)
    labels = bunch.target.astype(np.uint8)
    assert images.shape == (NUM_SAMPLES, 8, 8), images.shape
    assert labels.shape == (NUM_SAMPLES,), labels.shape
    assert np.array_equal(images, bunch.images) and images.max() <= 16
    assert np.array_equal(labels, bunch.target) and labels.max() <= 9

    payload = np.ascontiguousarray(images).tobytes() + labels.tobytes()
    # mtime=0 keeps the output byte-identical between runs.
    with (
        open(OUTPUT, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as compressed,
    ):
        compressed.write(payload)
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes, {NUM_SAMPLES} samples)")


if __name__ == "__main__":
    main()
