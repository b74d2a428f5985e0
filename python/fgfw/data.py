"""Datasets for the demo and the paper's experiment. No download ever happens at run time."""
from __future__ import annotations

import torch


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
