"""Where to compute a prompt's uncached tail: in decode (local) or in prefill (remote).

A decode that holds all but a short tail of the prompt in its radix index can compute the
tail itself with its own model runner: no Prefill hop, no grant, no transfer. Whether that is
cheaper depends on the machines and the link, so the decision is a cost model fed by
measurements, not a static threshold. (Dynamo's conditional disaggregation decides with static
settings — a maximum local prefill length and a prefill-queue bound,
https://docs.nvidia.com/dynamo/archive/0.2.0/architecture/disagg_serving.html; here the same
question is answered from the service's own recent timings.)

Estimates, milliseconds, for a prompt whose uncached tail is ``tail`` tokens and whose delta
pages are ``delta_bytes`` bytes:

* ``remote_ms = hop_ms + prefill(tail) + transfer(delta_bytes)`` — ``prefill(n)`` is prefill's
  forward time for ``n`` tokens (from ``PrefillResponse.prefill_ms`` and the tokens it
  computed), ``transfer(b)`` the delta write (``transfer_ms`` against ``stats.bytes``: its
  fixed setup + bytes / link rate), ``hop_ms`` the rest of the Prefill call as decode saw it
  (grant, RPC, prefill's admission, CloseGrant). Prefill is assumed to compute only the tail:
  an optimistic remote estimate, so local is chosen only when it beats remote's best case.
* ``local_ms = extend(tail) * (1 + stall_weight * running)`` — ``extend(n)`` is decode's own
  extend for ``n`` tokens, measured from submission to the decode step thread until done (so
  it includes waiting behind the running batch's step); the running requests each stall for
  about one extend, which ``stall_weight`` (default 1: every request's delay counts the same)
  charges to the local choice. Until decode measured one, ``extend(n)`` is prefill's fit
  times ``local_seed_factor`` (1.5): the same model, on hardware assumed no faster — so the
  first short tail after a measured remote call already goes local when hops and transfer
  dominate, and is measured from then on. That seed can keep ``auto`` remote for good when
  prefill's fit is poor for short tails (one long cold prompt puts the whole time into the
  fixed part), and remote is never measured against local if local is never tried: so the
  first short tail behind a held prefix (at most ``explore_tokens``) is computed locally once
  (reason ``explore``) to measure decode's own extend — the bounded exploration step of an
  estimate-driven choice, costing at most one short extend (``explore_tokens=0``: never).

Each timing is an :class:`AffineFit` — ``y = fixed + x / rate`` fitted by exponentially
weighted least squares over recent samples, so both the per-call floor and the throughput are
measured (a tokens/s EWMA alone would miss the forward's fixed cost). Until measured, each fit
answers from conservative seeds (:class:`Seeds`; local slow, remote fast), held as a small
constant-weight prior that also keeps the fit defined when every sample has the same ``x``.

A full hit (``tail == 0``: the whole prompt is cached) is always local in ``auto`` and
``always`` modes: one forward of the last position over the cache beats any remote call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

Mode = Literal["auto", "never", "always"]
MODES: tuple[Mode, ...] = ("auto", "never", "always")


class AffineFit:
    """``y ≈ fixed + slope * x`` over recent samples (exponentially weighted least squares).

    ``alpha``: weight of the newest sample relative to the decayed history (0 < alpha <= 1;
    the history's effective length is about ``1 / alpha`` samples). ``prior``: two seed
    points ``(x, y)`` with constant weight ``prior_weight`` each — the answer before any
    sample. Once measured, only the one with the lower ``x`` (the seeded fixed cost) stays, as
    a ridge that keeps the fit defined when all samples share one ``x``: one measurement then
    scales the line through it (``y / x`` from the fixed cost), where the second seed point,
    far away and much faster, would flatten its slope to nothing (a prefill of 512 tokens
    estimated as cheap as the 128 measured). Estimates are clamped to ``fixed >= 0`` and
    ``slope >= 0``. Thread-safe.
    """

    def __init__(self, prior: tuple[tuple[float, float], tuple[float, float]], *,
                 alpha: float = 0.2, prior_weight: float = 0.01) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        (x1, _), (x2, _) = prior
        if x1 == x2:
            raise ValueError("the two prior points need different x")
        self.alpha = alpha
        self._prior = [(float(x), float(y), prior_weight) for x, y in prior]
        self._sums = [0.0] * 5  # w, wx, wy, wxx, wxy of the samples, decayed
        self.samples = 0
        self._lock = threading.Lock()

    def reseed(self, prior: tuple[tuple[float, float], tuple[float, float]]) -> None:
        """Replace the two prior points (same weight); the samples stay."""
        with self._lock:
            self._prior = [(float(x), float(y), w) for (x, y), (_, _, w)
                           in zip(prior, self._prior, strict=True)]

    def add(self, x: float, y: float) -> None:
        """One measurement: ``y`` (ms) for ``x`` (tokens or bytes). Negative values are
        ignored (they cannot be measurements)."""
        if x < 0 or y < 0:
            return
        keep = 1.0 - self.alpha
        with self._lock:
            w, wx, wy, wxx, wxy = (s * keep for s in self._sums)
            self._sums = [w + 1.0, wx + x, wy + y, wxx + x * x, wxy + x * y]
            self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """``(fixed, slope)`` of the current fit (clamped to >= 0)."""
        with self._lock:
            w, wx, wy, wxx, wxy = self._sums
            prior = self._prior if self.samples == 0 else [min(self._prior)]
        for px, py, pw in prior:
            w, wx, wy, wxx, wxy = w + pw, wx + pw * px, wy + pw * py, \
                wxx + pw * px * px, wxy + pw * px * py
        mean_x, mean_y = wx / w, wy / w
        var = wxx / w - mean_x * mean_x
        cov = wxy / w - mean_x * mean_y
        slope = max(cov / var, 0.0) if var > 0 else 0.0
        fixed = mean_y - slope * mean_x
        if fixed < 0:  # keep the line through the weighted mean, with no negative floor
            fixed, slope = 0.0, (mean_y / mean_x if mean_x > 0 else slope)
        return fixed, slope

    def estimate(self, x: float) -> float:
        """Predicted ``y`` for ``x`` (>= 0)."""
        fixed, slope = self.coefficients()
        return fixed + slope * max(x, 0.0)


@dataclass(frozen=True)
class Seeds:
    """Conservative defaults until measured (they favour remote, the disaggregated default):
    prefill fast (20 ms floor, 20k tokens/s), the link fast (1 ms setup, 10 GB/s), 5 ms of
    hops; decode's extend is seeded from prefill's fit (``local_seed_factor``). Measurements
    take over within a few requests (``alpha``)."""

    prefill_fixed_ms: float = 20.0
    prefill_tokens_per_s: float = 20_000.0
    transfer_fixed_ms: float = 1.0
    link_gb_per_s: float = 10.0
    hop_ms: float = 5.0


def _seeded(fixed_ms: float, per_s: float, x2: float, alpha: float) -> AffineFit:
    return AffineFit(((0.0, fixed_ms), (x2, fixed_ms + x2 / per_s * 1000.0)), alpha=alpha)


@dataclass(frozen=True)
class Decision:
    """One request's choice: ``location`` ``"local"`` or ``"remote"``; ``reason`` one of
    ``full_hit``, ``cheaper``, ``explore`` (the first short local extend, to measure it),
    ``mode`` (forced by ``--local-prefill``), ``no_reuse`` (the
    request disabled decode-prefix reuse: the full-transfer baseline), ``no_prefix`` (decode
    holds nothing of the prompt); the two estimates (ms) and the inputs they were computed
    for."""

    location: Literal["local", "remote"]
    reason: str
    local_ms: float
    remote_ms: float
    tail_tokens: int
    running: int


class PrefillCostModel:
    """The two estimates of the module docstring, and the choice between them.

    ``mode``: ``auto`` (cheaper wins; a full hit is local), ``never`` (always remote),
    ``always`` (always local). ``stall_weight``: how much one running request's delay counts
    against the local choice (>= 0). Measurements come from the servicer:
    :meth:`record_local` after each local extend, :meth:`record_remote` after each Prefill.
    """

    def __init__(self, mode: Mode = "auto", *, seeds: Seeds = Seeds(), alpha: float = 0.2,
                 stall_weight: float = 1.0, local_seed_factor: float = 1.5,
                 explore_tokens: int = 256) -> None:
        if mode not in MODES:
            raise ValueError(f"local prefill mode must be one of {', '.join(MODES)}, got {mode!r}")
        if stall_weight < 0:
            raise ValueError(f"stall_weight must be >= 0, got {stall_weight}")
        if local_seed_factor <= 0:
            raise ValueError(f"local_seed_factor must be > 0, got {local_seed_factor}")
        if explore_tokens < 0:
            raise ValueError(f"explore_tokens must be >= 0, got {explore_tokens}")
        self.mode = mode
        self.explore_tokens = explore_tokens
        self._explored = False
        self._explore_lock = threading.Lock()
        self.stall_weight = stall_weight
        self.local_seed_factor = local_seed_factor
        self.local = _seeded(seeds.prefill_fixed_ms * local_seed_factor,
                             seeds.prefill_tokens_per_s / local_seed_factor, 1024, alpha)
        self.prefill = _seeded(seeds.prefill_fixed_ms, seeds.prefill_tokens_per_s, 1024, alpha)
        # x in bytes: 1e9 bytes/s = 1e6 bytes/ms.
        self.transfer = _seeded(seeds.transfer_fixed_ms, seeds.link_gb_per_s * 1e9, 64e6, alpha)
        self.hop = AffineFit(((0.0, seeds.hop_ms), (1.0, seeds.hop_ms)), alpha=alpha)

    def local_ms(self, tail_tokens: int, running: int) -> float:
        """Decode's own extend of ``tail_tokens`` (at least the one recomputed position),
        with the running batch's stall. Before decode measured an extend: prefill's fit
        (measured, else seeded) times ``local_seed_factor`` — the same model on a machine
        assumed no faster, with a margin."""
        tokens = max(tail_tokens, 1)
        if self.local.samples:
            extend = self.local.estimate(tokens)
        else:
            extend = self.prefill.estimate(tokens) * self.local_seed_factor
        return extend * (1.0 + self.stall_weight * max(running, 0))

    def remote_ms(self, tail_tokens: int, delta_bytes: int) -> float:
        return (self.hop.estimate(0) + self.prefill.estimate(tail_tokens)
                + self.transfer.estimate(delta_bytes))

    def decide(self, tail_tokens: int, delta_bytes: int, running: int, *,
               reuse_prefix: bool = True, held_prefix: bool = True) -> Decision:
        """Local or remote for a prompt with ``tail_tokens`` uncached tokens (>= 0),
        ``delta_bytes`` of delta pages and ``running`` requests in decode's batch.
        ``held_prefix``: decode's index holds a prefix of the prompt (``auto`` computes
        locally only a tail behind a held prefix; a cold prompt is prefill's)."""
        local = self.local_ms(tail_tokens, running)
        remote = self.remote_ms(tail_tokens, delta_bytes)

        def choose(location: Literal["local", "remote"], reason: str) -> Decision:
            return Decision(location, reason, local, remote, tail_tokens, running)

        if self.mode == "never":
            return choose("remote", "mode")
        if not reuse_prefix:  # the full-transfer baseline stays remote (bench --compare)
            return choose("remote", "no_reuse")
        if self.mode == "always":
            return choose("local", "mode")
        if tail_tokens == 0:
            return choose("local", "full_hit")
        if not held_prefix:  # nothing cached here: prefill's job (disaggregation's default)
            return choose("remote", "no_prefix")
        if self._explore(tail_tokens):
            return choose("local", "explore")
        return choose("local" if local < remote else "remote", "cheaper")

    def _explore(self, tail_tokens: int) -> bool:
        # Once per model, and only while decode has no extend of its own measured.
        if self.local.samples or tail_tokens > self.explore_tokens:
            return False
        with self._explore_lock:
            if self._explored:
                return False
            self._explored = True
            return True

    def record_local(self, tail_tokens: int, extend_ms: float) -> None:
        """A local extend of ``tail_tokens`` (a full hit: 0, one position recomputed) took
        ``extend_ms`` (submission to done). The first one replaces the local seeds by
        prefill's current fit times ``local_seed_factor``, the estimate used so far, so one
        sample moves the fit from what decided, not from the static seeds."""
        if self.local.samples == 0:
            self.local.reseed(tuple((x, self.prefill.estimate(x) * self.local_seed_factor)
                                    for x in (1.0, 1024.0)))
        self.local.add(max(tail_tokens, 1), extend_ms)

    def record_remote(self, computed_tokens: int, prefill_ms: float, transfer_bytes: int,
                      transfer_ms: float, call_ms: float) -> None:
        """A Prefill call: prefill computed ``computed_tokens`` in ``prefill_ms``, wrote
        ``transfer_bytes`` in ``transfer_ms``; decode waited ``call_ms`` in all."""
        self.prefill.add(computed_tokens, prefill_ms)
        if transfer_bytes > 0:
            self.transfer.add(transfer_bytes, transfer_ms)
        self.hop.add(0.0, max(call_ms - prefill_ms - transfer_ms, 0.0))

    def snapshot(self) -> dict[str, float]:
        """Current fits in the units people read: ms floors, tokens/s, GB/s."""
        local_fixed, local_slope = self.local.coefficients()
        pre_fixed, pre_slope = self.prefill.coefficients()
        tr_fixed, tr_slope = self.transfer.coefficients()
        return {"local_fixed_ms": local_fixed,
                "local_tokens_per_s": 1000.0 / local_slope if local_slope else float("inf"),
                "prefill_fixed_ms": pre_fixed,
                "prefill_tokens_per_s": 1000.0 / pre_slope if pre_slope else float("inf"),
                "transfer_fixed_ms": tr_fixed,
                "link_gb_per_s": 1e-6 / tr_slope if tr_slope else float("inf"),
                "hop_ms": self.hop.estimate(0)}
