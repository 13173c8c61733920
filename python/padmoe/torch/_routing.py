"""Routing: a plan plus the router's weights, the object most PyTorch users hold."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from padmoe._plan import Plan, PlanOptions, routing_options

from ._common import Tensor, call
from ._plan_ops import combine, dispatch, routed_plan


class Routing:
    """A routing step: the plan of a top-k router's choices plus its weights.

    ``Routing.from_topk(top_experts[T, K], weights[T, K] (or [T*K], any float dtype) or None,
    num_experts, alignment)`` builds the plan (weights are checked here, before any GEMM);

    - ``.dispatch(x)`` -> ``[padded_rows_bound, H]`` expert-grouped padded buffer (tail rows zero);
      ``.dispatch(x, weighted=True)`` scales each copy by its router weight (for routers that
      weight before the experts; then combine with ``weighted=False``);
    - ``.combine(y)`` -> ``[T, H]`` weighted by the router weights (``weighted=False``: plain sum);
    - ``.offsets`` = ``padded_bins`` (int32, the ``offs`` of ``grouped_mm``),
      ``.tokens_per_expert``, ``.num_experts``, ``.top_k``, ``.num_tokens``, ``.padded_rows_bound``,
      ``.padded_rows`` (P as a 0-d device tensor, no synchronization), ``.row_experts``
      (``[padded_rows_bound]`` int32 expert of each padded row, -1 on padding rows and past P:
      DeepGEMM's contiguous grouped layout; per-expert biases).

    Differentiable wrt x, y and the weights. Static shapes: compile- and capture-friendly.
    """

    __slots__ = ("plan", "weights", "check", "_row_experts")

    def __init__(self, plan: Plan, weights: Optional[Tensor] = None, check: Optional[bool] = None):
        self.plan = plan
        self.weights = weights
        self.check = check
        self._row_experts = None

    @classmethod
    def from_topk(
        cls,
        top_experts: Tensor,
        weights: Optional[Tensor],
        num_experts: int,
        alignment: int,
        *,
        check: Optional[bool] = None,
        expert_map: Optional[Tensor] = None,
        first_expert: int = 0,
        global_experts: int = 0,
        drop_invalid: bool = False,
        expert_capacity: Optional[int] = None,
        drop_policy: str = "position",
        options: Optional[PlanOptions] = None,
    ) -> "Routing":
        """The routing options are :func:`make_plan`'s, as keywords or as one :class:`padmoe.PlanOptions`
        (``options=``, not both); ``drop_policy="probs"`` ranks by ``weights`` (or by the options'
        ``probs`` when given). Dropped assignments (other ranks' experts, invalid ids, past the
        capacity) get no row, contribute zero to ``combine`` and get a zero weight gradient."""
        routed = None
        if (
            options is not None
            or expert_map is not None
            or first_expert
            or global_experts
            or drop_invalid
            or expert_capacity is not None
            or drop_policy != "position"
        ):
            routed = routing_options(
                "Routing.from_topk",
                options,
                expert_map,
                first_expert,
                global_experts,
                drop_invalid,
                expert_capacity,
                drop_policy,
            )
        if routed is not None:
            plan = routed_plan(top_experts, weights, num_experts, alignment, check, routed)
        else:  # the plain plan with the weights checked, the operator called inline (the hot path)
            op, default = call("make_plan")
            p = op(top_experts, num_experts, alignment, default if check is None else int(bool(check)), weights)
            t, k = top_experts.shape
            plan = Plan._from_packed(p, t, k, num_experts, alignment)
        r = cls.__new__(cls)
        r.plan = plan
        r.weights = weights
        r.check = check
        r._row_experts = None
        return r

    @property
    def offsets(self) -> Tensor:
        return self.plan.padded_bins

    @property
    def tokens_per_expert(self) -> Tensor:
        return self.plan.tokens_per_expert

    @property
    def num_experts(self) -> int:
        return self.plan.num_experts

    @property
    def top_k(self) -> int:
        return self.plan.top_k

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def padded_rows_bound(self) -> int:
        """Rows of the padded buffers (``plan.padded_rows_bound``), known on the host."""
        return self.plan.padded_rows_bound

    @property
    def capacity(self) -> int:
        """Deprecated name of :attr:`padded_rows_bound` (removed in the next release)."""
        warnings.warn("Routing.capacity is deprecated: use Routing.padded_rows_bound", DeprecationWarning, stacklevel=2)
        return self.plan.padded_rows_bound

    @property
    def padded_rows(self) -> Tensor:
        """P = ``padded_bins[-1]`` as a 0-d int32 tensor on the plan's device (no synchronization)."""
        return self.plan.padded_bins[-1]

    @property
    def row_experts(self) -> Tensor:
        """``[padded_rows_bound]`` int32: the expert of each padded row, -1 on padding rows and rows at
        or past P (computed once per Routing, on the device, without synchronization)."""
        if self._row_experts is None:
            p = self.plan
            rows = torch.arange(p.padded_rows_bound, device=p.padded_bins.device, dtype=torch.int32)
            expert = torch.searchsorted(p.padded_bins, rows, right=True, out_int32=True)
            self._row_experts = torch.where(p.row_sources >= 0, expert, -1)
        return self._row_experts

    def dispatch(self, x: Tensor, weighted: bool = False, zero_padding: bool = True) -> Tensor:
        """``zero_padding=False`` leaves the padding rows (and the rows past P) unwritten: for a
        consumer that never reads them (DeepGEMM with ``row_experts``, a masked grouped GEMM) in an
        inference forward; never when an expert weight gradient reduces over every row."""
        if weighted and self.weights is None:
            raise ValueError("Routing.dispatch: weighted=True needs router weights (from_topk got None)")
        return dispatch(x, self.plan, self.weights if weighted else None, check=self.check, zero_padding=zero_padding)

    def combine(self, y: Tensor, weighted: bool = True) -> Tensor:
        return combine(y, self.plan, self.weights if weighted else None, check=self.check)
