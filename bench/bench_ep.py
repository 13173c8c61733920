"""Expert-parallel dispatch and combine (padmoe.torch.distributed) beside a raw all_to_all_single.

    python bench/bench_ep.py --ranks 2 [--backend gloo|nccl] [--tokens T] [--hidden H] [--experts E]
                             [--top-k K] [--alignment m] [--iters N] [--out-md FILE]

Spawns ``--ranks`` processes (one GPU each with ``--backend nccl``; gloo on the CPU by default).
Every rank routes T tokens (uniformly random top-k, seed = rank) over E experts, E/R per rank, and
times, as a user sees it (wall clock of one call, host included, after a barrier; CUDA
synchronized after each call), median of ``--iters`` after 2 warm-ups:

- ``dispatch``: ``ExpertParallel.dispatch`` (exact mode: plan, count exchange with its host read,
  row exchange, chunk sort; sync-free: plan with capacity, fixed-size exchanges, map);
- ``combine``: ``EPRouting.combine`` (chunk unsort, row exchange back, weighted top-k sum);
- ``a2a``: ``all_to_all_single`` of exactly the rows the exact dispatch sends and receives
  (the same splits; the limit dispatch and combine are measured against);
- ``local``: the padmoe ops of the step alone, no exchange (make_plan + dispatch + sort_chunks;
  unsort + combine).

Per rank: the bytes it sends and receives, the rate ``(sent + received) / time``, and
``time / (a2a + local)`` (the target: at most 1.15). The default shape is deepseek-v3's
(H 7168, E 256, K 8, bf16) with 4096 tokens per rank on GPUs and 256 on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, iters):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(iters):
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    # every rank reports the slowest rank's median (an exchange ends when its last rank does)
    med = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def worker(rank, world, args, store, out_md):
    backend = args.backend
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    import padmoe.torch as pt
    import padmoe.torch.distributed as pd

    T, H, E, K, m = args.tokens, args.hidden, args.experts, args.top_k, args.alignment
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(rank)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(dtype).to(dev)

    rows = {}
    ep = pd.ExpertParallel(E, m, check=False)
    y, r = ep.dispatch(x, ids, w)
    h = y.clone()
    sent, recv = sum(r.send_splits), sum(r.recv_splits)
    row_bytes = H * x.element_size()
    # the capacity that drops nothing for this data (the maximum (source rank, expert) count, all ranks)
    cmax = torch.bincount(ids.reshape(-1), minlength=E).max().to(torch.int64)
    dist.all_reduce(cmax, op=dist.ReduceOp.MAX)
    cap = int(cmax.item())
    epf = pd.ExpertParallel(E, m, mode="sync_free", capacity=cap, check=False)
    yf, rf = epf.dispatch(x, ids, w)
    hf = yf.clone()
    assert int(rf.dropped.item()) == 0

    send_buf = torch.empty(sent, H, dtype=dtype, device=dev)
    recv_buf = torch.empty(recv, H, dtype=dtype, device=dev)

    def a2a():
        dist.all_to_all_single(recv_buf, send_buf, r.recv_splits, r.send_splits)

    # the split sizes this rank receives: [R, E_local] (what the exact step's count exchange gives)
    counts = torch.zeros(world, E, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(counts.view(-1), torch.bincount(ids.reshape(-1), minlength=E).to(torch.int64))
    q0, q1 = rank * (E // world), (rank + 1) * (E // world)
    split_sizes = counts[:, q0:q1].to(torch.int32).contiguous()
    y_back = torch.empty(r.plan.padded_rows_bound, H, dtype=dtype, device=dev)

    def local_dispatch():  # the padmoe ops of a dispatch step, without the exchanges
        plan = pt.make_plan(ids, E, 1, check=False)
        pt.dispatch(x, plan, check=False)
        pt.sort_chunks(recv_buf, split_sizes, world, m, rows=r.rows, check=False)

    def local_combine():  # the padmoe ops of a combine step, without the exchange
        pt.unpad_from_alignment(h, r._pmap, recv, check=False)
        pt.combine(y_back, r.plan, w, check=False)

    with torch.no_grad():
        rows["a2a"] = _time(a2a, dev, args.iters)
        rows["local dispatch"] = _time(local_dispatch, dev, args.iters)
        rows["local combine"] = _time(local_combine, dev, args.iters)
        rows["dispatch (exact)"] = _time(lambda: ep.dispatch(x, ids, w), dev, args.iters)
        rows["combine (exact)"] = _time(lambda: r.combine(h), dev, args.iters)
        rows["dispatch (sync_free)"] = _time(lambda: epf.dispatch(x, ids, w), dev, args.iters)
        rows["combine (sync_free)"] = _time(lambda: rf.combine(hf), dev, args.iters)

    if rank == 0:
        ex_bytes = (sent + recv) * row_bytes
        sf_bytes = 2 * E * cap * row_bytes
        lines = [
            f"# padmoe.torch.distributed: {world} ranks, backend {backend}, "
            f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}",
            "",
            f"T={T} tokens per rank, H={H}, E={E} ({E // world} per rank), K={K}, alignment {m}, {args.dtype}; "
            f"rank 0 sends {sent} rows and receives {recv} (exact); sync-free capacity {cap} per (rank, expert) "
            f"(the largest count: no drops), {E * cap} rows each way. Median of {args.iters}, slowest rank, "
            f"wall clock of one call (host included).",
            "",
            "| op | ms | GB/s per rank (sent + received) | time / (a2a + local) |",
            "| --- | --- | --- | --- |",
        ]
        a2a_t = rows["a2a"]
        for name, t in rows.items():
            if name.startswith("dispatch") or name.startswith("combine"):
                local = rows["local dispatch"] if name.startswith("dispatch") else rows["local combine"]
                nbytes = sf_bytes if "sync_free" in name else ex_bytes
                ratio = f"{t / (a2a_t + local):.2f}"
            else:
                nbytes = ex_bytes if name == "a2a" else 0
                ratio = "-"
            rate = f"{nbytes / t / 1e9:.1f}" if nbytes else "-"
            lines.append(f"| {name} | {t * 1e3:.3f} | {rate} | {ratio} |")
        text = "\n".join(lines) + "\n"
        print(text)
        if out_md:
            with open(out_md, "a") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out-md", default=None)
    args = p.parse_args()
    if args.tokens is None:
        args.tokens = 4096 if args.backend == "nccl" else 256
    if args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
        sys.exit(
            f"bench_ep.py: {args.ranks} ranks over NCCL need {args.ranks} GPUs (found {torch.cuda.device_count()})"
        )
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.ranks, args, os.path.join(d, "store"), args.out_md), nprocs=args.ranks)


if __name__ == "__main__":
    main()
