"""Admission control for Poisson arrivals: the estimators and the queueing model of docs/ADMISSION.md.

Two halves, in two processes:
  * each engine replica measures itself with a `ServiceMeter` (servers c from its KV capacity, time in
    service S by Little's law, prefill time) and reports a `ReplicaLoad` with every finished request;
  * the ingress owns an `AdmissionController`: it estimates the arrival rate (`ArrivalRateEstimator`),
    counts its admitted requests in flight, and admits a request only while the predicted TTFT
    (M/M/c: the wait for a free server + prefill) stays under the target.
Everything here is plain Python (no Ray) so it is unit-tested directly.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from diffkv_serve.service.config import AdmissionConfig


# ---- queueing formulas ------------------------------------------------------------------------------------
def erlang_c(servers: int, offered_load: float) -> float:
    """P(an arrival waits) in an M/M/c queue with c servers and offered load a = lambda/mu (a < c).
    Erlang B by its stable recursion B(k) = a B(k-1) / (k + a B(k-1)), then C = B / (1 - rho (1 - B))."""
    if servers < 1:
        raise ValueError(f"servers={servers} must be >= 1")
    a = offered_load
    if a <= 0:
        return 0.0
    if a >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = a * b / (k + a * b)
    rho = a / servers
    return b / (1.0 - rho * (1.0 - b))


def mmc_mean_wait(arrival_rate: float, servers: int, service_rate: float) -> float:
    """Stationary mean queueing delay E[Wq] = C(c, a) / (c mu - lambda) of M/M/c; inf when rho >= 1."""
    if arrival_rate <= 0:
        return 0.0
    if arrival_rate >= servers * service_rate:
        return math.inf
    return erlang_c(servers, arrival_rate / service_rate) / (servers * service_rate - arrival_rate)


def max_sustainable_rate(servers: int, service_rate: float, max_wait: float, iters: int = 60) -> float:
    """Largest arrival rate whose stationary E[Wq] stays <= max_wait (bisection; E[Wq] rises with lambda)."""
    if max_wait <= 0:
        return 0.0
    lo, hi = 0.0, servers * service_rate
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mmc_mean_wait(mid, servers, service_rate) <= max_wait:
            lo = mid
        else:
            hi = mid
    return lo


def conditional_wait(in_system: float, servers: float, total_service_rate: float) -> float:
    """Expected wait of an arrival that finds `in_system` requests (FCFS, memoryless service): it starts when
    in_system - servers + 1 of them have left, and while all servers are busy they leave at rate c mu."""
    ahead = in_system - servers + 1
    if ahead <= 0:
        return 0.0
    return ahead / total_service_rate


# ---- estimators ---------------------------------------------------------------------------------------------
class ArrivalRateEstimator:
    """Rate of a Poisson process from its arrival times, exponentially weighted with time constant tau.

    S(t) = sum over arrivals of exp(-(t - t_i) / tau). For rate lambda, E[S(t)] = lambda tau (1 - exp(-T / tau))
    after observing for T, so lambda_hat = S / (tau (1 - exp(-T / tau))) is unbiased from the first arrival on.
    """

    def __init__(self, tau: float, clock: Callable[[], float] = time.monotonic):
        self.tau = tau
        self.clock = clock
        self._start = clock()
        self._sum = 0.0
        self._last = self._start

    def _decay_to(self, now: float) -> None:
        if now > self._last:
            self._sum *= math.exp(-(now - self._last) / self.tau)
            self._last = now

    def observe(self, now: Optional[float] = None) -> None:
        now = self.clock() if now is None else now
        self._decay_to(now)
        self._sum += 1.0

    def rate(self, now: Optional[float] = None) -> float:
        now = self.clock() if now is None else now
        self._decay_to(now)
        span = max(now - self._start, 1e-9)
        return self._sum / (self.tau * (1.0 - math.exp(-span / self.tau)))


class _Ewma:
    def __init__(self, weight: float):
        self.weight = weight
        self.value: Optional[float] = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


@dataclass
class ReplicaLoad:
    """What an engine replica reports about its capacity (sent to the ingress with each finished request)."""

    replica: str
    servers: float  # c: requests it serves at once = min(max_num_seqs, pages_total / pages per request)
    service_s: Optional[float]  # S: mean time a request spends in the running batch (None until measured)
    prefill_s: Optional[float]  # time to first token of a request that found a free server
    pages_total: int = 0
    pages_per_request: Optional[float] = None
    max_num_seqs: int = 0
    saturated_rate: Optional[float] = None  # completions/s measured while requests were left waiting

    @property
    def service_rate(self) -> Optional[float]:
        """c * mu: requests per second this replica completes when all its servers are busy. Measured while it
        was saturated if it has been; until then extrapolated as c / S."""
        if self.saturated_rate:
            return self.saturated_rate
        return None if not self.service_s else self.servers / self.service_s


class ServiceMeter:
    """An engine replica measuring itself (thread-safe: the step thread and the event loop both feed it).

    * servers c: how many requests the engine runs at once when requests are left waiting after a step (it
      could not admit more: slots or KV pages, including the worst-case reservation for prompts); until
      that happens, min(max_num_seqs, pages_total / pages per request). KV capacity, which compression
      changes, is what bounds it;
    * time in service S = L / X (Little's law on the running batch): L the time-averaged number running, X the
      completion rate, both exponentially weighted with the same time constant, so their ratio is the mean
      time a request holds a batch slot at the current load;
    * the service rate c mu: completions per second while the engine was saturated (throughput measured
      under a queue, so it includes everything a full batch costs: prefill interruptions, preemptions);
      before any saturation, c / S;
    * prefill_s: EWMA of TTFT over requests that found a free slot (no queueing in the engine).
    """

    def __init__(self, tau: float, max_num_seqs: int, clock: Callable[[], float] = time.monotonic):
        self.tau = tau
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._running = 0
        self._area = 0.0  # decayed integral of the number running
        self._done = 0.0  # decayed count of completions
        self._pages = _Ewma(0.1)
        self._saturated = _Ewma(0.05)  # requests running after steps that left some waiting
        self._sat_time = 0.0  # decayed seconds of steps that left requests waiting
        self._sat_done = 0.0  # decayed completions in those steps
        self._prefill = _Ewma(0.2)
        self.pages_total = 0

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        d = math.exp(-dt / self.tau)
        # integral of n * exp(-(now - u) / tau) over the interval, n constant since _last
        self._area = self._area * d + self._running * self.tau * (1 - d)
        self._done *= d
        self._sat_time *= d
        self._sat_done *= d
        self._last = now

    def step(self, n: int, waiting: int, finished: int, seconds: float, now: Optional[float] = None) -> None:
        """After each engine step: n requests were in the batch, `finished` of them ended, `waiting` are left
        queued (the engine could not admit them), and the step took `seconds`."""
        with self._lock:
            self._advance(self.clock() if now is None else now)
            self._running = n - finished
            if waiting > 0 and n > 0:
                self._saturated.add(float(n))
                self._sat_time += seconds
                self._sat_done += finished

    def set_running(self, n: int, now: Optional[float] = None) -> None:
        with self._lock:
            self._advance(self.clock() if now is None else now)
            self._running = n

    def finished(self, pages_used: Optional[float], ttft_s: Optional[float], found_free_slot: bool,
                 now: Optional[float] = None) -> None:
        with self._lock:
            self._advance(self.clock() if now is None else now)
            self._done += 1.0
            if pages_used:
                self._pages.add(float(pages_used))
            if ttft_s is not None and found_free_slot:
                self._prefill.add(ttft_s)

    def snapshot(self, replica: str, now: Optional[float] = None) -> ReplicaLoad:
        with self._lock:
            self._advance(self.clock() if now is None else now)
            service_s = self._area / self._done if self._done > 1e-6 and self._area > 0 else None
            per_req = self._pages.value
            servers = float(self.max_num_seqs)
            if self._saturated.value is not None:
                servers = min(servers, self._saturated.value)
            elif per_req and self.pages_total:
                servers = min(servers, self.pages_total / per_req)
            servers = max(1.0, servers)
            # a rate from a handful of saturated completions is too noisy to act on
            sat_rate = self._sat_done / self._sat_time if self._sat_done >= 3 and self._sat_time > 0 else None
            return ReplicaLoad(replica, servers, service_s, self._prefill.value, self.pages_total, per_req,
                               self.max_num_seqs, sat_rate)


REPLICA_TTL_S = 600.0  # forget a replica's capacity after this long without a report


# ---- the decision -------------------------------------------------------------------------------------------
@dataclass
class Decision:
    admit: bool
    reason: Optional[str] = None  # queue_delay | arrival_rate when rejected
    retry_after_s: int = 0
    predicted_ttft_s: Optional[float] = None
    detail: str = ""


@dataclass
class _Known:
    load: ReplicaLoad
    seen: float


@dataclass
class AdmissionController:
    """The ingress side. `decide()` for each arrival; `release()` when an admitted request ends;
    `report()` with each ReplicaLoad an engine replica sends back.

    share: this ingress's fraction of the traffic and of the capacity (1 / number of ingress replicas; a
    random split of a Poisson stream is Poisson, so each ingress runs the same model on its share).
    """

    config: AdmissionConfig
    default_servers: int  # per replica, until the replicas report (max_num_seqs)
    default_replicas: int = 1
    max_replicas: Optional[int] = None  # count only this many most recently reporting replicas (fixed size)
    share: float = 1.0
    clock: Callable[[], float] = time.monotonic
    in_flight: int = 0
    _replicas: dict[str, _Known] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrivals = ArrivalRateEstimator(self.config.rate_window_s, self.clock)
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self.last_prediction: Optional[float] = None

    # ---- inputs ----
    def report(self, load: ReplicaLoad) -> None:
        with self._lock:
            self._replicas[load.replica] = _Known(load, self.clock())

    def release(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    def arrival_rate(self) -> float:
        with self._lock:
            return self.arrivals.rate()

    def capacity(self) -> tuple[float, Optional[float], float]:
        """(servers C, total service rate M = sum c/S or None if unmeasured, prefill seconds) for this ingress."""
        with self._lock:
            return self._capacity_locked(self.clock())

    def _capacity_locked(self, now: float) -> tuple[float, Optional[float], float]:
        # A replica that stopped reporting is gone (scaled down, or replaced under a new id after a failure);
        # with a fixed replica count, the newest reports also push out the ones it replaced.
        for rid in [r for r, k in self._replicas.items() if now - k.seen > REPLICA_TTL_S]:
            del self._replicas[rid]
        known = sorted(self._replicas.values(), key=lambda k: k.seen, reverse=True)
        loads = [k.load for k in known[: self.max_replicas or None]]
        if not loads:
            return self.default_servers * self.default_replicas * self.share, None, 0.0
        servers = sum(x.servers for x in loads) * self.share
        rates = [x.service_rate for x in loads]
        rate = sum(r for r in rates if r) * self.share if any(rates) else None
        prefills = [x.prefill_s for x in loads if x.prefill_s is not None]
        return servers, rate, (sum(prefills) / len(prefills) if prefills else 0.0)

    # ---- the decision ----
    def decide(self) -> Decision:
        """Record an arrival and decide. Admitting counts the request in flight (call release() at its end)."""
        with self._lock:
            now = self.clock()
            self.arrivals.observe(now)
            if not self.config.enabled:
                return self._admit(None)
            servers, rate, prefill = self._capacity_locked(now)
            n = self.in_flight
            if n < servers:  # a free server: starts at once; refusing it cannot make anyone faster
                return self._admit(prefill)
            target = self.config.ttft_target_s
            if rate is None:  # nothing measured yet and every server busy: wait for the first completions
                return self._reject("queue_delay", 1, None, "no service-rate measurement yet and all "
                                                          f"{servers:.0f} servers busy")
            # 1) this arrival's own wait, given the requests already in the system
            wait = conditional_wait(n, servers, rate)
            ttft = wait + prefill
            self.last_prediction = ttft
            if ttft > target:
                return self._reject("queue_delay", ttft - target, ttft,
                                    f"{n} requests in flight for {servers:.1f} servers at {rate:.2f} req/s: "
                                    f"predicted TTFT {ttft:.2f}s > target {target:.2f}s")
            # 2) the stationary load: thin the Poisson stream down to the largest rate whose mean wait fits
            lam = self.arrivals.rate(now)
            c = max(1, int(servers))
            lam_max = max_sustainable_rate(c, rate / servers, target - prefill)
            if lam > lam_max and self._rng.random() > lam_max / lam:
                # Until the estimate decays under lam_max: lam * exp(-t / tau) = lam_max.
                retry = self.config.rate_window_s * math.log(lam / lam_max) if lam_max > 0 else target
                return self._reject("arrival_rate", retry, ttft,
                                    f"arrival rate {lam:.2f}/s above the sustainable {lam_max:.2f}/s "
                                    f"(TTFT target {target:.2f}s)")
            return self._admit(ttft)

    def _admit(self, ttft: Optional[float]) -> Decision:
        self.in_flight += 1
        return Decision(True, predicted_ttft_s=ttft)

    def _reject(self, reason: str, retry_s: float, ttft: Optional[float], detail: str) -> Decision:
        retry = int(min(self.config.max_retry_after_s, max(1, math.ceil(retry_s))))
        return Decision(False, reason, retry, ttft, detail)
