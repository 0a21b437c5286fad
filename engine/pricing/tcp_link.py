"""How long a transfer takes over a real delayed, rate-limited TCP link: `link.model=tcp`.

The ideal link (`link.model=ideal`, the default) is a FIFO pipe: a transfer of n bytes leaves after
n / B (+ the cost model's `transfer_metadata_s` unless structure-aware) and lands `latency` later.
Over TCP, as the project's data plane runs between hosts (torch.distributed gloo: one TCP connection
per stage pair), more things decide the time, and each was seen in measurements through a
real kernel link (testbed/linkbench: veth + `tbf` + a packet-delaying relay; docs/links.md):

1. Round trips per message. gloo's point-to-point send is a rendezvous: the data of a send goes out
   only once the receiver's "ready to receive" notice has arrived, and the receiver posts its next
   receive only when the previous message is in. A 3-message transfer (the metadata's size, the
   metadata, the activation: the engine's path unless structure-aware, and vLLM v0's
   `send_tensor_dict`) therefore costs about 2 x RTT more than one message: measured 1 KB in
   152 ms as 3 messages against 31 ms as one, at 30 ms one-way delay.
2. Window growth. A connection that has sent little sends at most its congestion window per round
   trip: slow start from the initial window, doubling per RTT while the window is used, until the
   window covers the bandwidth-delay product; from then on the bottleneck rate. The window grows
   only while a transfer fills it (Linux's cwnd validation: cwnd < 2 x in flight).
3. Restart after idle. Linux (`tcp_slow_start_after_idle`, on by default) halves the window for each
   retransmission timeout (RTO ~ smoothed RTT + 200 ms; the RTT includes the queueing a large
   window caused) the sender sat idle, down to the initial window.
4. Loss. A window that outgrows what the path holds (bandwidth-delay product + the bottleneck's
   queue) overflows the queue, and so does a transfer that starts (on an idle, fully acknowledged
   connection) with a window larger than the bottleneck takes at once: its queue plus what it
   forwards while the burst arrives at `sender_Bps` (fitted: an effective burst speed; the harness's
   relays forward 1.2-1.5 GB/s in bulk). Reno (the harness's endpoints: testbed/linkbench/netns.py)
   then sets the threshold to `loss_beta` = 0.5 of the window when the loss is FOUND (Linux
   `tcp_reno_ssthresh`), and recovery ends with the window there (`tcp_end_cwnd_reduction`). Before
   the hole is found, the bytes ahead of it are acknowledged, and in slow start each grows the window
   (`tcp_slow_start`: cwnd += acked, not past ssthresh): after a burst the window is found at window
   + what the queue took (2.11 + ~1.5 MB -> threshold 1.8 MB in the traces), after slow start's
   overshoot at twice what the path holds; in congestion avoidance it is the window (1.8 -> 0.9 MB).
   Slow start stops at the threshold (`tcp_slow_start`). The burst's bytes cross at the rate (the
   queue it filled keeps the bottleneck busy while it drains; then it idles until the retransmissions
   come, about a round trip after the hole), the rest of the transfer at the cut window; the recovery
   costs `burst_loss_rtts` round trips more (fitted).
   Whether a burst that fits only with what drains meanwhile is lost is chance: it comes either at
   about `sender_Bps` (chance `slow_burst_p`) or at line speed, when the queue alone takes it (the
   traces: a lost 2.11 MB burst was found 1.49 MB in). At 400 Mbps the 2.1 MB burst is on that edge
   and the runs fall in two modes (2026-11-28: the first 4 MB burst survived in 17 of 25 runs at
   10-50 ms); engine/pricing/tcp_modes.py prices a connection over both outcomes, the expected time. Slow start grows the window
   only up to twice what was in flight (`tcp_is_cwnd_limited`): 128 KB after two 16 KB transfers
   takes one round trip more than a doubling window would.

The bottleneck carries headers too: payload moves at `goodput_fraction` x B. Each message also
costs a little host time (`per_message_s`: framing, syscalls, the notice's handling).

The constants are fitted to measurements (testbed/linkbench/fit.py; engine/pricing/link_profiles/
gloo-tcp.json holds them with their provenance and every measured transfer beside its modelled
time); the initial window and Reno's cut are Linux's; nothing here is set from a paper. Fitted on
10, 30 and 50 ms series, tested once on new 20 and 40 ms series (3 repeats a point, judged against
their mean; measurements/linkbench-2026-11-28, docs/links.md); refitted with the two outcomes of a
burst on 10-50 ms and tested on new 15 and 35 ms series (link46e, measurements/linkbench-2026-11-28b).
At 400 Mbps a 2.1 MB burst on a 1.5 MB queue is lost on some runs and not on others (TCP's, with
either relay: 4 MB in 264-390 ms over 5 repeats at 30 ms). Left out: the sending stage held by its blocking metadata sends (only the
link is), a receiver that posts its first receive late (the model assumes the receiving stage waits
for the data), Linux's window cut when the sender has been application-limited for an RTO, jitter,
cross traffic, CUBIC's growth and HyStart (`loss_beta` 0.7 gives only its cut).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.base.errors import bad_value

LINUX_RTO_MIN_S = 0.2  # TCP_RTO_MIN (include/net/tcp.h): RTO = srtt + max(4 rttvar, 200 ms) on a steady path
CERTAIN = 1e-4  # a burst-loss probability this close to 0 or 1 is taken as certain (tcp_modes.py: no split)
PROFILE_DIR = Path(__file__).parent / "link_profiles"
DEFAULT_PROFILE = "gloo-tcp"


@dataclass(frozen=True)
class TcpConstants:
    """The TCP link model's constants (see the module doc)."""

    initial_window_bytes: float  # the window a new (or long-idle) connection starts with
    goodput_fraction: float  # payload bytes / bottleneck bytes in the rate-limited phase
    per_message_s: float  # host time per gloo message on top of the wire
    # Reno's multiplicative decrease: the window after a loss's recovery is this fraction of the window
    # when the loss was detected (Linux `tcp_reno_ssthresh`: cwnd >> 1; recovery ends with cwnd =
    # ssthresh, `tcp_end_cwnd_reduction`). The harness's endpoints run Reno (testbed/linkbench/netns.py);
    # CUBIC's is 0.7 (RFC 9438 beta_cubic). Not fitted.
    loss_beta: float = 0.5
    # The bottleneck's queue the window may fill beyond the BDP: `queue_bytes` + `queue_bdp` x the
    # path's bandwidth-delay product (the harness's since 2026-11-27: one BDP, the rule-of-thumb router
    # buffer; before, a fixed 1,000 frames, half a BDP at 400 Mbps / 60 ms)
    queue_bytes: float = 1000 * 1514
    source: str = ""
    queue_bdp: float = 0.0
    # A window larger than what the bottleneck absorbs, sent at once after a pause (every transfer here
    # starts on an idle, fully acknowledged connection), overflows its queue: SACK recovery costs
    # this many round trips more, and Reno halves the window (0 = not priced, the older profiles)
    burst_loss_rtts: float = 0.0
    # How fast the sending host puts a burst onto the path (fitted): while a burst of b bytes arrives,
    # the bottleneck forwards rate x b / sender_Bps of it, so a burst fits if
    # b <= queue / (1 - rate / sender_Bps). Infinite: the queue alone absorbs it.
    sender_Bps: float = math.inf
    # The chance that a burst reaches the bottleneck at `sender_Bps`; otherwise it comes at line speed
    # and the queue alone takes it (the traces: a lost 2.11 MB burst was found 1.49 MB in, the queue's
    # size; one that survived came slowly enough). 1 = always at `sender_Bps`: one outcome (link46d's
    # form); < 1: a burst that fits at `sender_Bps` is lost with chance 1 - this, and the connection is
    # priced over both outcomes (engine/pricing/tcp_modes.py)
    slow_burst_p: float = 1.0
    # A lost first burst's recovery priced by what was lost (candidate M2, 2026-11-28f): this many round
    # trips more per cut window of lost bytes (SACK recovery resends them at most a cut window per round
    # trip). With per-direction relays a lost 4 MB burst at 400 Mbps / 25 ms took 327-330 ms against 242
    # priced by `burst_loss_rtts` alone (measurements/linkbench-2026-11-28e). 0: not priced (older profiles).
    lost_window_rtts: float = 0.0

    def __post_init__(self) -> None:
        if not self.initial_window_bytes > 0:
            raise bad_value("initial_window_bytes", self.initial_window_bytes, "must be > 0")
        if not 0 < self.goodput_fraction <= 1:
            raise bad_value("goodput_fraction", self.goodput_fraction, "must be in (0, 1]")
        if not 0 < self.loss_beta < 1:
            raise bad_value("loss_beta", self.loss_beta, "must be in (0, 1)")
        if not self.sender_Bps > 0:
            raise bad_value("sender_Bps", self.sender_Bps, "must be > 0")
        if min(self.per_message_s, self.queue_bytes, self.queue_bdp, self.burst_loss_rtts, self.lost_window_rtts) < 0:
            raise bad_value("per_message_s/queue_bytes/queue_bdp/burst_loss_rtts",
                            (self.per_message_s, self.queue_bytes, self.queue_bdp, self.burst_loss_rtts), "must be >= 0")
        if not 0 <= self.slow_burst_p <= 1:
            raise bad_value("slow_burst_p", self.slow_burst_p, "must be in [0, 1]")

    def queue(self, bdp: float) -> float:
        """Bytes the bottleneck queues beyond a path holding `bdp`."""
        return self.queue_bytes + self.queue_bdp * bdp

    def absorbs(self, queue: float, rate_Bps: float) -> float:
        """The largest burst the bottleneck takes without a loss: its queue plus what it forwards
        while the burst arrives at the sender's speed."""
        if self.sender_Bps <= rate_Bps:
            return math.inf
        return queue / (1.0 - rate_Bps / self.sender_Bps)

    def burst_loss_p(self, burst: float, queue: float, rate_Bps: float) -> float:
        """The chance that a burst of `burst` bytes, sent at once, overflows the bottleneck's queue: 0 if
        the queue alone takes it, 1 if it does not fit even at `sender_Bps`, else the chance that it
        comes at line speed (1 - `slow_burst_p`)."""
        if not self.burst_loss_rtts or burst <= queue:
            return 0.0
        return 1.0 if burst > self.absorbs(queue, rate_Bps) else 1.0 - self.slow_burst_p

    def absorbed(self, burst: float, queue: float, rate_Bps: float) -> float:
        """What the bottleneck took of a lost burst: at line speed its queue, at `sender_Bps` also what
        it forwarded meanwhile (`absorbs`); a loss that happens at either speed takes the mean."""
        slow = min(burst, self.absorbs(queue, rate_Bps))
        if burst <= slow:  # lost only at line speed
            return queue
        return self.slow_burst_p * slow + (1.0 - self.slow_burst_p) * queue


def load_constants(name: str = DEFAULT_PROFILE, path: Path | None = None) -> TcpConstants:
    """A shipped profile by name, or any profile file `fit.py` wrote (`path`: a candidate being judged)."""
    data = json.loads((path or PROFILE_DIR / f"{name}.json").read_text())
    c = data["constants"]
    return TcpConstants(float(c["initial_window_bytes"]), float(c["goodput_fraction"]), float(c["per_message_s"]),
                        float(c["loss_beta"]), float(c["queue_bytes"]), str(data.get("source", "")),
                        float(c.get("queue_bdp", 0.0)), float(c.get("burst_loss_rtts", 0.0)),
                        float(c.get("sender_Bps") or math.inf), float(c.get("slow_burst_p", 1.0)),
                        float(c.get("lost_window_rtts", 0.0)))


@dataclass
class TcpConnection:
    """One stage-to-stage TCP connection's state: its window and when it last sent."""

    bandwidth_Bps: float
    latency_s: float  # one-way delay
    constants: TcpConstants
    window: float = math.nan
    last_sent_s: float = -math.inf
    ssthresh: float = math.inf  # slow start's threshold: set by the first loss
    queued_s: float = 0.0  # queueing delay in the round-trip time the last transfer ended with
    burst_p: float = 0.0  # the probability the last transfer's first burst was lost (`TcpConstants.burst_loss_p`)

    def __post_init__(self) -> None:
        if math.isnan(self.window):
            self.window = self.constants.initial_window_bytes

    @property
    def rtt_s(self) -> float:
        return 2.0 * self.latency_s

    @property
    def rate_Bps(self) -> float:
        return self.bandwidth_Bps * self.constants.goodput_fraction

    def rto_s(self) -> float:
        return self.rtt_s + self.queued_s + LINUX_RTO_MIN_S

    def restart_after_idle(self, now: float) -> None:
        """Linux `tcp_cwnd_restart`: one halving per RTO of idleness beyond the first, not below the
        initial window."""
        iw = self.constants.initial_window_bytes
        idle, rto = now - self.last_sent_s, self.rto_s()
        if idle <= rto or self.window <= iw:
            return
        halvings = math.ceil(idle / rto) - 1
        self.window = max(iw, self.window / 2.0 ** min(halvings, 60))

    def stream_s(self, nbytes: float, lose_burst: bool | None = None) -> float:
        """Seconds from a message's first byte leaving to its last byte leaving the bottleneck;
        grows the window as slow start does, and cuts it as Reno does after a loss: a first burst
        larger than the bottleneck absorbs, or slow start outgrowing what the path holds
        (bandwidth-delay product + the bottleneck's queue). `lose_burst` decides a burst whose loss
        is uncertain (0 < `burst_p` < 1); None: lost if more likely than not."""
        rate, rtt, c = self.rate_Bps, self.rtt_s, self.constants
        bdp = rate * rtt
        queue = c.queue(bdp)
        holds = bdp + queue
        t, left, w = 0.0, float(nbytes), self.window
        burst = min(w, left)
        p = self.burst_p = c.burst_loss_p(burst, queue, rate)
        if p > 0.0:
            absorbs = c.absorbed(burst, queue, rate)
            uncertain = lose_burst is not None and CERTAIN < p < 1.0 - CERTAIN
            if lose_burst if uncertain else p >= 0.5:  # the first burst overflows the queue
                # the queue the burst filled keeps the bottleneck busy while it drains (what it took /
                # the rate); the first retransmission reaches it about a round trip after the hole, so
                # it idles for the rest of that round trip (link46e; validation 1 point off instead of 3)
                t += c.burst_loss_rtts * rtt + max(0.0, rtt - absorbs / rate)
                w0, w = w, self._cut(self._found_at(w, burst, absorbs))
                t += c.lost_window_rtts * max(0.0, burst - absorbs) / w * rtt  # resent a cut window a round trip
                # the burst's bytes cross at the rate, the rest at the cut window (link46d)
                at_rate = min(left, w0)
                t += at_rate / rate
                left -= at_rate
        while left > w and w < bdp:  # a window per round trip
            t += rtt
            left -= w
            w = self._grow(2.0 * w, holds if left > holds else math.inf)
        t += left / rate
        # a window beyond the BDP waits in the bottleneck's queue: the RTT the sender last measured
        self.queued_s = max(0.0, min(w, holds, left) - bdp) / rate
        if left >= 0.5 * w and w < self.ssthresh:  # window-limited at the end: it keeps growing (cwnd validation)
            # the queue overflows only if the transfer can fill what the path holds
            # Linux grows the window in slow start only up to twice what was in flight
            # (`tcp_is_cwnd_limited`): an application-limited transfer does not double it
            grown = self._grow(min(w + left, 2.0 * left), holds if left > holds else math.inf)
            if grown < w:  # the overshoot's loss, found one round trip later
                t += rtt
            w = grown
        self.window = w
        return t

    def _found_at(self, w: float, burst: float, absorbs: float) -> float:
        """The window when a burst's loss is found: the first hole is `absorbs` bytes in, and the
        acknowledgements of the bytes before it arrive first. In slow start each grows the window by
        what it acknowledges (Linux `tcp_slow_start`: cwnd += acked, not past ssthresh), while the window
        is used (`tcp_is_cwnd_limited`: cwnd < 2 x in flight); in congestion avoidance it grows by about
        a segment a window (`tcp_cong_avoid_ai`), left out."""
        if w >= self.ssthresh or w >= 2.0 * burst:
            return w
        return min(w + absorbs, max(w, self.ssthresh))

    def _cut(self, found_at: float) -> float:
        """Reno's cut: on entering recovery the threshold becomes `loss_beta` of the window then (Linux
        `tcp_reno_ssthresh`: max(cwnd >> 1, 2) segments), and recovery ends with the window at the
        threshold (`tcp_end_cwnd_reduction`)."""
        self.ssthresh = max(self.constants.initial_window_bytes, self.constants.loss_beta * found_at)
        return self.ssthresh

    def _grow(self, want: float, holds: float) -> float:
        """Slow start's next window; past what the path holds, a loss: the queue overflows when the
        window reaches `holds`, and before the hole is found every byte in flight ahead of it (`holds`
        of them) is acknowledged, each growing the window (`tcp_slow_start`): found at up to twice
        `holds` (measured, 10 ms / 400 Mbps: threshold 2.52 MB with the path + queue holding 2.51 MB)."""
        if want <= min(holds, self.ssthresh):
            return want
        if want > holds and self.ssthresh > holds:  # slow start stops at the threshold (`tcp_slow_start`)
            return self._cut(min(want, 2.0 * holds))
        return self.ssthresh

    def send(self, start: float, nbytes: float, messages: int = 1, small_bytes: float = 104.0,
             lose_burst: bool | None = None) -> tuple[float, float]:
        """A transfer of `messages` gloo messages, the last of `nbytes` (the others small metadata,
        `small_bytes` together) starting at `start`: (when the link is free again, when the last byte
        has arrived). Each message after the first waits for the receiver's notice: one round trip
        after the previous message's arrival at the receiver. `lose_burst`: as `stream_s`."""
        self.restart_after_idle(start)
        d, c = self.latency_s, self.constants
        t = start
        small = small_bytes / max(1, messages - 1)
        for _ in range(messages - 1):
            t += c.per_message_s + self.stream_s(small)  # leaves the bottleneck
            t += 2.0 * d  # lands d later; the notice for the next message takes d back
        t += c.per_message_s + self.stream_s(nbytes, lose_burst)
        self.last_sent_s = t
        return t, t + d
