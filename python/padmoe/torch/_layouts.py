"""Block layouts for fused-MoE kernels: vLLM's / SGLang's moe_align_block_size and vLLM's batched form."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from padmoe._args import check_expert_map, int_arg, map_experts
from padmoe._plan import INT32_MAX, Plan, plan_offsets

from ._common import Tensor, compiling, eager_mode, host_check, ops


@torch.library.register_fake("padmoe::moe_align_block_size")
def _(topk_ids, block_size, num_experts, pad_sorted_ids=False, check=2, expert_map=None):
    a = topk_ids.numel()
    r = a + min(a, num_experts) * (block_size - 1)
    if pad_sorted_ids:
        r = -(-r // block_size) * block_size
    return (
        topk_ids.new_empty(r, dtype=torch.int32),
        topk_ids.new_empty(-(-r // block_size), dtype=torch.int32),
        topk_ids.new_empty(1, dtype=torch.int32),
    )


def moe_align_block_size(
    topk_ids: Tensor,
    block_size: int,
    num_experts: int,
    expert_map: Optional[Tensor] = None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
    *,
    check: Optional[bool] = None,
):
    """vLLM / SGLang ``moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
    pad_sorted_ids=False, ignore_invalid_experts=False)`` -> ``(sorted_token_ids, expert_ids,
    num_tokens_post_padded)``, int32 on ``topk_ids``' device, from one make_plan (no host
    synchronization with ``check=False``; static shapes under torch.compile).

    ``sorted_token_ids[R]``, ``R = T*K + min(T*K, E) * (block_size - 1)`` (rounded up to
    ``block_size`` with ``pad_sorted_ids``): each expert's flattened assignment ids ``t*K + k`` in
    ascending order (stable; vLLM's atomic kernel promises no order within an expert), padded to a
    multiple of ``block_size`` with the sentinel ``T*K``, then the sentinel to the end.
    ``expert_ids[ceil(R / block_size)]``: each block's expert, -1 for blocks at or past
    ``num_tokens_post_padded`` (as vLLM's kernel writes). ``expert_map`` (global -> local expert id,
    -1 not local): with ``ignore_invalid_experts=False`` applied to every entry of ``expert_ids``
    afterwards, as vLLM does (``expert_map[expert_ids]``: the blocks past P read the map's last
    entry); with ``True`` handed to the kernel, as vLLM's: the assignments of experts mapped to -1
    get no entry, the rest are grouped and ordered by local id, and ``expert_ids`` hold local ids.
    Either way the map must be ``[num_experts]`` int32/int64 (always checked) with entries in
    ``[-1, num_experts)`` (checked with the op's data: on CUDA in checked mode, one
    synchronization). As in vLLM, ids outside ``[0, num_experts)`` are skipped in every mode: their
    assignments get no entry and count towards no expert (``make_plan`` rejects them)."""
    compiling_now = compiling()
    if expert_map is not None and not isinstance(expert_map, Tensor):
        raise TypeError(f"moe_align_block_size: expert_map: expected a torch tensor, got {type(expert_map).__name__}")
    remap = expert_map is not None and not ignore_invalid_experts  # (the operator checks a map it is given)
    if remap:  # before the operator runs; entries as the op's data are (never under torch.compile)
        check_expert_map(
            "moe_align_block_size", expert_map, num_experts, not compiling_now and host_check(check, expert_map)
        )
    in_kernel = expert_map if ignore_invalid_experts else None
    sorted_ids, expert_ids, post = ops.moe_align_block_size.default(
        topk_ids, int(block_size), int(num_experts), bool(pad_sorted_ids), eager_mode(check), in_kernel
    )
    if remap:
        expert_ids = map_experts(expert_ids, expert_map)
    return sorted_ids, expert_ids, post


@torch.library.register_fake("padmoe::batched_moe_align_block_size")
def _(expert_num_tokens, max_tokens_per_batch, block_size, check=2):
    size = -(-max_tokens_per_batch // block_size) * block_size * expert_num_tokens.numel()
    return (
        expert_num_tokens.new_empty(size, dtype=torch.int32),
        expert_num_tokens.new_empty(size // block_size, dtype=torch.int32),
        expert_num_tokens.new_empty(1, dtype=torch.int32),
    )


@torch.library.register_fake("padmoe::mask_plan")
def _(routing_map, rows, alignment=1, one_bin=False, with_row_id_map=True, probs=None, probs_nonzero=False):
    t, e = routing_map.shape
    bins = 1 if one_bin else e
    cap = rows if one_bin else (-(-rows // e) if e else 0)
    packed = routing_map.new_empty(plan_offsets(t, e, bins, alignment, cap).size, dtype=torch.int32)
    shape = (t, 2 * e + 1) if with_row_id_map else (0, 0)
    moved = routing_map.new_empty(0, dtype=torch.float32) if probs is None else probs.new_empty(bins * cap)
    nonzero = routing_map.new_empty(t * e if probs_nonzero else 0, dtype=torch.float32)
    return packed, routing_map.new_empty(shape, dtype=torch.int32), moved, nonzero


@torch.library.register_fake("padmoe::index_plan")
def _(top_experts, rows):
    t, k = top_experts.shape
    return top_experts.new_empty(plan_offsets(t, k, 1, 1, rows).size, dtype=torch.int32)


def mask_plan(routing_map: Tensor, alignment: int = 1) -> Tuple[Plan, Tensor]:
    """The plan of a routing mask ``routing_map[T, E]`` (bool or integer, nonzero = routed:
    TransformerEngine's mask map) and TE's ``row_id_map[T, 2E+1]``, from one native operator (no
    data checks: every mask is valid; no host synchronization).

    The plan's assignments are the pairs ``a = t*E + e`` (``plan.top_k == E``), the unrouted ones
    dropped: it is the plan ``make_plan(torch.where(routing_map != 0, e, -1), E, alignment,
    drop_invalid=True)`` makes (rows expert-major, tokens in order within an expert, each expert
    padded to a multiple of ``alignment``), without sorting T*E ids. ``dispatch`` / ``combine``
    take it as any plan (weights ``[T, E]``). ``row_id_map[t]``: t's rows in descending expert
    order less the expert's padding offset (TE's unpadded rows), then those experts, -1 in the rest
    of both halves, and the count last."""
    op = "mask_plan"
    if not isinstance(routing_map, Tensor):
        raise TypeError(f"{op}: routing_map: expected a torch tensor, got {type(routing_map).__name__}")
    if routing_map.dim() != 2:
        raise ValueError(f"{op}: routing_map: expected [num_tokens, num_experts], got shape {list(routing_map.shape)}")
    m = int_arg(op, "alignment", alignment, 1, INT32_MAX)
    t, e = routing_map.shape
    rows = t * e + e * (m - 1)  # padded_rows_bound: the plan's row_sources, as make_plan sizes it
    if rows > INT32_MAX:
        raise ValueError(f"{op}: routing_map: size overflow: {t} x {e} pairs at alignment {m} do not fit int32")
    packed, row_id_map, _, _ = ops.mask_plan.default(routing_map, rows, m, False, True)
    return Plan._from_packed(packed, t, e, e, m), row_id_map


def index_plan(top_experts: Tensor, rows: Optional[int] = None) -> Plan:
    """The plan of expert ids with no known bound, ``top_experts[T, K]`` (int32, or int64 read by
    its low 32 bits: TransformerEngine's index map without a number of experts), from one native
    operator (no data checks: every id is valid; no host synchronization).

    The assignments ``a = t*K + k`` are stable-sorted by their id read as uint32 (a negative id
    after every non-negative one, -1 last) and row j holds the j-th; rows at or past ``rows``
    (default ``T*K``) are dropped. The plan is one expert of capacity ``rows`` (``plan.num_experts
    == 1``): ``dispatch`` / ``combine`` take it as any plan, the output has exactly ``rows`` rows.
    With ids in ``[0, E)`` and no cut it orders the rows as ``make_plan(top_experts, E, 1)`` does;
    ``make_plan`` (a counting sort) is the faster where E is known."""
    op = "index_plan"
    if not isinstance(top_experts, Tensor):
        raise TypeError(f"{op}: top_experts: expected a torch tensor, got {type(top_experts).__name__}")
    if top_experts.dim() != 2:
        raise ValueError(f"{op}: top_experts: expected [num_tokens, top_k], got shape {list(top_experts.shape)}")
    t, k = top_experts.shape
    r = t * k if rows is None else int_arg(op, "rows", rows, 0)
    if r > INT32_MAX:
        raise ValueError(f"{op}: rows: must be below 2^31, got {r}")
    return Plan._from_packed(ops.index_plan.default(top_experts, r), t, k, 1, 1, r)


def batched_moe_align_block_size(
    max_tokens_per_batch: int, block_size: int, expert_num_tokens: Tensor, *, check: Optional[bool] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    """vLLM's ``batched_moe_align_block_size(max_tokens_per_batch, block_size, expert_num_tokens)`` for
    the batched layout (expert e's tokens at rows ``e * max_tokens_per_batch + j``, ``j <
    expert_num_tokens[e]``) -> ``(sorted_ids, block_ids, num_tokens_post_pad)``, int32 on the counts'
    device, from one native operator (no host synchronization when unchecked: graph-capturable;
    static shapes under torch.compile).

    With ``N = ceil(max_tokens_per_batch / block_size) * block_size * E`` (``E =
    expert_num_tokens.numel()``): ``sorted_ids[N]`` holds each expert's row ids in order, its run
    padded to a multiple of ``block_size``, runs back to back, the sentinel ``E *
    max_tokens_per_batch`` elsewhere; ``block_ids[N / block_size]`` each block's expert, -1 past
    the runs; ``num_tokens_post_pad[1]`` the padded total (0 when ``E = 0``). Every count must be in
    ``[0, max_tokens_per_batch]`` (vLLM does not check): a ``ValueError`` names the first one outside,
    always on the CPU, on CUDA when checked (eager, as ``check=None`` reads it; one
    synchronization). Unchecked on CUDA, a count outside reads as clamped into that range."""
    op = "batched_moe_align_block_size"
    max_tokens = int_arg(op, "max_tokens_per_batch", max_tokens_per_batch, 0)
    block = int_arg(op, "block_size", block_size, 1)
    if not isinstance(expert_num_tokens, Tensor):
        raise TypeError(f"{op}: expert_num_tokens: expected a torch tensor, got {type(expert_num_tokens).__name__}")
    if expert_num_tokens.dim() != 1:
        raise ValueError(f"{op}: expert_num_tokens: expected a 1-D tensor, got shape {list(expert_num_tokens.shape)}")
    if expert_num_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"{op}: expert_num_tokens: expected int32 or int64, got "
            f"{str(expert_num_tokens.dtype).replace('torch.', '')}"
        )
    size = -(-max_tokens // block) * block * expert_num_tokens.numel()
    if size > INT32_MAX:
        raise ValueError(f"{op}: sorted_ids: size overflow: {size} entries do not fit the int32 outputs")
    # Where N > 0 both sizes are at most N; where N = 0 (no experts, or max_tokens_per_batch = 0)
    # neither changes a result, so a larger one goes to the operator as INT32_MAX.
    return ops.batched_moe_align_block_size.default(
        expert_num_tokens, min(max_tokens, INT32_MAX), min(block, INT32_MAX), eager_mode(check)
    )
