"""Datasets for the demo and the paper's experiment. No download ever happens at run time.

* :func:`digits_split`: scikit-learn's bundled 8x8 digits, the embedded default.
* :func:`mnist_split`: MNIST from IDX files on disk (gzip or raw), as in torchvision's raw folder.
"""
from __future__ import annotations

import gzip
import os
import zlib

import numpy as np
import torch

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic: two zero bytes, the element type (0x08 = unsigned byte), the number of dimensions.
IDX_UBYTE = 0x08
# Every SPLIT_STRIDE-th image of a lone test set is held out. MNIST's test set is ordered (its first
# 5,000 images come from one pool of writers, the last 5,000 from another), so a contiguous split would
# test on other writers than it trains on; a stride mixes both and needs no random generator.
SPLIT_STRIDE = 5


def digits_split(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8x8 digits (1,797 images), pixels scaled to [0, 1], split deterministically.

    Returns ((x_train, y_train), (x_test, y_test)) as float32 / int64 tensors, x of shape (n, 64).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("the digits data set needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def _read_bytes(path: str) -> bytes:
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                return f.read()
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"{path}: not a readable gzip file ({err}); the download is truncated or corrupt, "
                             f"replace the file") from err
    with open(path, "rb") as f:
        return f.read()


def read_idx(path: str, expected_ndim: int) -> np.ndarray:
    """Reads one IDX file of unsigned bytes (gzip when the name ends in .gz), checking magic and size.

    Returns a uint8 array of the shape the header declares. A wrong magic number, a dimension count
    other than ``expected_ndim`` or a payload shorter or longer than the header declares raise
    ``ValueError`` naming the file and the numbers found.
    """
    data = _read_bytes(path)
    if len(data) < 4:
        raise ValueError(f"{path}: {len(data)} bytes, too short for an IDX header (4-byte magic number)")
    zero, dtype, ndim = int.from_bytes(data[:2], "big"), data[2], data[3]
    expected_magic = (IDX_UBYTE << 8) | expected_ndim
    if zero != 0 or dtype != IDX_UBYTE or ndim != expected_ndim:
        raise ValueError(f"{path}: magic number 0x{int.from_bytes(data[:4], 'big'):08x}, expected 0x{expected_magic:08x}"
                         f" (unsigned bytes, {expected_ndim} dimension{'s' if expected_ndim > 1 else ''}): not an "
                         f"MNIST {'image' if expected_ndim == 3 else 'label'} file")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than its {header}-byte header: the file is truncated")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than declared (corrupt or not this format)"
        raise ValueError(f"{path}: {len(data)} bytes, but its header declares shape {shape}, i.e. {expected} bytes: "
                         f"the file is {what}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find(folder: str, stem: str) -> str | None:
    """The file ``stem`` or ``stem.gz`` in ``folder`` or in the raw folders torchvision creates below it."""
    for sub in ("", "raw", os.path.join("MNIST", "raw")):
        for name in (stem + ".gz", stem):
            path = os.path.join(folder, sub, name)
            if os.path.isfile(path):
                return path
    return None


def load_mnist_pair(images_path: str, labels_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): images as float32 of shape (n, 784) in [0, 1], labels as int64; the two files must agree."""
    images = read_idx(images_path, 3)
    labels = read_idx(labels_path, 1)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} "
                         f"labels: the files do not belong together")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {int(labels.max())} found, MNIST labels are 0..9")
    x = torch.from_numpy(images.reshape(images.shape[0], -1).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


def mnist_split(path: str):
    """MNIST from the IDX files in ``path``: ((x_train, y_train), (x_test, y_test)), x of shape (n, 784).

    ``path`` is a folder holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (each raw or ``.gz``),
    directly or in ``raw/`` or ``MNIST/raw/`` below it (torchvision's layout). With all four files: the
    standard 60,000 / 10,000 split. With only the test set (the shared copy of this project): its
    10,000 images split deterministically into 8,000 train / 2,000 test (every 5th image is a test image).
    Pixels are scaled to [0, 1]. Nothing is downloaded.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"MNIST folder {path!r} does not exist (expected a folder with the IDX files "
                                f"{', '.join(MNIST_FILES['test'])} (.gz or raw); nothing is downloaded)")
    found = {part: [_find(path, stem) for stem in stems] for part, stems in MNIST_FILES.items()}
    if not all(found["test"]):
        missing = [stem for stem, p in zip(MNIST_FILES["test"], found["test"]) if p is None]
        raise FileNotFoundError(f"MNIST folder {path!r} lacks {', '.join(missing)} (.gz or raw, in the folder or in "
                                f"raw/ or MNIST/raw/ below it); nothing is downloaded")
    test = load_mnist_pair(*found["test"])
    if all(found["train"]):
        return load_mnist_pair(*found["train"]), test
    if any(found["train"]):
        missing = [stem for stem, p in zip(MNIST_FILES["train"], found["train"]) if p is None]
        raise FileNotFoundError(f"MNIST folder {path!r} has only part of the training set: {', '.join(missing)} is "
                                f"missing (give both training files, or neither to split the test set)")
    x, y = test
    held_out = torch.arange(len(y)) % SPLIT_STRIDE == SPLIT_STRIDE - 1
    return (x[~held_out], y[~held_out]), (x[held_out], y[held_out])


def load(data: str | None):
    """The data set a run asks for: ``None`` or ``"digits"`` -> :func:`digits_split`, else an MNIST folder."""
    if data is None or data == "digits":
        return digits_split()
    return mnist_split(data)
