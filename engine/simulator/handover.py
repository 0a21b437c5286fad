"""The CPU engine's hand-over as a rendezvous: a sending stage is held until the next stage takes
its activation (`CostCoefficients.handover_rendezvous_s`; `calibrate runs --inflight-handover`).

Why: on CPU the engine's stage-to-stage send is gloo's (engine/torch_exec/stage/worker.py
`send_next`). A policy that is not structure-aware first sends the activation's metadata with the
blocking `dist.send`, which returns only once the next stage has posted the matching receive; a
structure-aware one posts `isend` and waits for the previous one before its next send (`send_wait`).
Set 6's traces (tiny-llama P=2, 2-core CPU; measurements/cpu-tiny-llama-2026-11-28): where the
sender was first, its send ended 0.28-0.38 ms (median) after the receiver's `recv` began, for MoLink, vLLM and gllm
alike (788 of 877 hops in pp2-azhi-molink-r1); SiPipe's `isend` returned at once. The simulator's
blocking send (SimSettings.blocking_send) instead frees the stage once the bytes have left the
link, so a sending stage may run ahead of a busy receiver. That matters only with more
micro-batches in flight than stages: MoLink's third at P=2 Azure 9 req/s let the simulated stage 0
start the next batch while stage 1 still worked, and the last stage waited 1.53 s for its inputs
where the engine's waited 2.6 s (and vLLM's, two in flight, 2.77 s).

The rule, per link s -> s+1: every activation the stage finished is "untaken" until stage s+1
starts that micro-batch (its receive begins after its input preparation; a stage that sat idle
until the activation came had prepared and posted its receive already, since the engine's stages
get each launch when it is made, so there it begins at the arrival); the sending stage stays
held while more than `window` are untaken (0: the blocking metadata send; 1: `isend`, one left
pending) and is freed `handover_s` after the receive that satisfies it began. Off (None) unless
the profile carries a positive `handover_rendezvous_s`.
"""
from __future__ import annotations

RELEASE = 6  # event priority: after COMPLETE (fifo_pipeline's six), so a run without hand-overs pops the same order


class Handover:
    """Which activations each sending stage still waits to see taken (module docstring)."""

    __slots__ = ("window", "handover_s", "_untaken", "_left")

    def __init__(self, links: int, window: int, handover_s: float) -> None:
        if window < 0 or handover_s < 0:
            raise ValueError(f"hand-over window {window} and time {handover_s} must be >= 0")
        self.window = window
        self.handover_s = handover_s
        self._untaken: list[set[int]] = [set() for _ in range(links)]
        self._left: list[int | None] = [None] * links  # a held stage's last activation (it has left the link)

    def sent(self, link: int, mb_id: int) -> None:
        """Stage `link` finished `mb_id`'s forward and hands it to the link."""
        self._untaken[link].add(mb_id)

    def free(self, link: int) -> bool:
        """Whether stage `link` may go on: no more than `window` of its activations untaken."""
        return len(self._untaken[link]) <= self.window

    def hold(self, link: int, mb_id: int) -> None:
        """Stage `link`'s activation `mb_id` has left the link but the stage stays held."""
        self._left[link] = mb_id

    def taken(self, link: int, mb_id: int, recv_start_s: float) -> tuple[float, int] | None:
        """Stage `link + 1` begins receiving `mb_id` at `recv_start_s`; when that frees a held stage
        `link`: (when it is freed, the micro-batch whose send held it); else None."""
        self._untaken[link].discard(mb_id)
        held = self._left[link]
        if held is not None and self.free(link):
            self._left[link] = None
            return recv_start_s + self.handover_s, held
        return None


def receive_start(now: float, parts) -> float:
    """When a stage's receive begins in its chain of (name, seconds) parts starting at `now`: after
    whatever precedes the receive (or the forward, where no receive is priced)."""
    t = now
    for name, seconds in parts:
        if name == "recv" or name.startswith("forward"):
            break
        t += seconds
    return t


def handover_for(blocking_send: bool, pp: int, handover_s: float, structure_aware: bool) -> Handover | None:
    """The executor's hand-over model: only a blocking (host) send between stages, with the profile's
    fitted term (0 = off, the default: results as before)."""
    if not blocking_send or pp < 2 or not handover_s:
        return None
    return Handover(pp - 1, 1 if structure_aware else 0, handover_s)
