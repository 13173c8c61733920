"""padmoe.torch.distributed: expert parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU;
gloo also moves CUDA tensors, through host memory).

Each of the R ranks of a process group routes its own tokens; every expert lives on one rank.
``dispatch`` sends each token row to the ranks that hold its top-k experts and returns this
rank's padded expert buffer (expert-major, each local expert's segment padded to
``alignment``, with the grouped-GEMM ``offsets``); the experts run there; ``combine`` sends their
outputs back and forms the weighted top-k sum on the tokens' own rank. Both are differentiable:
the backward of each exchange is the reverse exchange, and the router-weight gradient is formed
on the source rank (where the weights are used)::

    import padmoe.torch.distributed as pd

    ep = pd.ExpertParallel(num_experts=256, alignment=128)             # E/R experts per rank
    y, r = ep.dispatch(x, top_experts, weights)                        # y: [r.rows, H] local experts
    h = torch.nn.functional.grouped_mm(y, w_local, offs=r.offsets)     # w_local: [E/R, H, I]
    out = r.combine(h)                                                 # [T, H] on the tokens' rank

Two modes:

- ``mode="exact"`` (default): the per-(rank, expert) counts are exchanged first (one
  ``all_gather_into_tensor``, read on the host once: the split sizes, as Megatron's all-to-all
  dispatcher does), then the rows with ``all_to_all_single`` and variable splits; the received
  rank-major chunks are put expert-major by :func:`padmoe.torch.sort_chunks`. Nothing is dropped.
  The result is bitwise equal to single-device padmoe on the concatenated batch (ranks in order),
  forward and backward, whenever the expert computation gives the same bits for the same
  segment (a per-expert GEMM does: each segment has the same rows, in the same order, at the
  same padded length as on one device).
- ``mode="sync_free"``: a fixed ``capacity`` C per (source rank, expert). Each source rank keeps
  the first C assignments of each expert (``drop_policy="probs"``: the C largest weights) and
  counts the rest on the device (``r.dropped``); every split size is fixed (C rows per
  (source rank, expert)), so nothing is read on the host and the step can be captured in a CUDA
  graph. The local buffer is ``[E_local, S, H]`` flattened, ``S = round_up(R*C, alignment)``, each
  expert's real rows first (rank-major, then the source's assignment order) and zero rows after
  them: the layout of masked grouped GEMMs (DeepGEMM's masked layout: ``r.tokens_per_expert`` is
  its ``masked_m``), with ``r.offsets = [S, 2S, ...]``. With no drops the real rows are those of
  the exact mode, in the same order.

Checks: every rank must make the same calls with the same ``ExpertParallel`` configuration, the
same top-k, hidden size, dtype and gradient requirements (each rank may have any number of
tokens, zero included). The exact mode checks that with the count exchange it does anyway; the
sync-free mode, when ``check`` is on (the default in eager mode, off while a CUDA graph is being
captured and under torch.compile), with one extra small ``all_gather`` and a host read. A rank
whose own input is bad (an expert id out of range, a shape) raises its own error, and every other
rank raises a ``ValueError`` naming that rank, at the same collective: nothing hangs and no row is
sent. With ``check=False`` in the sync-free mode a rank that raises locally leaves the others
waiting in the exchange until the process group's timeout.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import padmoe.torch as pt
from padmoe._args import int_arg
from padmoe._plan import INT32_MAX

__all__ = ["ExpertParallel", "EPRouting"]

Tensor = torch.Tensor

# dtype codes in the metadata that ranks compare (any stable small integers).
_DTYPE_CODE = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    getattr(torch, "float8_e4m3fn", None): 5,
    getattr(torch, "float8_e5m2", None): 6,
}
_META_FIELDS = (
    "error",
    "top_k",
    "hidden size",
    "dtype",
    "weighted",
    "x.requires_grad",
    "weights.requires_grad",
    "has weights",
)
_COMBINE_FIELDS = ("error", "hidden size of h", "dtype of h", "h.requires_grad", "weighted")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _wire(t: Tensor) -> Tensor:
    """A row-major tensor as bytes per row: the exchange is a bitwise move, and every backend
    (gloo lacks some float types) moves uint8."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _exchange(x: Tensor, out_splits: List[int], in_splits: List[int], out_rows: int, group) -> Tensor:
    """``all_to_all_single`` of the first ``sum(in_splits)`` rows of ``x`` into a new
    ``[out_rows, ...]`` tensor (rows past ``sum(out_splits)`` zero)."""
    n_in, n_out = sum(in_splits), sum(out_splits)
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    if out_rows > n_out:
        out[n_out:].zero_()
    send = x[:n_in]
    if not send.is_contiguous():
        send = send.contiguous()
    if x.shape[1:].numel() == 0:  # rows of zero bytes (every rank: the hidden sizes were compared)
        return out
    dist.all_to_all_single(_wire(out[:n_out]), _wire(send), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks; the backward sends the gradient rows back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, out_rows, group):
        ctx.splits = (out_splits, in_splits)
        ctx.in_rows = x.shape[0]
        ctx.group = group
        return _exchange(x, out_splits, in_splits, out_rows, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad.contiguous(), in_splits, out_splits, ctx.in_rows, ctx.group), None, None, None, None


def _checking(check: Optional[bool], device: torch.device) -> bool:
    if check is not None:
        return bool(check)
    if torch.compiler.is_compiling():
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


class ExpertParallel:
    """Expert parallelism over a process group (default: the world).

    ``num_experts`` E global experts; ``expert_ranks`` (optional, E ints in ``[0, R)``) puts
    expert e on rank ``expert_ranks[e]`` (any placement, each rank at least one expert); by
    default rank q holds experts ``[q*E/R, (q+1)*E/R)`` and R must divide E. A rank's local
    experts are in ascending global id order (``local_experts``); its expert buffer holds their
    segments in that order, each padded to a multiple of ``alignment``.

    ``mode``: ``"exact"`` or ``"sync_free"`` (then ``capacity`` C rows per (source rank, expert)
    and ``drop_policy`` ``"position"`` or ``"probs"``). ``check``: see the module's docstring.
    Every rank constructs it with the same arguments (checked here, with one small collective)."""

    def __init__(
        self,
        num_experts: int,
        alignment: int = 1,
        *,
        group=None,
        expert_ranks: Optional[Union[Sequence[int], Tensor]] = None,
        mode: str = "exact",
        capacity: Optional[int] = None,
        drop_policy: str = "position",
        check: Optional[bool] = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ExpertParallel: torch.distributed is not initialized (call torch.distributed.init_process_group first)"
            )
        op = "ExpertParallel"
        # Sizes first, as integers that fit the int32 ids and counts of padmoe's plans: the placement
        # below builds lists of E entries.
        E = int_arg(op, "num_experts", num_experts, 1, INT32_MAX)
        alignment = int_arg(op, "alignment", alignment, 1, INT32_MAX)
        if capacity is not None:
            capacity = int_arg(op, "capacity", capacity, 1, INT32_MAX)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        R = self.world_size
        if mode not in ("exact", "sync_free"):
            raise ValueError(f"ExpertParallel: mode: expected 'exact' or 'sync_free', got {mode!r}")
        if drop_policy not in ("position", "probs"):
            raise ValueError(f"ExpertParallel: drop_policy: expected 'position' or 'probs', got {drop_policy!r}")
        if mode == "exact" and capacity is not None:
            raise ValueError("ExpertParallel: capacity: only with mode='sync_free' (the exact mode drops nothing)")
        if mode == "sync_free" and capacity is None:
            raise ValueError(
                "ExpertParallel: capacity: mode='sync_free' needs a capacity of at least 1 row per "
                "(source rank, expert), got None"
            )
        if expert_ranks is None:
            if E % R:
                raise ValueError(
                    f"ExpertParallel: num_experts: {E} experts do not divide over {R} ranks "
                    "(pass expert_ranks= for an uneven placement)"
                )
            ranks = [e * R // E for e in range(E)]
        else:
            ranks = list(expert_ranks.tolist() if isinstance(expert_ranks, Tensor) else expert_ranks)
            if len(ranks) != E:
                raise ValueError(
                    f"ExpertParallel: expert_ranks: expected {E} entries (one per expert), got {len(ranks)}"
                )
            for e in range(E):
                q = ranks[e] = int_arg(op, f"expert_ranks: entry {e}", ranks[e])
                if not 0 <= q < R:
                    raise ValueError(f"ExpertParallel: expert_ranks: entry {e} is {q}, outside [0, {R})")
            held = set(ranks)
            for q in range(R):
                if q not in held:
                    raise ValueError(
                        f"ExpertParallel: expert_ranks: rank {q} holds no expert (every rank of the "
                        "group must hold at least one)"
                    )
        self.num_experts = E
        self.alignment = alignment
        self.mode = mode
        self.capacity = capacity
        self.drop_policy = drop_policy
        self.check = check
        self.expert_ranks = ranks
        # Send order: experts grouped by rank (ascending), by global id within a rank; the local
        # plan of each source rank sorts its assignments this way, so each destination's rows are
        # one contiguous chunk, its experts in order.
        order = sorted(range(E), key=lambda e: (ranks[e], e))
        self._experts_of = [[e for e in order if ranks[e] == q] for q in range(R)]
        self.local_experts = self._experts_of[self.rank]
        self.num_local_experts = len(self.local_experts)
        self._first = [0] * (R + 1)  # send-order id range of rank q: [_first[q], _first[q+1])
        for q in range(R):
            self._first[q + 1] = self._first[q] + len(self._experts_of[q])
        send_id = [0] * E
        for i, e in enumerate(order):
            send_id[e] = i
        self._send_id = None if send_id == list(range(E)) else send_id  # None: the identity
        self._maps = {}
        # The metadata's device (counts, configurations): the GPU for NCCL alone, else the CPU. The
        # rows: CUDA tensors with NCCL; CPU or CUDA tensors with gloo (gloo moves CUDA tensors
        # through host memory: for tests and machines without NCCL, not for speed); a mixed
        # backend ("cpu:gloo,cuda:nccl") takes each to its own.
        backend = str(dist.get_backend(group)).lower()
        nccl_only = "nccl" in backend and "gloo" not in backend and "cpu" not in backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl_only else torch.device("cpu")
        self._row_devices = ("cuda",) if nccl_only else ("cpu", "cuda")
        # Every rank must build the same configuration.
        conf = [
            E,
            self.alignment,
            0 if mode == "exact" else 1,
            -1 if capacity is None else int(capacity),
            0 if drop_policy == "position" else 1,
        ] + ranks
        mine = torch.tensor(conf, dtype=torch.int64, device=self.device)
        table = torch.empty((R, len(conf)), dtype=torch.int64, device=self.device)
        lengths = torch.empty(R, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(
            lengths, torch.tensor([len(conf)], dtype=torch.int64, device=self.device), group=group
        )
        if len(set(lengths.tolist())) != 1:
            raise ValueError(
                "ExpertParallel: num_experts: the ranks passed different numbers of experts "
                f"({lengths.tolist()} configuration entries by rank)"
            )
        dist.all_gather_into_tensor(table.view(-1), mine, group=group)
        rows = table.cpu().tolist()
        names = ("num_experts", "alignment", "mode", "capacity", "drop_policy")
        for q in range(R):
            if rows[q] != rows[0]:
                j = next(i for i in range(len(conf)) if rows[q][i] != rows[0][i])
                what = names[j] if j < len(names) else f"expert_ranks (entry {j - len(names)})"
                raise ValueError(
                    f"ExpertParallel: {what}: rank {q} passed {rows[q][j]}, rank 0 passed {rows[0][j]}; "
                    "every rank must construct ExpertParallel with the same arguments"
                )

    # -- helpers -------------------------------------------------------------------------------

    def _local_plan(self, top_experts: Tensor, weights: Optional[Tensor], check: bool) -> pt.Plan:
        E = self.num_experts
        kw = {}
        if self._send_id is not None:
            key = ("send_id", top_experts.device)
            if key not in self._maps:
                self._maps[key] = torch.tensor(self._send_id, dtype=torch.int32, device=top_experts.device)
            kw = dict(expert_map=self._maps[key], global_experts=E)
        if self.mode == "sync_free":
            kw.update(
                expert_capacity=self.capacity,
                drop_policy=self.drop_policy,
                probs=weights if self.drop_policy == "probs" else None,
            )
        return pt.make_plan(top_experts, E, 1, check=check, **kw)

    def _local_checks(self, op: str, x: Tensor, top_experts: Tensor, weights: Optional[Tensor], weighted: bool):
        if x.dim() != 2:
            raise ValueError(f"{op}: x: expected a 2-D [tokens, hidden] tensor, got shape {tuple(x.shape)}")
        if top_experts.dim() != 2:
            raise ValueError(
                f"{op}: top_experts: expected a 2-D [tokens, top_k] tensor, got shape {tuple(top_experts.shape)}"
            )
        if top_experts.shape[0] != x.shape[0]:
            raise ValueError(f"{op}: top_experts: has {top_experts.shape[0]} rows but x has {x.shape[0]} tokens")
        if top_experts.device != x.device:
            raise ValueError(f"{op}: top_experts: on {top_experts.device}, x on {x.device}")
        if x.device.type not in self._row_devices:
            raise ValueError(
                f"{op}: x: on {x.device}, but the process group's backend moves "
                f"{' or '.join(self._row_devices)} tensors"
            )
        if weights is not None and weights.numel() != top_experts.numel():
            raise ValueError(
                f"{op}: weights: expected {top_experts.numel()} entries (one per assignment, "
                f"[T, K] or [T*K]), got shape {tuple(weights.shape)}"
            )
        if weighted and weights is None:
            raise ValueError(f"{op}: weighted=True needs router weights")
        if self.mode == "sync_free" and self.drop_policy == "probs" and weights is None:
            raise ValueError(f"{op}: weights: drop_policy='probs' ranks assignments by their weights; got None")
        if x.dtype not in _DTYPE_CODE:
            raise TypeError(f"{op}: x: dtype {x.dtype} is not supported")

    def _meta(self, err, x, top_experts, weights, weighted) -> List[int]:
        if err is not None:
            return [1] + [0] * (len(_META_FIELDS) - 1)
        return [
            0,
            top_experts.shape[1],
            x.shape[1],
            _DTYPE_CODE[x.dtype],
            int(weighted),
            int(x.requires_grad),
            int(weights is not None and weights.requires_grad),
            int(weights is not None),
        ]

    def _agree(
        self, op: str, rows: List[List[int]], err: Optional[BaseException], fields: Sequence[str] = _META_FIELDS
    ) -> None:
        """The metadata every rank sent: raise the same way on every rank if any rank failed or
        disagrees."""
        if err is not None:
            raise err
        for q, row in enumerate(rows):
            if row[0]:
                raise ValueError(f"{op}: rank {q} rejected its input (its own error says why); nothing was exchanged")
        for q, row in enumerate(rows):
            for j in range(1, len(fields)):
                if row[j] != rows[0][j]:
                    raise ValueError(
                        f"{op}: {fields[j]}: rank {q} has {row[j]}, rank 0 has {rows[0][j]}; "
                        "every rank must pass the same (nothing was exchanged)"
                    )

    def _gather_agree(
        self, op: str, meta: List[int], err: Optional[BaseException], fields: Sequence[str] = _META_FIELDS
    ) -> None:
        """One small all_gather of every rank's metadata, read on the host, then :meth:`_agree`."""
        mine = torch.tensor(meta, dtype=torch.int64, device=self.device)
        table = torch.empty((self.world_size, mine.numel()), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(table.view(-1), mine, group=self.group)
        self._agree(op, table.cpu().tolist(), err, fields)

    def _map(self, name: str, device, build):
        key = (name, device)
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = build()
        return m

    # -- dispatch ------------------------------------------------------------------------------

    def dispatch(
        self, x: Tensor, top_experts: Tensor, weights: Optional[Tensor] = None, *, weighted: bool = False
    ) -> Tuple[Tensor, "EPRouting"]:
        """``x[T, H]`` rows and their router choices ``top_experts[T, K]`` (global expert ids,
        int32/int64) and ``weights`` (``[T, K]`` or ``[T*K]``, any float dtype; used by
        :meth:`EPRouting.combine`, or here with ``weighted=True`` for routers that weight before
        the experts) -> ``(y, routing)``: ``y[routing.rows, H]``, this rank's padded expert buffer
        (padding rows zero), and the :class:`EPRouting` that combines the experts' outputs."""
        op = "ExpertParallel.dispatch"
        check = _checking(self.check, x.device)
        err, plan = None, None
        try:
            self._local_checks(op, x, top_experts, weights, weighted)
            plan = self._local_plan(top_experts, weights, check)
        except (ValueError, TypeError, RuntimeError, IndexError) as e:
            if self.mode == "sync_free" and not check:
                raise
            err = e
        if self.mode == "exact":
            return self._dispatch_exact(op, x, top_experts, weights, weighted, plan, err, check)
        if check:
            self._gather_agree(op, self._meta(err, x, top_experts, weights, weighted), err)
        return self._dispatch_sync_free(x, weights, weighted, plan, check)

    def _dispatch_exact(self, op, x, top_experts, weights, weighted, plan, err, check):
        R, E, q0, q1 = self.world_size, self.num_experts, self._first[self.rank], self._first[self.rank + 1]
        meta = self._meta(err, x, top_experts, weights, weighted)
        counts = (
            torch.zeros(E, dtype=torch.int64, device=self.device)
            if err is not None
            else plan.tokens_per_expert.to(device=self.device, dtype=torch.int64)
        )
        mine = torch.cat([torch.tensor(meta, dtype=torch.int64, device=self.device), counts])
        table = torch.empty((R, mine.numel()), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(table.view(-1), mine, group=self.group)
        host = table.cpu()  # the one host read of the exact mode: the split sizes
        m = len(_META_FIELDS)
        self._agree(op, host[:, :m].tolist(), err)
        counts_all = host[:, m:]  # [R, E], send order
        send_splits = [int(counts_all[self.rank, self._first[q] : self._first[q + 1]].sum()) for q in range(R)]
        recv_splits = [int(counts_all[r, q0:q1].sum()) for r in range(R)]
        per_expert = counts_all[:, q0:q1].sum(0).tolist()
        rows = sum(_round_up(n, self.alignment) for n in per_expert)
        # Only make_plan checks (the caller's ids); the rest runs on arrays padmoe built.
        send = pt.dispatch(x, plan, weights if weighted else None, check=False)  # [T*K, H], send order
        received = _AllToAll.apply(send, recv_splits, send_splits, sum(recv_splits), self.group)
        split_sizes = table[:, m + q0 : m + q1].to(device=x.device, dtype=torch.int32).contiguous()  # [R, E_local]
        y, pmap, offsets = pt.sort_chunks(received, split_sizes, R, self.alignment, rows=rows, check=False)
        r = EPRouting(self, plan, weights, check)
        r.rows = rows
        r.offsets = offsets
        r.tokens_per_expert = split_sizes.sum(0, dtype=torch.int32)
        r.dropped = None
        r.send_splits, r.recv_splits = send_splits, recv_splits
        r._pmap, r._received = pmap, sum(recv_splits)
        return y, r

    def _dispatch_sync_free(self, x, weights, weighted, plan, check):
        R, C, El = self.world_size, self.capacity, self.num_local_experts
        S = _round_up(R * C, self.alignment)
        dev = x.device
        send = pt.dispatch(x, plan, weights if weighted else None, check=False)  # [E*C, H]: C rows per expert
        in_splits = [len(self._experts_of[q]) * C for q in range(R)]
        out_splits = [El * C] * R
        received = _AllToAll.apply(send, out_splits, in_splits, R * El * C, self.group)
        # The kept count of each (source rank, local expert): [R, El] on the device.
        cnt = torch.empty(R * El, dtype=torch.int32, device=dev)
        dist.all_to_all_single(
            cnt, plan.tokens_per_expert.contiguous(), [El] * R, [len(e) for e in self._experts_of], group=self.group
        )
        cnt = cnt.view(R, El).to(torch.int64)
        excl = cnt.cumsum(0) - cnt  # rows of earlier source ranks
        i = self._map("arange_c", dev, lambda: torch.arange(C, device=dev, dtype=torch.int64))
        base = self._map(("base", S), dev, lambda: torch.arange(El, device=dev, dtype=torch.int64) * S)
        # received row (r, e, i) -> expert-major row e*S + excl[r, e] + i when i < cnt[r, e]
        dest = torch.where(i.view(1, 1, C) < cnt.unsqueeze(2), (base.view(1, El) + excl).unsqueeze(2) + i, -1)
        dest = dest.reshape(-1).to(torch.int32)
        y = pt.unpad_from_alignment(received, dest, El * S, check=False)  # [El*S, H]
        total = cnt.sum(0)  # [El] real rows per local expert
        # the inverse map: expert-major row e*S + s <- received row (r, e, s - excl[r, e]), r the rank
        # whose rows cover s; -1 past the expert's real rows.
        s = self._map(("arange_s", S), dev, lambda: torch.arange(S, device=dev, dtype=torch.int64))
        incl = (excl + cnt).t().contiguous()  # [El, R], ascending
        src = torch.searchsorted(incl, s.unsqueeze(0).expand(El, S).contiguous(), right=True)  # [El, S]
        e_ix = self._map("arange_e", dev, lambda: torch.arange(El, device=dev, dtype=torch.int64)).view(El, 1)
        src_c = src.clamp(max=R - 1)
        start = torch.gather(excl.t(), 1, src_c)  # excl[src, e]
        inv = torch.where(s.unsqueeze(0) < total.view(El, 1), (src_c * El + e_ix) * C + s.unsqueeze(0) - start, -1)
        r = EPRouting(self, plan, weights, check)
        r.rows = El * S
        r.offsets = self._map(("offs", S), dev, lambda: (torch.arange(1, El + 1, device=dev) * S).to(torch.int32))
        r.tokens_per_expert = total.to(torch.int32)
        r.dropped = plan.dropped
        r.send_splits, r.recv_splits = in_splits, out_splits
        r._pmap, r._received = inv.reshape(-1).to(torch.int32), R * El * C
        return y, r


class EPRouting:
    """One expert-parallel routing step (from :meth:`ExpertParallel.dispatch`).

    - ``rows``: the expert buffer's row count (exact mode: the padded rows of the local
      experts, known on the host; sync-free: ``E_local * S``);
    - ``offsets``: int32 ``[E_local]`` inclusive segment ends (the ``offs`` of ``grouped_mm``);
    - ``tokens_per_expert``: int32 ``[E_local]`` real rows per local expert, on the device;
    - ``row_experts``: int32 ``[rows]`` local expert index of each row, -1 on padding rows;
    - ``dropped``: sync-free mode: int32 ``[1]`` on the device, this rank's assignments dropped
      past the capacity (None in the exact mode);
    - ``plan``: this rank's plan of its own assignments over the experts in send order;
    - ``send_splits`` / ``recv_splits``: rows sent to / received from each rank (host ints).
    """

    __slots__ = (
        "ep",
        "plan",
        "weights",
        "check",
        "rows",
        "offsets",
        "tokens_per_expert",
        "dropped",
        "send_splits",
        "recv_splits",
        "_pmap",
        "_received",
        "_row_experts",
    )

    def __init__(self, ep: ExpertParallel, plan, weights, check):
        self.ep, self.plan, self.weights, self.check = ep, plan, weights, check
        self._row_experts = None

    @property
    def row_experts(self) -> Tensor:
        if self._row_experts is None:
            offs = self.offsets
            rows = torch.arange(self.rows, device=offs.device, dtype=torch.int32)
            expert = torch.searchsorted(offs, rows, right=True, out_int32=True)  # < E_local: rows < offs[-1]
            start = torch.cat([offs.new_zeros(1), offs[:-1]])[expert.long()]
            self._row_experts = torch.where(rows - start < self.tokens_per_expert[expert.long()], expert, -1)
        return self._row_experts

    def combine(self, h: Tensor, weighted: bool = True) -> Tensor:
        """``h[rows, H']`` (the experts' outputs on this rank's buffer) -> ``out[T, H']`` on the
        tokens' own rank: ``out[t] = sum_k w(t, k) * h_k(t)`` (float32 accumulation in ascending
        k, as :func:`padmoe.torch.combine`; ``weighted=False``, or no weights given to dispatch: a
        plain sum). Differentiable wrt ``h`` and the router weights. Every rank calls it (a rank
        with no tokens too)."""
        ep = self.ep
        op = "EPRouting.combine"
        err = None
        try:
            if h.dim() != 2 or h.shape[0] != self.rows:
                raise ValueError(
                    f"{op}: h: expected [{self.rows}, hidden] (the dispatched buffer's rows), got "
                    f"shape {tuple(h.shape)}"
                )
            if h.dtype not in _DTYPE_CODE:
                raise TypeError(f"{op}: h: dtype {h.dtype} is not supported")
        except (ValueError, TypeError) as e:
            if not _checking(self.check, h.device):
                raise
            err = e
        if _checking(self.check, h.device):
            meta = (
                [1, 0, 0, 0, 0]
                if err is not None
                else [
                    0,
                    h.shape[1],
                    _DTYPE_CODE[h.dtype],
                    int(h.requires_grad),
                    int(weighted and self.weights is not None),
                ]
            )
            ep._gather_agree(op, meta, err, _COMBINE_FIELDS)
        # The maps and the plan were built (and the plan checked) by dispatch: nothing to check again.
        back = pt.unpad_from_alignment(h, self._pmap, self._received, check=False)
        y = _AllToAll.apply(back, self.send_splits, self.recv_splits, self.plan.padded_rows_bound, ep.group)
        return pt.combine(y, self.plan, self.weights if weighted else None, check=False)
