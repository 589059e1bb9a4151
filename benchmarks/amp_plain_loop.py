"""How far the parameters move in one step of the plain PyTorch AMP loop under Horovod, against
the GradScaler pattern of docs/usage.md (docs/reliability.md, "Mixed precision (GradScaler)").

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/amp_plain_loop.py

A small MLP, GradScaler("cpu") at its default scale (65536), bfloat16 autocast, SGD lr 0.1;
per step the sum over the parameter tensors of the L2 norm of their change, for dense Horovod
and for DGC(loss_scaler=scaler), each with the plain loop (`scaler.step(opt)` alone) and with
the pattern (synchronize, unscale_, skip_synchronize). DGC refuses the plain loop: printed as
"refused" with the start of its error. With dense Horovod the plain loop races: GradScaler's
unscale_ and Horovod's in-place allreduce of the same .grad run at the same time, so a step is
right when the allreduce finished first and about 65536× too long otherwise; which steps go
wrong changes from run to run.
"""
import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC


def run(compression, plain, steps=10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    scaler = torch.amp.GradScaler("cpu")
    kwargs = {"compression": DGC(compress_ratio=0.01, loss_scaler=scaler)} if compression else {}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kwargs)
    gen = torch.Generator().manual_seed(hvd.rank())
    changes = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(torch.randn(8, 20, generator=gen)),
                                   torch.randint(0, 2, (8,), generator=gen))
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        try:
            if plain:
                scaler.step(opt)
            else:
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
        except RuntimeError as e:
            return f"refused: {str(e)[:60]}..."
        scaler.update()
        changes.append(sum(float((p.detach() - b).norm())
                           for p, b in zip(model.parameters(), before)))
    return " ".join(f"{c:.4g}" for c in changes)


def main():
    hvd.init()
    torch.set_num_threads(1)
    rows = [(name, loop, run(dgc, loop == "plain")) for name, dgc in (("horovod", False),
                                                                      ("dgc", True))
            for loop in ("pattern", "plain")]
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks; parameter change per step (sum of L2 norms), scale 65536")
        for name, loop, out in rows:
            print(f"  {name:>8} {loop:>8}: {out}")


if __name__ == "__main__":
    main()
