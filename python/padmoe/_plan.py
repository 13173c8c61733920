"""The routing plan as a Python object, and the packed form padmoe.torch's operators take."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple, Optional, Tuple

from . import _arrays as _arrays_module
from ._arrays import NUMPY, arrays_of

INT32_MAX = 2**31 - 1

PLAN_ARRAYS = (
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
    "row_sources",
)


def rows_bound(
    num_tokens: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> int:
    """Host-side bound on P, the rows of the padded buffers: ``T*K + E*(alignment-1)``, or ``E*C`` for a
    plan with an expert capacity C (then exactly P). Plain Python ints (no overflow, no checks)."""
    if expert_capacity is not None:
        return num_experts * expert_capacity
    return num_tokens * top_k + num_experts * (alignment - 1)


def packed_plan_layout(
    num_tokens: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> Tuple[Tuple[str, int, int], ...]:
    """The packed plan: the eight arrays back to back in one int32 tensor, as ``(name, offset,
    length)`` in order: ``indices``, ``bin_ids`` [A]; ``tokens_per_expert``, ``bins``,
    ``padded_tokens_per_expert``, ``padded_bins`` [E]; ``dest_rows`` [A]; ``row_sources``
    [:func:`rows_bound`]. The one Python definition (the C++ binding has the other, and a
    test checks that the two agree)."""
    a, e = num_tokens * top_k, num_experts
    rows = rows_bound(num_tokens, top_k, num_experts, alignment, expert_capacity)
    out, offset = [], 0
    for name, length in zip(PLAN_ARRAYS, (a, a, e, e, e, e, a, rows)):
        out.append((name, offset, length))
        offset += length
    return tuple(out)


class PackedPlanOffsets(NamedTuple):
    """Where each of the eight arrays lies in a packed plan: a ``slice`` per array (``packed[o.dest_rows]``
    is ``dest_rows``; ``.start`` / ``.stop`` are the offsets a kernel takes), from
    :func:`packed_plan_layout`."""

    indices: slice
    bin_ids: slice
    tokens_per_expert: slice
    bins: slice
    padded_tokens_per_expert: slice
    padded_bins: slice
    dest_rows: slice
    row_sources: slice

    @property
    def counts(self) -> slice:
        """The four [E] arrays together (``tokens_per_expert`` to ``padded_bins``)."""
        return slice(self.tokens_per_expert.start, self.padded_bins.stop)

    @property
    def rows(self) -> int:
        """The length of ``row_sources`` (:func:`rows_bound`)."""
        return self.row_sources.stop - self.row_sources.start

    @property
    def size(self) -> int:
        """The packed plan's length: ``3*A + 4*E + rows``."""
        return self.row_sources.stop


def plan_offsets(
    num_tokens: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> PackedPlanOffsets:
    """:func:`packed_plan_offsets` without its cache: for sizes that are not hashable (torch.compile's
    symbolic sizes) and for code torch.compile traces."""
    layout = packed_plan_layout(num_tokens, top_k, num_experts, alignment, expert_capacity)
    return PackedPlanOffsets._make([slice(offset, offset + length) for _, offset, length in layout])


@functools.lru_cache(maxsize=1024)
def packed_plan_offsets(
    num_tokens: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> PackedPlanOffsets:
    """:func:`packed_plan_layout` as a :class:`PackedPlanOffsets`, cached on the sizes (plain ints): the
    one helper the code that reads or writes a packed plan's arrays by offset uses."""
    return plan_offsets(num_tokens, top_k, num_experts, alignment, expert_capacity)


def packed_plan_sizes(
    numel: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> Tuple[int, int, int]:
    """``(T, A, rows)`` of a packed plan of ``numel`` entries: the inverse of
    :func:`packed_plan_layout`'s total ``3*A + 4*E + rows`` (what the fake kernels read)."""
    if expert_capacity is not None:
        a = (numel - num_experts * (4 + expert_capacity)) // 3
        return a // top_k, a, num_experts * expert_capacity
    a = (numel - num_experts * (alignment + 3)) // 4
    return a // top_k, a, a + num_experts * (alignment - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """``make_plan``'s routing options as one value (the C++ ``padmoe::PlanOptions``; docs/spec.md
    "Routing options"): pass it as ``make_plan(..., options=PlanOptions(...))`` or
    ``Routing.from_topk(..., options=...)`` instead of the keywords of the same names (one or the
    other, not both). The defaults route plainly. The values are checked where they are used, with
    the errors the keywords give.

    ``expert_map``
        ``[global_experts]`` int32/int64 array or tensor: global id -> local id, -1 = not local.
    ``first_expert``, ``global_experts``
        without a map, the local experts ``[first_expert, first_expert + num_experts)`` of
        ``global_experts`` (0: ``num_experts``).
    ``drop_invalid``
        drop ids outside ``[0, global_experts)`` instead of rejecting them.
    ``expert_capacity``
        C: every segment exactly C rows, each expert keeping C assignments by ``drop_policy``.
    ``drop_policy``
        ``"position"`` (the first C) or ``"probs"`` (the C largest ``probs``).
    ``probs``
        ``[T, K]`` router weights for ``"probs"`` (``Routing.from_topk``: its weights by default).
    """

    expert_map: Any = None
    first_expert: int = 0
    global_experts: int = 0
    drop_invalid: bool = False
    expert_capacity: Optional[int] = None
    drop_policy: str = "position"
    probs: Any = None

    @property
    def routed(self) -> bool:
        """Whether any option differs from its default (else ``make_plan`` makes the plain plan)."""
        return bool(
            self.expert_map is not None
            or self.first_expert
            or self.global_experts
            or self.drop_invalid
            or self.expert_capacity is not None
            or self.drop_policy != "position"
            or self.probs is not None
        )


def routing_options(
    op: str,
    options: Optional[PlanOptions],
    expert_map: Any = None,
    first_expert: int = 0,
    global_experts: int = 0,
    drop_invalid: bool = False,
    expert_capacity: Optional[int] = None,
    drop_policy: str = "position",
    probs: Any = None,
) -> Optional[PlanOptions]:
    """The routing options of a ``make_plan`` entry point as one value: ``options``, or the keywords
    (not both); None when every option is its default (the plain plan)."""
    keywords = (
        expert_map is not None
        or first_expert
        or global_experts
        or drop_invalid
        or expert_capacity is not None
        or drop_policy != "position"
        or probs is not None
    )
    if options is not None:
        if not isinstance(options, PlanOptions):
            raise TypeError(f"{op}: options: expected a padmoe.PlanOptions, got {type(options).__name__}")
        if keywords:
            raise ValueError(f"{op}: options: pass the routing options as options= or as keywords, not both")
        return options if options.routed else None
    if not keywords:
        return None
    return PlanOptions(
        expert_map=expert_map,
        first_expert=first_expert,
        global_experts=global_experts,
        drop_invalid=drop_invalid,
        expert_capacity=expert_capacity,
        drop_policy=drop_policy,
        probs=probs,
    )


PLAIN_ROUTING = PlanOptions()


def _array_field(i: int, name: str):
    def get(self):
        return self.arrays[i]

    def set(self, value):
        self.arrays[i] = value
        self.packed = None  # the packed copy no longer matches

    return property(get, set, doc=f"``{name}`` (``arrays[{i}]``)")


class Plan:
    """A routing plan: eight int32 arrays (numpy arrays or torch tensors, all
    on one device) and the sizes they were made for. The one plan type of the
    Python package: ``padmoe.make_plan``, ``padmoe.torch.make_plan`` and
    ``padmoe.reference.make_plan`` all return it.

    ``indices[A]``
        assignment ids ``a = t*K + k`` stable-sorted by expert.
    ``bin_ids[A]``
        the expert of ``indices[i]`` (nondecreasing).
    ``tokens_per_expert[E]``, ``bins[E]``
        counts and their inclusive cumulative sum (``bins[-1] == A``).
    ``padded_tokens_per_expert[E]``, ``padded_bins[E]``
        counts rounded up to ``alignment`` and their inclusive cumulative sum;
        ``padded_bins[-1]`` is P, the number of padded rows (grouped-GEMM offsets).
    ``dest_rows[A]``
        the padded row of each assignment.
    ``row_sources[padded_rows_bound]``
        the assignment stored in each padded row, -1 for padding rows and rows
        at or past P.

    A plan made with routing options (``padmoe.make_plan(..., expert_map=..., expert_capacity=...)``)
    may have dropped assignments: ``dest_rows`` -1, no sorted position (positions past ``bins[-1]``
    hold -1), counts and padding over kept assignments only. With ``expert_capacity`` C every
    segment is exactly C rows (P = ``padded_rows_bound`` = E*C) and ``dropped`` is a [1] int32 array on
    the plan's device: the number of assignments the capacity dropped (no synchronization).

    ``arrays`` is the list of the eight, in that order. A plan made by
    ``padmoe.torch`` also holds ``packed``: the eight back to back in one int32
    tensor (what padmoe's torch operators take; the arrays are views of it).
    Any object with these attributes can be passed where a plan is expected.
    """

    __slots__ = ("_arrays", "packed", "num_tokens", "top_k", "num_experts", "alignment", "expert_capacity", "dropped")
    _fields = PLAN_ARRAYS + ("num_tokens", "top_k", "num_experts", "alignment")

    def __init__(
        self,
        indices: Any,
        bin_ids: Any,
        tokens_per_expert: Any,
        bins: Any,
        padded_tokens_per_expert: Any,
        padded_bins: Any,
        dest_rows: Any,
        row_sources: Any,
        num_tokens: int,
        top_k: int,
        num_experts: int,
        alignment: int,
        expert_capacity: Optional[int] = None,
        dropped: Any = None,
    ):
        self._arrays = [
            indices,
            bin_ids,
            tokens_per_expert,
            bins,
            padded_tokens_per_expert,
            padded_bins,
            dest_rows,
            row_sources,
        ]
        self.packed = None
        self.num_tokens = num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.alignment = alignment
        self.expert_capacity = expert_capacity
        self.dropped = dropped

    @classmethod
    def _from_packed(
        cls,
        packed,
        num_tokens: int,
        top_k: int,
        num_experts: int,
        alignment: int,
        expert_capacity: Optional[int] = None,
        dropped: Any = None,
    ) -> "Plan":
        """A plan around padmoe.torch's packed form: one int32 tensor holding the eight arrays back to
        back (``indices, bin_ids`` [A], the four [E] arrays, ``dest_rows`` [A], ``row_sources``
        [padded_rows_bound]); the arrays are views of it, made on first use."""
        p = cls.__new__(cls)
        p._arrays = None
        p.packed = packed
        p.num_tokens = num_tokens
        p.top_k = top_k
        p.num_experts = num_experts
        p.alignment = alignment
        p.expert_capacity = expert_capacity
        p.dropped = dropped
        return p

    @property
    def arrays(self) -> list:
        """The eight arrays, in the order of the field list above."""
        if self._arrays is None:
            layout = packed_plan_layout(
                self.num_tokens, self.top_k, self.num_experts, self.alignment, self.expert_capacity
            )
            self._arrays = list(self.packed.split([length for _, _, length in layout]))
        return self._arrays

    indices = _array_field(0, "indices")
    bin_ids = _array_field(1, "bin_ids")
    tokens_per_expert = _array_field(2, "tokens_per_expert")
    bins = _array_field(3, "bins")
    padded_tokens_per_expert = _array_field(4, "padded_tokens_per_expert")
    padded_bins = _array_field(5, "padded_bins")
    dest_rows = _array_field(6, "dest_rows")
    row_sources = _array_field(7, "row_sources")

    @property
    def num_assignments(self) -> int:
        """A = num_tokens * top_k."""
        return self.num_tokens * self.top_k

    @property
    def padded_rows_bound(self) -> int:
        """Host-side bound on P: ``A + E*(alignment-1)`` (no synchronization); ``E*C`` for a plan
        made with ``expert_capacity`` C (then exactly P). The row count of every padded output
        of the plan ops (``dispatch``, ``make_plan_and_dispatch``, ``dispatch_quantized``)."""
        return rows_bound(
            self.num_tokens, self.top_k, self.num_experts, self.alignment, getattr(self, "expert_capacity", None)
        )

    @property
    def capacity(self) -> int:
        """Deprecated name of :attr:`padded_rows_bound` (removed in the next release)."""
        warnings.warn("Plan.capacity is deprecated: use Plan.padded_rows_bound", DeprecationWarning, stacklevel=2)
        return self.padded_rows_bound

    def padded_rows(self) -> int:
        """P = ``padded_bins[-1]`` read on the host (on CUDA: synchronizes the
        current stream)."""
        if self.num_experts == 0:
            return 0
        arrays = arrays_of(self.padded_bins, "Plan.padded_rows", "padded_bins")
        return arrays.item(self.padded_bins, -1)

    @classmethod
    def empty(cls, num_tokens: int, top_k: int, num_experts: int, alignment: int, like: Optional[Any] = None) -> "Plan":
        """Uninitialized plan buffers for ``make_plan(..., out=plan)``: allocate
        once, refill every step (e.g. inside a CUDA graph). The arrays are of
        ``like``'s framework and device (numpy on the CPU when ``like`` is None);
        ``row_sources`` has ``padded_rows_bound`` entries."""
        for name, value, least in (
            ("num_tokens", num_tokens, 0),
            ("top_k", top_k, 1),
            ("num_experts", num_experts, 1),
            ("alignment", alignment, 1),
        ):
            if int(value) < least:
                raise ValueError(f"Plan.empty: {name}: must be >= {least}, got {value}")
        return cls._allocate(num_tokens, top_k, num_experts, alignment, like)

    @classmethod
    def _allocate(cls, num_tokens, top_k, num_experts, alignment, like, expert_capacity=None) -> "Plan":
        # Sizes clamped at 0 so that make_plan's own checks report bad arguments.
        arrays = NUMPY if like is None else arrays_of(like, "Plan.empty", "like")
        num_tokens, top_k, num_experts, alignment = int(num_tokens), int(top_k), int(num_experts), int(alignment)
        a = max(num_tokens * top_k, 0)
        e = max(num_experts, 0)
        # padded_rows_bound's formula on the clamped sizes, in Python ints (no overflow, no error of its own)
        cap = max(a + e * (max(alignment, 1) - 1), 0)
        if expert_capacity is not None and int(expert_capacity) >= 0:
            cap = e * int(expert_capacity)
        # Sizes are checked before anything is allocated (the library would reject them after a
        # 32 GiB-32 TiB allocation had failed with MemoryError).
        if a > INT32_MAX:
            raise ValueError(
                f"make_plan: top_experts: size overflow: {num_tokens} x {top_k} assignments do not fit "
                "the int32 index outputs"
            )
        if cap > INT32_MAX:
            raise ValueError(f"make_plan: capacity: size overflow: {cap} does not fit the int32 index outputs")
        if e > INT32_MAX:
            raise ValueError(f"make_plan: num_experts: size overflow: {e} does not fit the int32 index outputs")

        def empty(n):
            return arrays.empty((n,), arrays.int32, like)

        return cls(
            indices=empty(a),
            bin_ids=empty(a),
            tokens_per_expert=empty(e),
            bins=empty(e),
            padded_tokens_per_expert=empty(e),
            padded_bins=empty(e),
            dest_rows=empty(a),
            row_sources=empty(cap),
            num_tokens=num_tokens,
            top_k=top_k,
            num_experts=num_experts,
            alignment=alignment,
            expert_capacity=None if expert_capacity is None or int(expert_capacity) < 0 else int(expert_capacity),
            dropped=None if expert_capacity is None or int(expert_capacity) < 0 else empty(1),
        )

    def __repr__(self) -> str:
        dev = getattr(self.indices, "device", "cpu")
        cap = getattr(self, "expert_capacity", None)
        return (
            f"Plan(num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"alignment={self.alignment}, padded_rows_bound={self.padded_rows_bound}, "
            + (f"expert_capacity={cap}, " if cap is not None else "")
            + f"arrays={type(self.indices).__module__.split('.')[0]}:{dev})"
        )


_arrays_module._plan_type = Plan  # native_args reads a Plan's eight arrays as one list
