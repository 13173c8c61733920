"""padmoe.torch.distributed (expert parallelism) on the CPU: 2 and 4 processes over gloo.

Each test spawns R processes (torch.multiprocessing, a file store, a 60 s collective timeout and a
join deadline, so a hang fails the test instead of the run). Every rank builds the same global
batch from a seed, takes its own slice of tokens (uneven, one rank empty), and checks:

- the exact mode, and the sync-free mode with no drops, against single-device padmoe on the
  concatenated batch, bitwise, forward and backward (x, router weights, expert weights), and
  against a float64 loop reference;
- the sync-free mode with drops against a loop reference of the capacity per (source rank, expert);
- bad input: a clear error on every rank, no hang.

On GPUs the same workers run over NCCL (``PADMOE_EP_BACKEND=nccl``, one GPU per rank), or over gloo
with CUDA tensors (``PADMOE_EP_DEVICE=cuda``: several ranks may share one GPU, so the CUDA kernels
run in every multi-rank test on a single GPU; gloo moves the rows through host memory).
"""

import math
import os
import sys
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
pytest.importorskip("padmoe.torch")

import torch.multiprocessing as mp  # noqa: E402

BACKEND = os.environ.get("PADMOE_EP_BACKEND", "gloo")
# PADMOE_EP_DEVICE=cuda with gloo: the rows are CUDA tensors (padmoe's CUDA kernels on every rank,
# gloo moving them through host memory), every rank on GPU rank % count: several ranks on one GPU
DEVICE = "cuda" if BACKEND == "nccl" else os.environ.get("PADMOE_EP_DEVICE", "cpu")
JOIN_S = 240


# ---------------------------------------------------------------------------
# process harness
# ---------------------------------------------------------------------------


def _entry(rank, world, store, backend, name, args, errdir):
    from datetime import timedelta

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif DEVICE == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        globals()[name](rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def run(tmp_path, world, name, *args):
    """Run ``name(rank, world, *args)`` on ``world`` processes; fail with every rank's traceback."""
    if BACKEND == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks over NCCL need {world} GPUs")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("PADMOE_EP_DEVICE=cuda: no GPU")
    errdir = tmp_path / "errors"
    errdir.mkdir(exist_ok=True)
    ctx = mp.start_processes(
        _entry,
        args=(world, str(tmp_path / "store"), BACKEND, name, args, str(errdir)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} on {world} ranks did not finish in {JOIN_S} s (a hang)")
    except mp.ProcessRaisedException:
        pass
    except mp.ProcessExitedException:
        pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    errors = sorted(errdir.glob("*.err"))
    if errors:
        raise AssertionError("\n".join(f"--- {e.name}\n{e.read_text()}" for e in errors))


# ---------------------------------------------------------------------------
# data and references (run inside the ranks)
# ---------------------------------------------------------------------------


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


def _batch(world, E, K, H, dtype, seed=0, tokens=None, skip_expert=None):
    """The global batch: per-rank token counts (uneven; rank 1 empty when world > 1), ids without
    repeats per token (and never ``skip_expert``), weights, rows, and expert weights."""
    g = torch.Generator().manual_seed(seed)
    ts = tokens or [7 + 5 * r for r in range(world)]
    if tokens is None and world > 1:
        ts[1] = 0
    T = sum(ts)
    allowed = [e for e in range(E) if e != skip_expert]
    ids = (
        torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.int64)
    )
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(torch.float32)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    W = (torch.randn(E, H, H, generator=g, dtype=torch.float64) / math.sqrt(H)).to(dtype)
    return ts, ids, w, x, W


def _segments(y, offs, W):
    """Per-expert GEMMs over the segments of a padded buffer (``offs`` inclusive ends)."""
    out, s = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(y[s:end] @ W[e])
        s = end
    return torch.cat(out) if out else y[:0] @ W[0] if W.shape[0] else y[:0]


def _rowwise(y, offs, W):
    """A row-wise expert function (same bits for a row whatever the segment's length): tanh(y * d_e)."""
    scale = torch.repeat_interleave(W[:, 0, :], torch.diff(offs.long(), prepend=offs.new_zeros(1).long()), dim=0)
    scale = torch.cat([scale, scale.new_zeros(y.shape[0] - scale.shape[0], scale.shape[1])])  # rows past the last
    return torch.tanh(y * scale)


def _single(ids, w, x, W, E, alignment, fn, weighted=False):
    import padmoe.torch as pt

    xs, ws, Ws = x.clone().requires_grad_(), w.clone().requires_grad_(), W.clone().requires_grad_()
    r = pt.Routing.from_topk(ids, ws, E, alignment)
    out = r.combine(fn(r.dispatch(xs, weighted=weighted), r.offsets, Ws), weighted=not weighted)
    out.backward(_grad_out(out.shape[0], out.shape[1], out.dtype, out.device))
    return out.detach(), xs.grad, ws.grad, Ws.grad


def _grad_out(T, H, dtype, device, sl=None):
    """The output gradient of the global batch (rows ``sl`` of it: a rank's tokens)."""
    g = torch.Generator().manual_seed(7)
    full = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype).to(device)
    return full if sl is None else full[sl]


def _ep_run(ep, ids, w, x, W, fn, weighted=False, total=None):
    """One EP step of this rank's tokens (rows ``total[1]`` of a global batch of ``total[0]`` tokens)."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    Wl = W[ep.local_experts].clone().requires_grad_()
    y, r = ep.dispatch(xl, ids, wl, weighted=weighted)
    assert y.shape[0] == r.rows and r.offsets.numel() == ep.num_local_experts
    out = r.combine(fn(y, r.offsets, Wl), weighted=not weighted)
    T, sl = total if total is not None else (out.shape[0], None)
    out.backward(_grad_out(T, out.shape[1], out.dtype, out.device, sl))
    return out.detach(), xl.grad, wl.grad, Wl.grad, y.detach(), r


def _reference(ids, w, x, W, keep=None, rowwise=False, before=False):
    """float64 loops: out[t] = sum over kept k of w[t,k] * f_e(x[t]) (``before``: f_e(w[t,k] * x[t]))."""
    T, K = ids.shape
    out = torch.zeros(T, W.shape[2], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if keep is not None and not keep[t][k]:
                continue
            e = int(ids[t, k])
            xe = x[t].double() * (float(w[t, k]) if before else 1.0)
            f = torch.tanh(xe * W[e, 0].double()) if rowwise else xe @ W[e].double()
            out[t] += f if before else float(w[t, k]) * f
    return out


def _keep_capacity(ids, w, C, policy):
    """Which assignments of one source rank a capacity C per expert keeps (loops)."""
    T, K = ids.shape
    keep = [[False] * K for _ in range(T)]
    by_expert = {}
    for a in range(T * K):
        by_expert.setdefault(int(ids[a // K, a % K]), []).append(a)
    dropped = 0
    for e, members in by_expert.items():
        if policy == "probs":  # largest weights first, ties to the lower assignment id
            members = sorted(members, key=lambda a: (-float(w[a // K, a % K]), a))
        for a in members[:C]:
            keep[a // K][a % K] = True
        dropped += max(0, len(members) - C)
    return keep, dropped


def _slice(rank, ts):
    lo = sum(ts[:rank])
    return slice(lo, lo + ts[rank])


def _eq(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(a.cpu(), b.cpu()), (
        f"{what}: not bitwise equal (max diff {(a.double() - b.double()).abs().max()})"
    )


# ---------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------


def w_matches_single_device(rank, world, dtype_name, placement):
    import padmoe.torch.distributed as pd

    dtype = getattr(torch, dtype_name)
    dev = _device()
    E, K, H, m = 8, 2, 16, 4
    ts, ids, w, x, W = _batch(world, E, K, H, dtype, skip_expert=5)  # expert 5 gets no tokens
    ids, w, x, W = ids.to(dev), w.to(dev), x.to(dev), W.to(dev)
    expert_ranks = None
    if placement == "uneven":  # interleaved, uneven counts
        expert_ranks = {2: [1, 0, 1, 1, 0, 1, 1, 1], 4: [3, 0, 1, 3, 2, 3, 0, 3]}[world]
    sl = _slice(rank, ts)
    single = _single(ids, w, x, W, E, m, _segments)
    ref = _reference(ids[sl].cpu(), w[sl].cpu(), x[sl].cpu(), W.cpu())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for mode, cap in (("exact", None), ("sync_free", 64)):
        ep = pd.ExpertParallel(E, m, expert_ranks=expert_ranks, mode=mode, capacity=cap)
        assert ep.local_experts == [e for e in range(E) if ep.expert_ranks[e] == rank]
        out, gx, gw, gW, y, r = _ep_run(ep, ids[sl], w[sl], x[sl], W, _segments, total=(sum(ts), sl))
        torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
        if mode == "exact":
            # bitwise equal to one device on the concatenated batch, forward and backward
            _eq(out, single[0][sl], f"{mode} out")
            _eq(gx, single[1][sl], f"{mode} grad x")
            _eq(gw, single[2][sl], f"{mode} grad weights")
            _eq(gW, single[3][ep.local_experts], f"{mode} grad expert weights")
            assert r.dropped is None
            # each local expert's segment: its rows in the single-device order, padded to m
            counts = torch.bincount(ids.reshape(-1).cpu(), minlength=E)
            assert r.tokens_per_expert.tolist() == [int(counts[e]) for e in ep.local_experts]
            ends = torch.tensor([int(-(-int(counts[e]) // m) * m) for e in ep.local_experts]).cumsum(0)
            assert r.offsets.tolist() == ends.tolist() and r.rows == int(ends[-1])
        else:
            torch.testing.assert_close(out, single[0][sl], rtol=tol, atol=tol)
            assert int(r.dropped.item()) == 0
        # row_experts: -1 exactly on zero padding rows
        re = r.row_experts.cpu()
        pad = re < 0
        assert torch.count_nonzero(y.cpu()[pad]) == 0
        assert int((~pad).sum()) == int(r.tokens_per_expert.sum())
        # run to run: bitwise equal
        again = _ep_run(ep, ids[sl], w[sl], x[sl], W, _segments, total=(sum(ts), sl))
        for a, b, what in zip((out, gx, gw, gW), again[:4], ("out", "grad x", "grad w", "grad W")):
            _eq(a, b, f"{mode} rerun {what}")


def w_sync_free_rowwise_bitwise(rank, world, weighted):
    """Sync-free with no drops gives the exact mode's (and one device's) bits for a row-wise expert."""
    import padmoe.torch.distributed as pd

    dev = _device()
    E, K, H, m = 8, 2, 16, 8
    ts, ids, w, x, W = _batch(world, E, K, H, torch.float32, seed=3)
    ids, w, x, W = ids.to(dev), w.to(dev), x.to(dev), W.to(dev)
    sl = _slice(rank, ts)
    single = _single(ids, w, x, W, E, m, _rowwise, weighted=weighted)
    exact = _ep_run(pd.ExpertParallel(E, m), ids[sl], w[sl], x[sl], W, _rowwise, weighted=weighted, total=(sum(ts), sl))
    free = _ep_run(
        pd.ExpertParallel(E, m, mode="sync_free", capacity=32),
        ids[sl],
        w[sl],
        x[sl],
        W,
        _rowwise,
        weighted=weighted,
        total=(sum(ts), sl),
    )
    for i, what in enumerate(("out", "grad x", "grad weights")):
        _eq(exact[i], single[i][sl], f"exact {what}")
        _eq(free[i], single[i][sl], f"sync_free {what}")
    # (x in float32 times w rounds before tanh: compare the weighted form with a float32-sized tolerance)
    ref = _reference(ids[sl].cpu(), w[sl].cpu(), x[sl].cpu(), W.cpu(), rowwise=True, before=weighted)
    torch.testing.assert_close(free[0].double().cpu(), ref, rtol=1e-5, atol=1e-5)


def w_sync_free_graph(rank, world):
    """The sync-free step (dispatch, a row-wise expert, combine) captured once in a CUDA graph and
    replayed: the eager step's bits and drop count, for the captured inputs and after other inputs
    of the same shapes are copied into them."""
    import padmoe.torch.distributed as pd

    dev = _device()
    E, K, H, m, C = 8, 2, 16, 4, 3  # 24 assignments a rank over 8 experts: some experts past C
    ts = [12] * world
    sl = _slice(rank, ts)
    batches = []
    for seed in (21, 22):
        _, ids, w, x, _ = _batch(world, E, K, H, torch.float32, seed=seed, tokens=ts)
        batches.append((x[sl].to(dev), ids[sl].to(dev), w[sl].to(dev)))
    ep = pd.ExpertParallel(E, m, mode="sync_free", capacity=C)

    def step(x, ids, w):
        y, r = ep.dispatch(x, ids, w)
        return r.combine(torch.tanh(y) * 2.0), r.dropped

    eager = []
    for x, ids, w in batches:
        out, dropped = step(x, ids, w)
        eager.append((out.clone(), int(dropped.item())))
        _, dropped_ref = _keep_capacity(ids.cpu(), w.cpu(), C, "position")
        assert eager[-1][1] == dropped_ref, (eager[-1][1], dropped_ref)
    assert any(d > 0 for _, d in eager), "the test wants drops"
    sx, sids, sw = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(2):
            step(sx, sids, sw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_dropped = step(sx, sids, sw)
    for i in (1, 0, 1):
        x, ids, w = batches[i]
        sx.copy_(x)
        sids.copy_(ids)
        sw.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        _eq(g_out, eager[i][0], f"graph replay {i} out")
        assert int(g_dropped.item()) == eager[i][1], (i, int(g_dropped.item()), eager[i][1])


def w_sync_free_drops(rank, world, policy):
    import padmoe.torch.distributed as pd

    dev = _device()
    E, K, H, m, C = 4, 2, 8, 2, 2
    ts = [9, 6, 0, 11][:world]
    _, ids, w, x, W = _batch(world, E, K, H, torch.float32, seed=11, tokens=ts)
    ids, w, x, W = ids.to(dev), w.to(dev), x.to(dev), W.to(dev)
    sl = _slice(rank, ts)
    ep = pd.ExpertParallel(E, m, mode="sync_free", capacity=C, drop_policy=policy)
    out, gx, gw, gW, y, r = _ep_run(ep, ids[sl], w[sl], x[sl], W, _segments)
    keep, dropped = _keep_capacity(ids[sl].cpu(), w[sl].cpu(), C, policy)
    assert int(r.dropped.item()) == dropped, (int(r.dropped.item()), dropped)
    ref = _reference(ids[sl].cpu(), w[sl].cpu(), x[sl].cpu(), W.cpu(), keep=keep)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    # a dropped assignment's weight gradient is exactly zero, a kept one's is its dot
    go = _grad_out(out.shape[0], out.shape[1], out.dtype, out.device).double().cpu()
    for t in range(ts[rank]):
        for k in range(K):
            e = int(ids[sl][t, k])
            want = float(go[t] @ (x[sl][t].double().cpu() @ W[e].double().cpu())) if keep[t][k] else 0.0
            if keep[t][k]:
                assert abs(float(gw[t, k]) - want) <= 1e-4 * (1 + abs(want)), (t, k, float(gw[t, k]), want)
            else:
                assert float(gw[t, k]) == 0.0
    # the buffer: every local expert's segment is S = round_up(R*C, m) rows, real rows first
    S = -(-world * C // m) * m
    assert r.rows == ep.num_local_experts * S and r.offsets.tolist() == [
        S * (i + 1) for i in range(ep.num_local_experts)
    ]
    # all ranks' drops sum to the global count
    total = r.dropped.clone().to(_device())
    dist.all_reduce(total)
    all_dropped = sum(
        _keep_capacity(ids[_slice(q, ts)].cpu(), w[_slice(q, ts)].cpu(), C, policy)[1] for q in range(world)
    )
    assert int(total.item()) == all_dropped


def _expect_error(fn, *words):
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        for wd in words:
            assert wd in msg, f"expected {wd!r} in {msg!r}"
        return msg
    raise AssertionError(f"no error (expected one naming {words})")


def w_bad_input(rank, world):
    import padmoe.torch.distributed as pd

    dev = _device()
    E, K, H = 8, 2, 8
    # a world size that does not divide E (no collective before the error)
    _expect_error(lambda: pd.ExpertParallel(world * 2 + 1), "num_experts", "do not divide")
    _expect_error(lambda: pd.ExpertParallel(E, expert_ranks=[0] * E), "expert_ranks", "rank 1 holds no expert")
    _expect_error(lambda: pd.ExpertParallel(E, expert_ranks=[world] + [0] * (E - 1)), "expert_ranks", "entry 0")
    _expect_error(lambda: pd.ExpertParallel(E, mode="sync_free"), "capacity")
    # configurations that differ across ranks
    _expect_error(lambda: pd.ExpertParallel(E, 4 if rank == 1 else 8), "alignment", "rank 1")
    _expect_error(lambda: pd.ExpertParallel(E if rank != 1 else 2 * E), "num_experts")
    for mode, cap in (("exact", None), ("sync_free", 8)):
        ep = pd.ExpertParallel(E, 4, mode=mode, capacity=cap)
        ids = torch.tensor([[0, 1], [2, 3], [4, 5]], device=dev)
        w = torch.rand(3, K, device=dev)
        # a hidden size that differs on one rank: every rank raises, nothing hangs
        hh = H + 8 if rank == world - 1 else H
        _expect_error(lambda: ep.dispatch(torch.randn(3, hh, device=dev), ids, w), "hidden size", f"rank {world - 1}")
        # a top-k that differs
        kk = 1 if rank == 0 else K
        _expect_error(lambda: ep.dispatch(torch.randn(3, H, device=dev), ids[:, :kk], w[:, :kk]), "top_k")
        # rows on a device the backend does not move (meta), on one rank: it names the device, the
        # others name the rank
        on_meta = rank == 0
        msg = _expect_error(
            lambda: ep.dispatch(
                torch.empty(3, H, device="meta") if on_meta else torch.randn(3, H, device=dev),
                ids.to("meta") if on_meta else ids,
                w.to("meta") if on_meta else w,
            )
        )
        assert ("x: on meta" in msg) if on_meta else ("rank 0 rejected" in msg), msg
        # an expert id out of range on one rank: it names the id, the others name the rank
        bad = ids.clone()
        if rank == 1:
            bad[2, 1] = E + 3
        msg = _expect_error(lambda: ep.dispatch(torch.randn(3, H, device=dev), bad, w))
        if rank == 1:
            assert "top_experts" in msg and str(E + 3) in msg, msg
        else:
            assert "rank 1 rejected" in msg, msg
        # a good step still works after the errors (no collective was left half done)
        y, r = ep.dispatch(torch.randn(3, H, device=dev), ids, w)
        # combine with the wrong buffer on one rank: every rank raises
        h = y if rank != 0 else y[:-1]
        _expect_error(lambda: r.combine(h), "h: expected" if rank == 0 else "rank 0 rejected")
        out = r.combine(y)
        assert out.shape == (3, H)


def w_bf16_and_no_grad(rank, world):
    """bfloat16 rows move bitwise (bytes on the wire); under no_grad nothing is recorded."""
    import padmoe.torch.distributed as pd

    dev = _device()
    E, K, H, m = 4 * world, 3, 24, 16
    ts, ids, w, x, W = _batch(world, E, K, H, torch.bfloat16, seed=5)
    ids, w, x, W = ids.to(dev), w.to(dev), x.to(dev), W.to(dev)
    sl = _slice(rank, ts)
    import padmoe.torch as pt

    with torch.no_grad():
        rs = pt.Routing.from_topk(ids, w, E, m)
        ys = rs.dispatch(x)
        for mode, cap in (("exact", None), ("sync_free", 64)):
            ep = pd.ExpertParallel(E, m, mode=mode, capacity=cap)
            y, r = ep.dispatch(x[sl], ids[sl], w[sl])
            assert not y.requires_grad
            # the local buffer's real rows are the single-device segments of the local experts
            lo = [0] + rs.offsets.tolist()
            for i, e in enumerate(ep.local_experts):
                n = int(r.tokens_per_expert[i])
                start = 0 if i == 0 else int(r.offsets[i - 1])
                _eq(y[start : start + n], ys[lo[e] : lo[e] + n], f"{mode} expert {e} rows")
            out = r.combine(_segments(y, r.offsets, W[ep.local_experts]))
            single = rs.combine(_segments(ys, rs.offsets, W))
            if mode == "exact":
                _eq(out, single[sl], f"{mode} bf16 out")
            else:
                torch.testing.assert_close(out, single[sl], rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("placement", ["default", "uneven"])
def test_matches_single_device(tmp_path, world, placement):
    run(tmp_path, world, "w_matches_single_device", "float32", placement)


def test_one_rank(tmp_path):
    """A group of one: every expert local, the exchanges copies."""
    run(tmp_path, 1, "w_matches_single_device", "float32", "default")


def test_matches_single_device_bf16(tmp_path):
    run(tmp_path, 2, "w_matches_single_device", "bfloat16", "default")


@pytest.mark.parametrize("weighted", [False, True])
def test_sync_free_rowwise_bitwise(tmp_path, weighted):
    run(tmp_path, 4 if weighted else 2, "w_sync_free_rowwise_bitwise", weighted)


@pytest.mark.parametrize("world,policy", [(2, "position"), (4, "position"), (2, "probs"), (4, "probs")])
def test_sync_free_drops(tmp_path, world, policy):
    run(tmp_path, world, "w_sync_free_drops", policy)


@pytest.mark.parametrize("world", [1, 2])
def test_sync_free_cuda_graph(tmp_path, world):
    """The sync-free mode in a CUDA graph (NCCL on GPUs; a group of one on a single GPU)."""
    if BACKEND != "nccl":
        pytest.skip("CUDA graph capture: PADMOE_EP_BACKEND=nccl on GPUs")
    run(tmp_path, world, "w_sync_free_graph")


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input(tmp_path, world):
    run(tmp_path, world, "w_bad_input")


def test_bf16_no_grad(tmp_path):
    run(tmp_path, 2, "w_bf16_and_no_grad")


def test_needs_init():
    import padmoe.torch.distributed as pd

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        pd.ExpertParallel(8)
