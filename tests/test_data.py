"""The MNIST IDX loader: good files (gzip and raw, torchvision's layout), corrupt and missing ones, the shared copy."""
import gzip
import hashlib
import os
import struct

import numpy as np
import pytest
import torch

from fgfw import data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CI runs from a clone with shared/ beside it; on the development machine it is /work/shared.
SHARED_MNIST = next((p for p in (os.path.join(REPO, "..", "shared", "data", "mnist"), "/work/shared/data/mnist")
                     if os.path.isdir(p)), None)
# The md5s of the shared copy, as docs/algorithms.md lists them.
SHARED_MD5 = {"t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
              "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: magic 0x0000 08 ndim, big-endian sizes, the payload."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write(path, payload: bytes, compress: bool) -> str:
    path = str(path) + (".gz" if compress else "")
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as f:
        f.write(payload)
    return path


def synthetic(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n, dtype=np.uint8)


def write_set(folder, part, n, compress, seed=0):
    images, labels = synthetic(n, seed)
    stem_images, stem_labels = data.MNIST_FILES[part]
    write(folder / stem_images, idx_bytes(images), compress)
    write(folder / stem_labels, idx_bytes(labels), compress)
    return images, labels


@pytest.mark.parametrize("compress", [True, False])
def test_test_set_alone_is_split_every_fifth_image(tmp_path, compress):
    images, labels = write_set(tmp_path, "test", 50, compress)
    (x_train, y_train), (x_test, y_test) = data.mnist_split(str(tmp_path))
    assert x_train.shape == (40, 784) and x_test.shape == (10, 784)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    test_idx = np.arange(4, 50, 5)
    train_idx = np.setdiff1d(np.arange(50), test_idx)
    np.testing.assert_array_equal(y_test.numpy(), labels[test_idx])
    np.testing.assert_array_equal(y_train.numpy(), labels[train_idx])
    np.testing.assert_allclose(x_test.numpy(), images[test_idx].reshape(10, 784) / 255.0, rtol=0, atol=1e-7)
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) <= 1.0


def test_full_copy_in_torchvision_layout_gives_train_and_test(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    train_images, train_labels = write_set(raw, "train", 30, compress=False, seed=1)
    _, test_labels = write_set(raw, "test", 12, compress=True, seed=2)
    (x_train, y_train), (x_test, y_test) = data.mnist_split(str(tmp_path))
    assert x_train.shape == (30, 784) and x_test.shape == (12, 784)
    np.testing.assert_array_equal(y_train.numpy(), train_labels)
    np.testing.assert_array_equal(y_test.numpy(), test_labels)
    np.testing.assert_allclose(x_train.numpy(), train_images.reshape(30, 784) / 255.0, atol=1e-7)


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_file_names_the_sizes(tmp_path, compress):
    images, labels = synthetic(20)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(images)[:-100], compress)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels), compress)
    with pytest.raises(ValueError, match=r"t10k-images.*15596 bytes.*\(20, 28, 28\).*15696 bytes.*truncated"):
        data.mnist_split(str(tmp_path))


def test_truncated_gzip_stream_is_reported(tmp_path):
    images, labels = synthetic(20)
    payload = gzip.compress(idx_bytes(images))
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(payload[:len(payload) // 2])
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels), True)
    with pytest.raises(ValueError, match="not a readable gzip file"):
        data.mnist_split(str(tmp_path))


def test_wrong_magic_number_is_named(tmp_path):
    images, labels = synthetic(20)
    # the two files swapped: an image file where labels belong and vice versa
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(labels), False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(images), False)
    with pytest.raises(ValueError, match=r"magic number 0x00000801, expected 0x00000803"):
        data.mnist_split(str(tmp_path))
    bad = bytearray(idx_bytes(images))
    bad[2] = 0x0D  # float32 elements
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="magic number 0x00000d03"):
        data.mnist_split(str(tmp_path))


def test_mismatched_counts_and_bad_labels(tmp_path):
    images, labels = synthetic(20)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(images), False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels[:19]), False)
    with pytest.raises(ValueError, match="20 images but .* 19 labels"):
        data.mnist_split(str(tmp_path))
    labels[3] = 12
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels), False)
    with pytest.raises(ValueError, match="label 12"):
        data.mnist_split(str(tmp_path))


def test_missing_files_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.mnist_split(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"):
        data.mnist_split(str(tmp_path))
    write_set(tmp_path, "test", 10, compress=True)
    images, _ = synthetic(10)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(images), True)
    with pytest.raises(FileNotFoundError, match="only part of the training set: train-labels"):
        data.mnist_split(str(tmp_path))


def test_load_dispatches_to_digits_by_default():
    (x_train, _), (x_test, _) = data.load(None)
    assert x_train.shape[1] == 64 and len(x_train) + len(x_test) == 1797


@pytest.mark.shared_data
@pytest.mark.skipif(SHARED_MNIST is None, reason="the shared MNIST test set (../shared/data/mnist beside the repository, "
                                                 "or /work/shared/data/mnist) is not present")
def test_shared_mnist_test_set_loads_and_splits_8000_2000():
    for name, md5 in SHARED_MD5.items():
        with open(os.path.join(SHARED_MNIST, name), "rb") as f:
            assert hashlib.md5(f.read()).hexdigest() == md5, f"{name} differs from the copy docs/algorithms.md lists"
    (x_train, y_train), (x_test, y_test) = data.mnist_split(SHARED_MNIST)
    assert x_train.shape == (8000, 784) and x_test.shape == (2000, 784)
    # every class appears in both parts in roughly its share
    assert torch.bincount(y_test, minlength=10).min() > 100
    assert torch.bincount(y_train, minlength=10).min() > 600
    assert abs(float(x_train.mean()) - 0.133) < 0.01  # MNIST's mean pixel
