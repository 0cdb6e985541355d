"""One cost model for the three ways to prepare a prompt's tail (docs/giveback.md): decode-local
prefill, remote prefill with give-back, remote prefill with recomputation.

It extends :class:`~deltakv.services.decode.cost_model.PrefillCostModel` (local or remote, and
every reason it gives) with prefill's **real** prefix. The remote estimate there assumes
prefill computes only the tokens beyond ``decode_prefix_len``; in fact prefill computes every
token beyond *its own* prefix, unless decode first gives it the pages it lacks. With
``prefill_prefix_len`` known (a prefix query to prefill, or what prefill reported for the
conversation's previous turn), for a prompt of ``prompt_len`` tokens, milliseconds:

* ``local = local_ms(prompt_len - decode_prefix_len, running)`` (unchanged);
* ``remote_recompute = hop + prefill(prompt_len - prefill_prefix_len) + transfer(delta)``;
* ``remote_giveback = giveback_hop + giveback_transfer(back) + hop
  + prefill(prompt_len - max(prefill_prefix_len, end)) + transfer(delta)``,

with the pages and tokens of :func:`deltakv.handoff.plan_handoff` (``back`` = pages decode
holds beyond prefill's prefix, ``delta`` = the forward delta, the same in both remote
choices). ``giveback_transfer`` is its own fit (bytes decode → prefill: the link may differ by
direction); until it is measured the forward link's current fit answers for it.
``giveback_hop`` is the give-back's fixed cost as decode saw it (the prefix query and grant, decode's own ``WritePages`` setup). The
cheapest wins, so recomputation is chosen where it is cheaper (a slow link, a fast prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deltakv.handoff import Handoff, plan_handoff
from deltakv.services.decode.cost_model import AffineFit, PrefillCostModel

GiveBackMode = Literal["off", "auto"]
GIVEBACK_MODES: tuple[GiveBackMode, ...] = ("off", "auto")


@dataclass(frozen=True)
class HandoffDecision:
    """``choice``: ``local``, ``remote_giveback`` or ``remote_recompute``; ``reason``: the
    local/remote reason of :class:`~deltakv.services.decode.cost_model.Decision`, or
    ``cheaper`` between the two remote choices, ``off`` (give-back disabled), ``nothing_to_give``
    (prefill holds as much as decode) or ``prefix_unknown`` (no prefill prefix to plan with);
    ``estimates_ms``: each choice's estimate; ``handoff``: the chosen choice's exact pages and
    tokens; ``remote``: the remote choice (the chosen one, or the one local was compared
    with); ``location_reason``: the local/remote reason alone (``Usage.prefill_decision``)."""

    choice: str
    reason: str
    estimates_ms: dict[str, float]
    handoff: Handoff
    remote: str = "remote_recompute"
    location_reason: str = "cheaper"


class HandoffCostModel:
    """The three estimates of the module docstring over ``costs``' measured fits.
    ``giveback``: ``off`` (never give back) or ``auto`` (when cheaper). Thread-safe as the
    fits are."""

    def __init__(self, costs: PrefillCostModel, giveback: GiveBackMode = "off", *,
                 alpha: float = 0.2) -> None:
        if giveback not in GIVEBACK_MODES:
            raise ValueError(f"give-back mode must be one of {', '.join(GIVEBACK_MODES)}, "
                             f"got {giveback!r}")
        self.costs = costs
        self.giveback = giveback
        fixed, slope = costs.transfer.coefficients()
        self.giveback_transfer = AffineFit(((0.0, fixed), (64e6, fixed + slope * 64e6)),
                                           alpha=alpha)
        hop = costs.hop.estimate(0)
        self.giveback_hop = AffineFit(((0.0, hop), (1.0, hop)), alpha=alpha)

    def estimates(self, prompt_len: int, decode_prefix_len: int, prefill_prefix_len: int,
                  page_size: int, page_bytes: int, running: int
                  ) -> tuple[dict[str, Handoff], dict[str, float]]:
        """Each choice's :class:`Handoff` and estimate (ms), keyed by choice. Raises
        InvalidArgument for a geometry :func:`plan_handoff` refuses."""
        plans: dict[str, Handoff] = {}
        ms: dict[str, float] = {}
        for choice in ("local", "remote_recompute", "remote_giveback"):
            h = plan_handoff(choice, prompt_len, decode_prefix_len, prefill_prefix_len,
                             page_size)
            plans[choice] = h
            if choice == "local":
                ms[choice] = self.costs.local_ms(prompt_len - decode_prefix_len, running)
                continue
            ms[choice] = self.costs.remote_ms(h.prefill_tokens, h.forward_bytes(page_bytes))
            if h.giveback_pages:
                ms[choice] += self.giveback_ms(h.giveback_bytes(page_bytes))
        return plans, ms

    def giveback_ms(self, giveback_bytes: int) -> float:
        """A give-back of ``giveback_bytes``: its fixed cost and its transfer (ms). Until one
        was measured, the forward link's *current* fits stand in for both (the same link the
        other way, and a call like the Prefill's hops): a decode that has only written forward
        over a slow link must not price the way back at the seeds' 10 GB/s."""
        transfer = self.giveback_transfer if self.giveback_transfer.samples \
            else self.costs.transfer
        hop = self.giveback_hop if self.giveback_hop.samples else self.costs.hop
        return hop.estimate(0) + transfer.estimate(giveback_bytes)

    def decide(self, prompt_len: int, decode_prefix_len: int, prefill_prefix_len: int | None,
               page_size: int, page_bytes: int, running: int, *, reuse_prefix: bool = True
               ) -> HandoffDecision:
        """The choice for one prompt. ``prefill_prefix_len`` None: unknown — planned as
        prefill holding ``decode_prefix_len`` (capped to what its index may supply), the old
        optimistic remote estimate, and never a give-back. The local/remote part follows
        :meth:`PrefillCostModel.decide` (modes, full hit, exploration, no reuse, no prefix);
        where that says ``cheaper``, local is compared with the cheaper remote choice."""
        known = prefill_prefix_len is not None
        if prefill_prefix_len is None:
            cap = max(prompt_len - 1, 0) // page_size * page_size
            prefill_prefix_len = min(decode_prefix_len, cap)
        plans, ms = self.estimates(prompt_len, decode_prefix_len, prefill_prefix_len,
                                   page_size, page_bytes, running)
        if self.giveback == "off":
            remote, why = "remote_recompute", "off"
        elif not known:
            remote, why = "remote_recompute", "prefix_unknown"
        elif not reuse_prefix:
            remote, why = "remote_recompute", "no_reuse"
        elif plans["remote_giveback"].giveback_pages == 0:
            remote, why = "remote_recompute", "nothing_to_give"
        elif ms["remote_giveback"] < ms["remote_recompute"]:
            remote, why = "remote_giveback", "cheaper"
        else:
            remote, why = "remote_recompute", "cheaper"
        base = self.costs.decide(prompt_len - decode_prefix_len,
                                 plans["remote_recompute"].forward_bytes(page_bytes), running,
                                 reuse_prefix=reuse_prefix, held_prefix=decode_prefix_len > 0)
        if base.reason == "cheaper":
            choice = "local" if ms["local"] < ms[remote] else remote
            reason = "cheaper" if choice == "local" else why
        elif base.location == "local":
            choice, reason = "local", base.reason
        else:
            # Forced or cold remote: which remote choice is still the cost model's.
            choice, reason = remote, why
        return HandoffDecision(choice, reason, ms, plans[choice], remote, base.reason)

    def record_giveback(self, giveback_bytes: int, write_ms: float, call_ms: float) -> None:
        """A give-back moved ``giveback_bytes`` in ``write_ms`` (decode's WritePages);
        ``call_ms`` its whole cost as decode saw it (prefix query and grant included)."""
        if giveback_bytes > 0:
            if not self.giveback_transfer.samples:  # from the forward line, as estimated so far
                fixed, slope = self.costs.transfer.coefficients()
                self.giveback_transfer.reseed(((0.0, fixed), (64e6, fixed + slope * 64e6)))
            self.giveback_transfer.add(giveback_bytes, write_ms)
        self.giveback_hop.add(0.0, max(call_ms - write_ms, 0.0))
