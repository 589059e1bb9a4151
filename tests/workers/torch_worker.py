"""Runs under `horovodrun -np 2`: DGC with the stock horovod.torch.DistributedOptimizer.

Each scenario trains a small model with real Horovod collectives and records facts that
tests/test_torch_horovod.py asserts on. Rank 0 writes them as JSON to --out.
"""
import argparse
import json
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC
from timeline_flush import flush_timeline

LR = 0.05


class Net(torch.nn.Module):
    """fc1.weight (8192) and fc2.weight (1280) are sparsified; biases and aux.bias stay dense.
    aux is used on even steps only, so it has no gradient on odd steps."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 10)
        self.aux = torch.nn.Linear(128, 10)

    def forward(self, x, use_aux=True):
        h = F.relu(self.fc1(x))
        out = self.fc2(h)
        return out + self.aux(h) if use_aux else out


def batches(steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(steps)]


def make(prefix, compression, momentum=0.0, nesterov=False, **opt_kwargs):
    torch.manual_seed(1234)
    model = Net()
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, nesterov=nesterov)
    opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=compression,
                                   **opt_kwargs)
    return model, opt


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def identical_across_ranks(model):
    gathered = hvd.allgather(flat_params(model).unsqueeze(0), name="check.params")
    return bool((gathered == gathered[0]).all())


def train(model, opt, steps=20, zero="none", bpps=1, aux_every=2, data_seed=None, hook=None):
    data = batches(steps * bpps, 100 + hvd.rank() if data_seed is None else data_seed)
    for step in range(steps):
        if zero == "none":
            opt.zero_grad()                        # torch 2: sets grads to None
        else:
            model.zero_grad(set_to_none=False)     # keeps zero-filled .grad tensors
        for j in range(bpps):
            x, y = data[step * bpps + j]
            loss = F.cross_entropy(model(x, use_aux=(step % aux_every == 0)), y)
            if hook is not None:
                loss = hook(step, loss)
            loss.backward()
        opt.step()


def grad_storage(model, opt, dgc, prefix):
    """One more step, after training: {parameter: whether its p.grad came back from
    synchronize in the storage backward filled}, for sparsified and for dense parameters."""
    x, y = batches(1, 300 + hvd.rank())[0]
    opt.zero_grad()
    F.cross_entropy(model(x, use_aux=True), y).backward()
    before = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    opt.step()
    sparse = {n for n, s in dgc.states.items() if s.sparse}
    kept = {n: p.grad.data_ptr() == before[n] for n, p in model.named_parameters()}
    return {"sparse": [kept[n] for n in kept if f"{prefix}.{n}" in sparse],
            "dense": [kept[n] for n in kept if f"{prefix}.{n}" not in sparse]}


def scenario_identical(results, prefix_base):
    """Parameters bit-identical across ranks after 20 steps, for each Horovod usage pattern."""
    variants = {
        "set_to_none": dict(),
        "zero_grad_false": dict(zero="zeros"),
        "backward_passes_2": dict(bpps=2),
        "groups_2": dict(),
        "all_sparse": dict(),
        "per_tensor_allgather": dict(),
        "small_buckets": dict(),
        # global clipping: the gated exchange, with aux's gradient missing on odd steps (it
        # arrives at synchronize) and two backward passes per step
        "global_clip": dict(bpps=2),
    }
    out = {}
    for name, kw in variants.items():
        extra = dict(clip_norm=0.05) if name == "global_clip" else {}
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, **extra,
                  min_sparse_numel=1 if name in ("all_sparse", "small_buckets") else 1024,
                  min_sparse_ndim=1,
                  bucket_numel={"per_tensor_allgather": 0, "small_buckets": 1500}.get(name, 2**22))
        opt_kw = {}
        if name in ("backward_passes_2", "global_clip"):
            opt_kw["backward_passes_per_step"] = 2
        if name == "groups_2":
            opt_kw["groups"] = 2
        model, opt = make(f"{prefix_base}.{name}", dgc, **opt_kw)
        before = flat_params(model).clone()
        train(model, opt, **kw)
        out[name] = {
            "identical": identical_across_ranks(model),
            "changed": bool((flat_params(model) != before).any()),
            "finite": bool(torch.isfinite(flat_params(model)).all()),
            "states": sorted(dgc.states),
            "sparse": sorted(n for n, s in dgc.states.items() if s.sparse),
            "selected_last_step": dgc.stats.selected,
            "steps_counted": dgc.total_stats.steps,
        }
        # one step more, after the facts above were taken
        out[name]["grad_storage"] = (None if opt_kw else
                                     grad_storage(model, opt, dgc, f"{prefix_base}.{name}"))
    results["identical"] = out


def scenario_engines(results, prefix_base, steps=6):
    """The same training with each engine (DGC(engine=...): the C kernels, the Triton kernels
    on these CPU tensors under Triton's interpreter, TRITON_INTERPRET=1 in the environment, and
    tensor ops), in buckets, per tensor and in small buckets: the final parameters' bits."""
    import importlib.util
    out = {}
    engines = ("c", "triton", "ops") if importlib.util.find_spec("triton") else ("c", "ops")
    for layout, bucket_numel in (("buckets", 2 ** 22), ("per_tensor", 0), ("small", 1500)):
        for engine in engines:
            dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_steps=3, engine=engine,
                      min_sparse_numel=1, min_sparse_ndim=1, bucket_numel=bucket_numel)
            model, opt = make(f"{prefix_base}.{layout}.{engine}", dgc)
            train(model, opt, steps=steps)
            out[f"{layout}.{engine}"] = {
                "params": flat_params(model).view(torch.int32).tolist(),
                "identical": identical_across_ranks(model),
                "selected": dgc.total_stats.selected}
    results["engines"] = out


def _short(name):
    """'cm.default.fc1.weight' -> 'fc1.weight'."""
    return ".".join(name.split(".")[-2:])


def scenario_compress_many(results, prefix_base):
    """Bucketed mode compresses a bucket's sparsified gradients in one DGCCore.compress_many call
    per bucket and step, and trains exactly like per-tensor mode (bucket_numel=0).

    Records, per variant: every compress_many call (step, tensor names, whether it ran inside
    Horovod's synchronize or during backward), the tensors compressed one by one outside
    compress_many, and the final parameters' bytes, to compare with the per-tensor twin. The
    selection is exact top-k here: sampled top-k draws from one generator shared by all tensors,
    so its results depend on the order the tensors are compressed in, which bucketing changes.
    """
    variants = {   # name: (bucket_numel, min_sparse_numel, exact_topk)
        "default": (2 ** 22, 1024, True), "default_per_tensor": (0, 1024, True),
        "small_buckets": (1500, 1, True), "small_buckets_per_tensor": (0, 1, True),
        "default_sampled": (2 ** 22, 1024, False),
        "default_sampled_per_tensor": (0, 1024, False),
    }
    out, params = {}, {}
    for name, (bucket_numel, min_sparse, exact) in variants.items():
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, exact_topk=exact,
                  min_sparse_numel=min_sparse, min_sparse_ndim=1, bucket_numel=bucket_numel)
        model, opt = make(f"{prefix_base}.{name}", dgc)
        core, where, calls, direct, inside = dgc._core, ["backward"], [], [], [False]
        step_no = [0]
        many, single = core.compress_many, core.compress

        def compress_many(entries, world_size, *args):
            entries = list(entries)
            calls.append({"step": step_no[0], "where": where[0],
                          "names": [_short(n) for n, _, _ in entries]})
            inside[0] = True
            try:
                return many(entries, world_size, *args)
            finally:
                inside[0] = False

        def compress(tensor_name, *args, **kwargs):
            if not inside[0]:
                direct.append(_short(tensor_name))
            return single(tensor_name, *args, **kwargs)

        core.compress_many, core.compress = compress_many, compress
        synchronize = opt.synchronize

        def synchronize_marked():
            where[0] = "synchronize"
            try:
                return synchronize()
            finally:
                where[0] = "backward"
                step_no[0] += 1

        opt.synchronize = synchronize_marked
        train(model, opt)
        params[name] = flat_params(model)
        out[name] = {"identical": identical_across_ranks(model), "calls": calls,
                     "direct": sorted(set(direct)), "direct_count": len(direct),
                     "steps_counted": dgc.total_stats.steps,
                     "sparse": sorted(_short(n) for n, s in dgc.states.items() if s.sparse)}
    for name in variants:
        if not name.endswith("_per_tensor"):
            twin = name + "_per_tensor"
            equal = bool(torch.equal(params[name], params[twin]))
            out[name]["equals_per_tensor"] = equal
            out[name]["max_diff_per_tensor"] = float((params[name] - params[twin]).abs().max())
    results["compress_many"] = out


def scenario_equivalence(results, prefix_base):
    """compress_ratio=1.0: DGC + plain SGD equals dense (momentum) SGD through Horovod."""
    out = {}
    cases = {
        "momentum_correction": (dict(momentum_masking=False), dict(momentum=0.9)),
        "nesterov": (dict(momentum_masking=False, nesterov=True), dict(momentum=0.9, nesterov=True)),
        "masking_equals_plain_sgd": (dict(momentum_masking=True), dict(momentum=0.0)),
    }
    for name, (dgc_kw, sgd_kw) in cases.items():
        dgc = DGC(compress_ratio=1.0, momentum=0.9, warmup_epochs=0, min_sparse_numel=1,
                  min_sparse_ndim=1, **dgc_kw)
        m_dgc, o_dgc = make(f"{prefix_base}.{name}.dgc", dgc)
        m_ref, o_ref = make(f"{prefix_base}.{name}.ref", hvd.Compression.none, **sgd_kw)
        train(m_dgc, o_dgc, steps=8, aux_every=1)
        train(m_ref, o_ref, steps=8, aux_every=1)
        out[name] = float((flat_params(m_dgc) - flat_params(m_ref)).abs().max())
    results["equivalence"] = out


def scenario_wire(results, prefix):
    """Per-rank statistics, to be compared with the Horovod timeline by the test; then the same
    counters in the other two exchange modes (one allgather per tensor; the gated exchange of
    global clipping), under other names so that the timeline check sees only the first."""
    def counters(dgc):
        st, last = dgc.total_stats, dgc.stats
        return hvd.allgather_object({
            "wire_bytes": st.wire_bytes, "received_bytes": st.received_bytes,
            "dense_bytes": st.dense_bytes, "selected": st.selected, "steps": st.steps,
            "ratio": st.ratio, "received_ratio": st.received_ratio,
            "last_step": [last.wire_bytes, last.received_bytes]})

    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
    model, opt = make(prefix, dgc)
    train(model, opt, steps=5, aux_every=1)
    sparse = sorted(n for n, s in dgc.states.items() if s.sparse)
    results["wire"] = {"per_rank": counters(dgc), "sparse": sparse,
                       "numel": {n: s.numel for n, s in dgc.states.items()}}
    for mode, kw in (("per_tensor", dict(bucket_numel=0)), ("gated", dict(clip_norm=1.0))):
        dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024, **kw)
        model, opt = make(f"{prefix}_{mode}", dgc)
        train(model, opt, steps=5, aux_every=1)
        results["wire"][mode] = counters(dgc)


def train_with_nan(model, opt, steps=8, seed=100, nan_step=3, after_backward=None,
                   all_nan=None):
    """Train ``steps`` steps; rank 1's loss is NaN at ``nan_step`` (None: never). A step whose
    synchronized gradients are not finite is skipped, as GradScaler does. ``after_backward(step)``
    runs between backward and synchronize; a list ``all_nan`` gets, per step, whether every
    element of every synchronized gradient is NaN. Returns, per step, whether it was skipped."""
    seen = []
    for step, (x, y) in enumerate(batches(steps, seed + hvd.rank())):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == nan_step and hvd.rank() == 1:
            loss = loss * float("nan")
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        opt.synchronize()
        bad = any(not torch.isfinite(p.grad).all() for p in model.parameters())
        seen.append(bad)
        if all_nan is not None:
            all_nan.append(all(bool(torch.isnan(p.grad).all()) for p in model.parameters()))
        if not bad:                                 # the loss-scaling skip, as GradScaler does
            with opt.skip_synchronize():
                opt.step()
    return seen


def nonfinite_facts(dgc, model, seen):
    """What the non-finite scenarios record after :func:`train_with_nan`."""
    states_finite = all(bool(torch.isfinite(t).all()) for s in dgc.states.values()
                        for t in (s.u, s.v) if t is not None)
    return {"skipped": seen, "states_finite": states_finite,
            "identical": identical_across_ranks(model),
            "params_finite": bool(torch.isfinite(flat_params(model)).all()),
            "nonfinite_tensors": dgc.total_stats.nonfinite_tensors}


def scenario_nonfinite(results, prefix):
    """Rank 1 produces a NaN loss at step 3: every rank sees it, no state is poisoned."""
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024)
    model, opt = make(prefix, dgc)
    results["nonfinite"] = nonfinite_facts(dgc, model, train_with_nan(model, opt))


def scenario_fp16_overflow(results, prefix, steps=16, **dgc_kw):
    """wire_values="float16" under the documented GradScaler pattern, the loss scale too large
    for float16 (2**24): DGC's selected values overflow, the scaler must see it, skip the steps
    and back off until they fit; the replicas stay bit-identical, u and v finite. ``dgc_kw``:
    more DGC settings (another exchange)."""
    from edge_worker import scaler_step           # the documented GradScaler pattern
    dgc = DGC(**dict(dict(compress_ratio=0.01, momentum=0.9, warmup_epochs=0,
                          min_sparse_numel=1024, wire_values="float16"), **dgc_kw))
    model, opt = make(prefix, dgc)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    scales, stepped, overflowed = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(steps, 300 + hvd.rank()):
            opt.zero_grad()
            stepped.append(scaler_step(model, opt, scaler, F.cross_entropy(model(x), y)))
            scales.append(float(scaler.get_scale()))
            overflowed.append(dgc.stats.overflowed_entries)
    states_finite = all(bool(torch.isfinite(t).all()) for s in dgc.states.values()
                        for t in (s.u, s.v) if t is not None)
    every = hvd.allgather_object({
        "scales": scales, "stepped": stepped, "overflowed": overflowed,
        "overflowed_entries": dgc.total_stats.overflowed_entries,
        "nonfinite_tensors": dgc.total_stats.nonfinite_tensors, "states_finite": states_finite,
        "warnings": [str(w.message) for w in caught if "float16" in str(w.message)]})
    results["fp16_overflow"] = {"ranks": every, "identical": identical_across_ranks(model),
                                "params_finite": bool(torch.isfinite(flat_params(model)).all())}


def scenario_momentum_twice(results, prefix):
    """Momentum in both DGC and the wrapped SGD for fc1 only (its own parameter group; its
    gradients come last in backward): refused at the step's first gradient, naming fc1's
    weight, before anything is sent; Horovod's optimizer stays usable, so once fc1's momentum is
    0 the same optimizer trains 3 steps, the replicas identical. With one backward pass per
    step; with two (the refusal then comes in the second); and with Horovod's ``groups=`` (a
    group holding fc1 was partly counted when the refusal came)."""
    for variant, passes in (("", 1), ("_passes2", 2), ("_groups", 1)):
        torch.manual_seed(1234)
        model = Net()
        named = [(f"{prefix}{variant}.{n}", p) for n, p in model.named_parameters()]
        rest = [p for n, p in model.named_parameters() if not n.startswith("fc1.")]
        opt = torch.optim.SGD([{"params": list(model.fc1.parameters()), "momentum": 0.9},
                               {"params": rest}], lr=LR, momentum=0.0)
        groups = [[model.fc2.weight, model.fc2.bias, model.aux.weight],
                  [model.aux.bias, model.fc1.weight, model.fc1.bias]] \
            if variant == "_groups" else None
        opt = hvd.DistributedOptimizer(opt, named_parameters=named,
                                       compression=DGC(momentum=0.9, warmup_steps=0),
                                       backward_passes_per_step=passes,
                                       groups=groups)
        data = batches(3 * passes, 7)
        key = "momentum_twice" + variant
        try:
            for x, y in data[:passes]:
                F.cross_entropy(model(x), y).backward()
            results[key] = None
        except ValueError as e:
            results[key] = str(e)
        opt.param_groups[0]["momentum"] = 0.0
        before = flat_params(model).clone()
        for step in range(3):
            opt.zero_grad()
            for x, y in data[step * passes:(step + 1) * passes]:
                F.cross_entropy(model(x), y).backward()
            opt.step()
        results[key + "_then_trained"] = {
            "changed": bool((flat_params(model) != before).any()),
            "identical": identical_across_ranks(model)}


def warnings_of_two_steps(opt, model, marker):
    """The warnings (texts containing ``marker``) of two training steps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(2, 3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return [str(w.message) for w in caught if marker in str(w.message)]


def scenario_adam_warning(results, prefix):
    """Adam (its own moment estimates) with DGC(momentum=0.9): one warning per rank at the first
    step, whatever the number of parameters; with DGC(momentum=0): none. Weight decay in both
    DGC and SGD (in one of two parameter groups): one warning; in DGC only: none."""
    out = {}
    for momentum in (0.9, 0.0):
        torch.manual_seed(1234)
        model = Net()
        opt = hvd.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3),
            named_parameters=[(f"{prefix}{int(momentum * 10)}.{n}", p)
                              for n, p in model.named_parameters()],
            compression=DGC(momentum=momentum))
        out[str(momentum)] = warnings_of_two_steps(opt, model, "moment estimates")
    results["adam_warning"] = out
    out = {}
    for decay in (1e-4, 0.0):
        torch.manual_seed(1234)
        model = Net()
        groups = [{"params": [model.fc1.weight]},
                  {"params": [p for p in model.parameters() if p is not model.fc1.weight],
                   "weight_decay": decay}]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(groups, lr=LR),
            named_parameters=[(f"{prefix}wd{decay}.{n}", p) for n, p in model.named_parameters()],
            compression=DGC(weight_decay=1e-4))
        out[str(decay)] = warnings_of_two_steps(opt, model, "applied twice")
    results["weight_decay_warning"] = out


def scenario_model_mismatch(results, prefix):
    """aux.weight is frozen on rank 1 only: a clear error on every rank at the first step,
    not a hang and not a sum of two different tensors."""
    torch.manual_seed(0)
    model = Net()
    if hvd.rank() == 1:
        model.aux.weight.requires_grad_(False)
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=named, compression=DGC())
    x, y = batches(1, 7)[0]
    try:
        F.cross_entropy(model(x), y).backward()
        results["model_mismatch"] = None
    except ValueError as e:
        results["model_mismatch"] = str(e)


def scenario_config_mismatch(results, prefix):
    """One DGC setting differs on rank 1 only (as a HOROVOD_DGC_* variable set on one host
    would make it): a ValueError naming it on every rank at the first gradient, not a hang
    (bucket_numel, exchange: other collectives) and not Horovod's shape error (min_sparse_ndim:
    a tensor dense on one rank, sparsified on the other)."""
    out = {}
    for option, value in (("bucket_numel", 0), ("exchange", "regions"), ("min_sparse_ndim", 1)):
        model, _ = make(f"{prefix}.{option}", DGC(**({option: value} if hvd.rank() == 1 else {})))
        x, y = batches(1, 7)[0]
        try:
            F.cross_entropy(model(x), y).backward()
            error = None
        except ValueError as e:
            error = str(e)
        out[option] = hvd.allgather_object(error, name=f"{prefix}.{option}.error")
    results["config_mismatch"] = out


def scenario_misuse(results, prefix):
    """Adasum, and one DGC shared by two optimizers: clear errors, raised on every rank alike."""
    out = {}
    model, opt = make(prefix + ".adasum", DGC(), op=hvd.Adasum)
    x, y = batches(1, 7)[0]
    try:
        F.cross_entropy(model(x), y).backward()
        out["adasum"] = None
    except RuntimeError as e:
        out["adasum"] = str(e)
    from dgc_horovod.torch import Compression
    for key, uncalled in (("factory", Compression.dgc), ("class", DGC)):
        model, opt = make(f"{prefix}.{key}", uncalled)
        try:
            F.cross_entropy(model(x), y).backward()
            out[key] = None
        except TypeError as e:
            out[key] = str(e)
    # state_dict() between backward() and step() is refused; after the step it works
    for key, kw in (("mid_step", {}), ("mid_step_dense_only", dict(min_sparse_numel=10 ** 6))):
        dgc = DGC(warmup_epochs=0, **kw)
        model, opt = make(f"{prefix}.{key}", dgc)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        try:
            dgc.state_dict()
            out[key] = None
        except RuntimeError as e:
            out[key] = str(e)
        opt.step()
        out[key + "_after"] = sorted(dgc.state_dict()["tensors"]) == sorted(dgc.states)
    shared = DGC(warmup_epochs=0)
    m1, o1 = make(prefix + ".first", shared)
    m2, o2 = make(prefix + ".second", shared)
    train(m1, o1, steps=1)
    try:
        train(m2, o2, steps=1)
        out["shared"] = None
    except ValueError as e:
        out["shared"] = str(e)
    results["misuse"] = out


def scenario_step_patterns(results, prefix):
    """Around synchronize(), in each mode of the exchange (default buckets, gated by clipping,
    one allgather per tensor): step() after synchronize() without skip_synchronize() is refused
    (DGC would take the averaged gradients as the next step's); a step skipped after
    synchronize() (as GradScaler skips one) followed by normal steps is fine; a layer frozen
    after the optimizer was wrapped (Horovod still reduces it, handing DGC zeros) trains as under
    dense Horovod, the layer unchanged."""
    out = {}
    x, y = batches(1, 7)[0]
    for mode, kw in (("buckets", {}), ("gated", dict(clip_norm=1.0)),
                     ("per_tensor", dict(bucket_numel=0))):
        model, opt = make(f"{prefix}.resync.{mode}", DGC(warmup_epochs=0, **kw))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")         # Horovod's own warning about it
            try:
                opt.step()
                out[f"resync_{mode}"] = None
            except RuntimeError as e:
                out[f"resync_{mode}"] = str(e)
        model, opt = make(f"{prefix}.skip.{mode}", DGC(warmup_epochs=0, **kw))
        try:
            for i, (xb, yb) in enumerate(batches(3, 50 + hvd.rank())):
                opt.zero_grad()
                # aux unused: synchronize() itself hands its zeros to DGC after the skipped step
                F.cross_entropy(model(xb, use_aux=False), yb).backward()
                opt.synchronize()
                if i > 0:                           # the first step skipped
                    with opt.skip_synchronize():
                        opt.step()
            out[f"skipped_{mode}"] = {"error": None, "identical": identical_across_ranks(model)}
        except Exception as e:                      # noqa: BLE001 (recorded for the test)
            out[f"skipped_{mode}"] = {"error": repr(e)}
        model, opt = make(f"{prefix}.freeze.{mode}", DGC(warmup_epochs=0, **kw))
        before = model.fc1.weight.detach().clone()
        for p in model.fc1.parameters():
            p.requires_grad_(False)
        try:
            train(model, opt, steps=3)
            out[f"freeze_{mode}"] = {"error": None, "identical": identical_across_ranks(model),
                                     "fc1_unchanged": bool(torch.equal(before, model.fc1.weight))}
        except Exception as e:                      # noqa: BLE001
            out[f"freeze_{mode}"] = {"error": repr(e)}
    results["step_patterns"] = out


def run_scenarios(scenarios):
    """The workers' main: --out PATH, hvd.init(), one intra-op thread, each
    ``scenario(results, prefix)`` of ``scenarios`` in order; rank 0 writes the results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    results = {"size": hvd.size()}
    for scenario, prefix in scenarios:
        scenario(results, prefix)
    flush_timeline(hvd.rank(), lambda name, value: float(
        hvd.allreduce(torch.tensor([value]), name=name, op=hvd.Sum)[0]))
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()


def main():
    run_scenarios([(scenario_identical, "id"), (scenario_engines, "en"),
                   (scenario_compress_many, "cm"),
                   (scenario_equivalence, "eq"), (scenario_wire, "wire"),
                   (scenario_nonfinite, "nf"), (scenario_fp16_overflow, "fp16"),
                   (scenario_momentum_twice, "mt"), (scenario_adam_warning, "adam"),
                   (scenario_model_mismatch, "mm"), (scenario_config_mismatch, "cfg"),
                   (scenario_misuse, "mu"), (scenario_step_patterns, "sp")])


if __name__ == "__main__":
    main()
