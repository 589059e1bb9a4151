"""What elastic_worker.py (PyTorch) and tf_elastic_worker.py (TensorFlow) share: the job's
settings, its command line, the elastic training loop with the records tests/test_elastic.py
asserts, and the check of the first step of a world. Framework-free: each worker passes its
Horovod module and a few functions (see :func:`run`)."""
import argparse
import json
import os
import time

import numpy as np

STEPS, EXIT_STEP, RESTORE_STEP = 10, 6, 3
CLIP = 1e-3
# per-tensor clipping keeps the PyTorch exchange overlapping with backward, so a failing step has
# compressed (and must be restored) before its collectives fail
DGC_KW = dict(compress_ratio=0.05, momentum=0.9, warmup_epochs=0, clip_norm=CLIP,
              clip_scope="tensor", min_sparse_numel=16, min_sparse_ndim=1, bucket_numel=600)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["exit", "remove"], default="exit")
    parser.add_argument("--hosts-file", help="--mode remove: the file the discovery script prints")
    return parser.parse_args()


def check_fresh(arrays, local, world, previous_world):
    """u = v = s·g off the sent positions, 0 on them; s from `world` (elastic_worker.py).

    arrays: {name: (sparse, u, v)} of DGC's states as float64 NumPy arrays (v None if dense);
    local: {name: this rank's gradient before the exchange, flat float64}."""
    out = {"world": world, "tensors": 0, "ok": True, "fits_previous_world": False, "sent": 0}
    for name, (sparse, u, v) in sorted(arrays.items()):
        g = local[name]
        if sparse:
            if not np.array_equal(u, v):
                out["ok"] = False
            kept = v != 0
            out["sent"] += int((~kept & (g != 0)).sum())
        else:
            v, kept = u, np.ones_like(u, dtype=bool)        # dense: u = s·g, nothing cleared

        def fits(n):        # local clipping under op=Average: ||g|| <= CLIP * sqrt(N)
            s = min(1.0, CLIP * n ** 0.5 / (np.linalg.norm(g) + 1e-6))
            return bool(np.allclose(v[kept], s * g[kept], rtol=1e-5, atol=1e-12))

        out["tensors"] += 1
        out["ok"] = out["ok"] and fits(world)
        if previous_world and fits(previous_world):
            out["fits_previous_world"] = True
    return out


def remove_host(hvd, state, hosts_file):
    """Rank 0 drops 127.0.0.1 from the discovery output (see :func:`update_hosts`)."""
    update_hosts(hvd, state, hosts_file, ["localhost:2"], "host 127.0.0.1 removed from discovery")


def update_hosts(hvd, state, hosts_file, lines, what):
    """Rank 0 writes ``lines`` as the discovery output, prints ``what`` and the step, and waits
    for the driver's notice; the commit then raises HostsUpdatedInterrupt on every rank alike (it
    broadcasts rank 0's view)."""
    if hvd.rank() == 0:
        with open(hosts_file, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        print(f"{what} at step {state.step}", flush=True)
        deadline = time.time() + 60
        while state._host_messages.empty():
            if time.time() > deadline:
                raise TimeoutError("no host update notice from the elastic driver in 60 s")
            time.sleep(0.1)
    state.commit()                                    # raises HostsUpdatedInterrupt


def run(hvd, args, state, dgc, train_step, restore_check, dgc_arrays, final_params, errors,
        state_of):
    """The elastic job of one process; writes its record to args.out and prints its last line.

    train_step(step) -> {name: local gradient}; restore_check(step) -> the "restore" record (one
    uncommitted step, state.restore(), compared with the commit); dgc_arrays() -> check_fresh's
    arrays; final_params() -> (flat float parameters as a list, finite, identical on every rank);
    errors: what a failed collective raises; state_of(dgc) -> a new elastic state carrying that
    DGC, whose sync must refuse a DGC with another compress_ratio on rank 1, on every rank
    (recorded as config_mismatch, before training)."""
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
    local_rank = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
    leaver = host == "127.0.0.1"
    record = {"host": host, "local_rank": local_rank, "entries": [], "fresh": [], "restore": None,
              "reset_callbacks": []}
    committed_stat_steps = [0]

    def on_reset():
        print(f"elastic reset: world size {hvd.size()}, rank {hvd.rank()}, host {host}",
              flush=True)
        record["reset_callbacks"].append(hvd.size())

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        record["entries"].append({
            "size": hvd.size(), "rank": hvd.rank(), "step": state.step, "resets": dgc.resets,
            # states that hold a residual (the TensorFlow graph keeps its variables, zeroed)
            "dgc_states": sum(1 for _, u, v in dgc_arrays().values()
                              if (u is not None and u.any()) or (v is not None and v.any())),
            "stat_steps": dgc.total_stats.steps,
            "committed_stat_steps": committed_stat_steps[0]})
        first_in_world = True             # every entry starts a world (the start or a reset)
        previous = record["entries"][-2]["size"] if len(record["entries"]) > 1 else None
        while state.step < STEPS:
            step = state.step
            if leaver and step == EXIT_STEP and args.mode == "exit":
                print(f"worker on {host} leaves at step {step}", flush=True)
                os._exit(3)
            if step == EXIT_STEP and args.mode == "remove" and hvd.size() == 3:
                remove_host(hvd, state, args.hosts_file)
            if step == RESTORE_STEP and record["restore"] is None:
                record["restore"] = restore_check(step)
            try:
                local = train_step(step)
            except errors as e:
                record["failed"] = {"step": step, "stat_steps": dgc.total_stats.steps,
                                    "committed_stat_steps": committed_stat_steps[0],
                                    "error": type(e).__name__}
                raise
            if first_in_world:
                record["fresh"].append(check_fresh(dgc_arrays(), local, hvd.size(), previous))
                first_in_world = False
            state.step += 1
            state.commit()
            committed_stat_steps[0] = dgc.total_stats.steps
        params, finite, identical = final_params()
        record["final"] = {"size": hvd.size(), "rank": hvd.rank(), "resets": dgc.resets,
                           "finite": finite, "identical": identical, "params": params}

    other = type(dgc)(**dict(DGC_KW, compress_ratio=0.1 if hvd.rank() == 1 else 0.05))
    try:
        state_of(other).sync()
        record["config_mismatch"] = None
    except ValueError as e:
        record["config_mismatch"] = str(e)
    train(state)
    with open(os.path.join(args.out, f"{host}.{local_rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"finished on {host}: world size {hvd.size()}, DGC resets {dgc.resets}", flush=True)
