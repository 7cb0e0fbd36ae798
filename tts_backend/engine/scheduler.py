"""The scheduler: which batch runs next.

Pure bookkeeping, no threads and no device: the engine thread calls `decide(now)` and gets one batch of
one kind of work (prefill, frame or codec chunk). The batch is built around an anchor, the most urgent
ready item, and filled with every compatible ready item, because on a bandwidth-bound GPU a batch of 8
costs about what a batch of 1 does (H100, bench/results/engine_step_h100.json: a frame is 5.3 ms for 2
streams, 7.1 ms for 64, 10.7 ms for 128).

Every frame item is compatible with every other: a frame batch carries every stream that can step (the
Talker step of those that need one and the code-predictor loop of all), in the smallest captured bucket
that holds them. The urgency rules pick the anchor, so they decide when a frame runs against prefill and
codec work, and which streams go first when more can step than the largest bucket holds; they never leave
a stream out of a frame that has room. (When decode and code prediction were separate batches, the streams
split into cohorts half a frame apart and each batch carried one of them: at 40 RPS on the H100 110 streams
held slots and a batch carried 14.)

Urgency, highest first (engine.md):
1. codec work of a playing stream about to run out of audio (now >= deadline - reserve);
2. generation work of a playing stream whose next chunk cannot be ready in time unless it runs now: the
   frames its next chunk still lacks, times the measured cost of a frame, plus a codec call, reach past
   its deadline. Without this rule a burst of new requests (rule 3) starves
   streams that are already playing and they underrun;
3. any work of a request that has no audio yet, by stage rank (codec, prefill, frame), then arrival;
4. work of a stream within `pressing_lead_s` of its deadline, earliest deadline first;
5. otherwise round-robin: the stage served least recently.

A stream whose text is still being written (text streaming, issue 21) takes one text token per Talker
step. When its next step needs a token that has not come, it waits for text outside the batches: it has no
generation item at all, so it is never decoded on a pad (which would change what it says: the model reads
a pad as the text running out), it is not a candidate of rule 2 however late its deadline (its listener's
silence is the text's, not the engine's: the engine counts it apart, EngineStats.text_*), and it cannot
hold back the streams that have their text, since a batch is built only from items that are ready. Its
generated frames still go to the codec, the chunk schedule notwithstanding: they are audio the listener
would otherwise wait for, for as long as the text takes. The step after the wait becomes ready in the
decision after its token arrives (the engine applies pushed text before it decides), and it joins that
decision's batch like any other item.

What each slot holder is ready for is kept between decisions (`_Readiness`), not rebuilt in a pass over every
holder per decision: that pass cost 58-80 us per decision at 128 streams on the CPU VM and 99-243 us on a
loaded H100 host, GPU idle time all of it. A decision re-reads only the requests of the batch it returned last
(the engine runs it before deciding again) and those the engine names through `changed` (text arrived, a codec
batch was collected, a request finished); a frame moves its streams one frame on, and each is re-read in full
only when that crosses one of its limits (its next chunk, max_pending_frames, its text); a codec batch's launch
only puts its streams' codec work in flight, and takes it out of the ready work without a re-read. The codec
work is kept in the order a batch is filled in, so each rule's share of it is a slice. The clock and the
measured costs apply at every decision, to the playing streams in deadline order, read only as far as a rule
needs. Decisions are those of the pass (tests/test_scheduler_equivalence.py holds them to it;
tests/test_scheduler_readiness.py holds what is kept to a reading from scratch).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from itertools import accumulate, chain
from operator import attrgetter
from dataclasses import dataclass, field

from .request import Phase, RequestState, Stage

# The enum members the per-decision and per-holder paths compare with, as module names: read through their
# class each costs about 70 ns on CPython 3.11, a module name about 15, and a decision reads dozens.
_CODEC, _PREFILL, _FRAME = Stage.CODEC, Stage.PREFILL, Stage.FRAME
_NEED_PREFILL, _NEED_CODE_PREDICT, _NEED_DECODE, _FINISHED = (
    Phase.NEED_PREFILL, Phase.NEED_CODE_PREDICT, Phase.NEED_DECODE, Phase.FINISHED)
_STEPPABLE = (_NEED_DECODE, _NEED_CODE_PREDICT)  # the phases of a stream that can step

# Round-robin tie order when several stages were served equally long ago.
_ROUND_ROBIN_ORDER = (Stage.PREFILL, Stage.FRAME, Stage.CODEC)


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 64  # KV slots: requests admitted to generation at once
    max_batch: dict = field(
        default_factory=lambda: {Stage.PREFILL: 8, Stage.FRAME: 64, Stage.CODEC: 16}
    )
    codec_reserve_s: float = 0.025  # the least lead a playing stream's codec work gets (see Scheduler.codec_lead)
    pressing_lead_s: float = 1.0
    max_buffered_s: float = 10.0  # audio a consumer may leave unread before its stream pauses
    max_pending_frames: int = 48  # generated but not yet decoded; bounded by the runner's frame ring
    max_codec_frames: int = 12  # the most frames per stream one codec call decodes (the runner's captured counts)
    # A fresh arrival's prefill may wait this long for others while at least prefill_gather_streams step.
    prefill_gather_s: float = 0.010
    prefill_gather_streams: int = 24
    # A resumed request's prefill (RequestState.resume) waits this long after the latest resume's arrival for
    # more, at any load while other work is ready (a frame, a codec call), and never longer than
    # resume_gather_most_s after the first: a worker's death or drain sends its streams to the others within a
    # few ms of each other, and each resume pass is a pause for its listeners (H100, 20 RPS, a worker killed
    # with 8 streams open: the first 2 resumed in a pass of 50 ms, the other 6 arrived during it and waited for
    # it before their own of 64 ms, and heard audio 153 ms after the loss against 67 ms;
    # bench/results/resume_h100.md). With nothing else ready a resume is not held: the engine would idle.
    resume_gather_s: float = 0.004
    resume_gather_most_s: float = 0.012
    # Fresh arrivals may be prefilled inside a frame, between its Talker step and its predictor (decide_between).
    admit_mid_frame: bool = True
    initial_stage_cost_s: float = 0.005  # per-batch cost guess until the engine has measured each stage


@dataclass
class Batch:
    stage: Stage
    requests: list[RequestState]
    frames: int = 0  # codec only: frames each request decodes in this call
    rule: str = ""  # which urgency rule chose it (for tests and tracing)
    # Codec only: the batch runs on the runner's first-chunk lane, beside the queued codec batches (decide's
    # `first_chunk_lane`): every request in it has no audio out yet, and it fits the lane's shape.
    first_chunk_lane: bool = False


class _Item:
    """One ready piece of work, with what the rules compare computed once per decision."""

    __slots__ = ("request", "stage", "frames", "deadline", "arrival", "order")

    def __init__(self, request: RequestState, stage: Stage, deadline: float | None, frames: int = 0,
                 order: int = 0) -> None:
        self.request = request
        self.stage = stage
        self.frames = frames
        self.deadline = deadline  # None while the request has no audio out yet
        self.arrival = request.arrival
        self.order = order  # its holder's admission order (codec and prefill items): the last tie-break


def _deadline(request: RequestState) -> float | None:
    """When the listener runs out of audio: playback start plus the duration of all audio emitted (None while
    no audio has gone out)."""
    if request.playback_start is None:
        return None
    return request.playback_start + request.output.emitted_samples / request.sample_rate


def _next_chunk_frames(request: RequestState) -> int:
    """RequestState.next_chunk_frames, without the property's call: read for every holder re-read and every
    rule 2 candidate, a dozen or more times per decision."""
    schedule, chunks = request.chunk_schedule, request.chunks_decoded
    return schedule[chunks] if chunks < len(schedule) else schedule[-1]


def _late_unless_now(request: RequestState, deadline: float, now: float, frame_cost: float,
                     codec_cost: float) -> bool:
    """Rule 2's test: the frames the request's next chunk still lacks, at the measured cost of a frame, then
    its codec call, reach past its deadline unless it steps now."""
    lacking = _next_chunk_frames(request) - (request.frames_generated - request.frames_decoded)
    return lacking > 0 and now >= deadline - lacking * frame_cost - codec_cost


def _fill_order(item: _Item) -> tuple:
    """Requests with no audio yet first (by arrival), then earliest deadline."""
    return (item.deadline is not None, item.deadline or 0.0, item.arrival)


class _Ready:
    """Every piece of work ready now, by stage, and the candidates of each urgency rule.

    Frame work is kept apart, as the requests that can step (`frames`) and, per rule, only the one that
    would anchor it (it is in the rule's list): a frame batch carries every stream that can step whenever
    they fit the largest bucket, which they do whenever the KV slots do, so the rest of them need no item
    and no order. Only when more can step than the largest bucket holds does `Scheduler._frame_items` build
    the full list, to order them."""

    __slots__ = ("now", "by_stage", "frames", "round_robin_frame", "urgent_codec", "urgent_generation", "startup",
                 "pressing", "codec_cap")

    def __init__(self, now: float) -> None:
        self.now = now
        self.by_stage: dict[Stage, list] = {}  # stages with work ready (never an empty list)
        self.frames: list[RequestState] = []
        self.round_robin_frame: RequestState | None = None  # rule 5's anchor if it serves frames
        self.urgent_codec: list[_Item] = []
        self.urgent_generation: list[_Item] = []
        self.startup: list[_Item] = []
        self.pressing: list[_Item] = []
        self.codec_cap: int | None = None  # a codec batch's most requests where it is not the stage's batch cap


class _Holder:
    """What one slot holder is ready for, as of the last time the scheduler read its request (`_Readiness`)."""

    __slots__ = ("request", "order", "stepping", "deadline_key", "codec", "codec_key", "prefill",
                 "generated_limit", "fed_limit", "chunk_end", "paused", "gone")

    def __init__(self, request: RequestState, order: int) -> None:
        self.request = request
        self.order = order  # admission order: ties between equal deadlines go to the earlier
        self.stepping = False  # it can step (a frame item)
        self.deadline_key: tuple | None = None  # (deadline, order) while it can step and plays
        self.codec: _Item | None = None  # its codec work, when the chunk schedule makes some ready
        self.codec_key: tuple | None = None  # the codec item's place in `_Readiness.codec_keys`
        self.prefill: _Item | None = None
        # A frame moves a stepping stream one frame on; its readiness changes only once frames_generated
        # reaches this (max_pending_frames, its next chunk, or a frame cap an open text may still grow) or
        # text_fed reaches fed_limit (it waits for text); short of that the frame changed nothing here.
        self.generated_limit = 0
        self.fed_limit = 0
        # While it can step: frames_generated once its next chunk's frames are there (frames_decoded and the
        # chunk change only when a codec batch is collected, which has it re-read), for rule 2's test.
        self.chunk_end = 0
        self.paused = False  # back-pressure: its consumer stopped reading
        self.gone = False  # removed from the scheduler


_NEVER = float("inf")


class _Readiness:
    """Which slot holders can step, have codec work or prefill, kept between decisions rather than rebuilt in
    a pass over every holder per decision (at 128 streams that pass cost 58-80 us on the CPU VM and 99-243 us
    on a loaded H100 host, all of it GPU idle time).

    A holder is re-read (`refresh`) only when its request may have changed: the requests of the batch the
    scheduler returned last (the engine runs it before it decides again), and those the engine names through
    `Scheduler.changed` (text arrived, a codec batch was collected, a request finished or was cancelled). A
    frame batch moves every stream in it one frame on, so its streams get the cheap check of `_Holder`'s limits
    first; a codec batch's streams, once it is launched, only lose their codec work (`catch_up`). The one
    change nobody reports is a consumer reading audio (another thread): holders paused by back-pressure are
    re-read at every decision.

    Kept: the streams that can step in admission order, the playing ones among them sorted by deadline (the
    anchors of rules 2, 4 and 5 are at its front, so a decision reads only its first few), the fresh ones
    (rule 3), the prefill items, and the codec items in fill order (`_codec_key`): under load most slot holders
    have codec work waiting (about 90 of 134 at 100 RPS in bench/engine_sim.py), and in that order each rule's
    codec candidates are a slice found by bisection, a batch is filled without sorting them, and a re-read that
    leaves a holder's item as it was changes nothing. An item is rebuilt only when its deadline changes (its
    place in that order); a change of its frames alone is made in place."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.holders: dict[int, _Holder] = {}  # request id -> holder, admission order
        self._order = 0
        self._dirty: dict[_Holder, None] = {}  # re-read in full at the next decision
        self._stepped: list[_Holder] = []  # the last frame batch's holders: the cheap check first
        self._launched: list[_Holder] = []  # the last codec batch's holders: in flight, unless the engine says more
        self._paused: dict[_Holder, None] = {}
        self.by_deadline: list[tuple] = []  # (deadline, order, holder) of playing holders that can step
        self.fresh: dict[_Holder, None] = {}  # holders that can step and have no audio out yet
        # The codec items in fill order and their keys, index for index (insertions and deletions by bisection).
        self.codec_keys: list[tuple] = []
        self.codec_items: list[_Item] = []
        self._prefill: dict[_Holder, None] = {}
        # The holders that can step and their requests, in admission order, kept in place as holders flip (rebuilt
        # from every holder after one flipped, they cost about 2 us a decision at 100 RPS in bench/engine_sim.py).
        self._stepping_list: list[_Holder] = []
        self._stepping_requests: list[RequestState] = []
        self._prefill_items: list[_Item] | None = []  # admission order, rebuilt only after membership changed
        self._max_pending = config.max_pending_frames
        self._max_buffered_s = config.max_buffered_s
        self.most_frames_wanted = 1  # the largest chunk of any holder's schedule: bounds rule 2's plan

    def admit(self, request: RequestState) -> None:
        holder = _Holder(request, self._order)
        self._order += 1
        self.holders[request.request_id] = holder
        self.most_frames_wanted = max(self.most_frames_wanted, max(request.chunk_schedule))
        self._dirty[holder] = None

    def remove(self, request: RequestState) -> None:
        holder = self.holders.pop(request.request_id, None)
        if holder is None:
            return
        self._clear(holder)
        holder.gone = True
        self._dirty.pop(holder, None)
        self._paused.pop(holder, None)

    def changed(self, request: RequestState) -> None:
        holder = self.holders.get(request.request_id)
        if holder is not None:
            self._dirty[holder] = None

    def ran(self, batch: Batch) -> None:
        """The batch just decided runs before the next decision: its requests are re-read then."""
        if batch.stage is _FRAME and len(batch.requests) == len(self._stepping_requests):
            # Every stream that can step is in it. The kept list itself, not a copy: a holder removed before the
            # next decision leaves it, and nothing else changes it until that decision has read it.
            self._stepped = self._stepping_list
            return
        holders = [self.holders[r.request_id] for r in batch.requests]
        if batch.stage is _FRAME:
            self._stepped = holders
        elif batch.stage is _CODEC:
            self._launched = holders
        else:
            self._dirty.update(dict.fromkeys(holders))

    # ---- bringing holders up to date ---------------------------------------------------------------
    def catch_up(self) -> None:
        """Re-read every holder that may have changed since the last decision."""
        if self._stepped:
            dirty = self._dirty
            for holder in self._stepped:
                request = holder.request
                if request.frames_generated >= holder.generated_limit or request.text_fed >= holder.fed_limit \
                        or request.phase not in _STEPPABLE:
                    dirty[holder] = None
            self._stepped = []
        if self._paused:
            self._dirty.update(self._paused)
        if self._launched:
            # A codec batch's launch changes nothing of its streams but codec_busy (collecting it is reported):
            # each had codec work, so was not paused and had the limits of a stream with codec work, which a
            # stream in flight has too. Its codec work is in flight: that is all a re-reading would change.
            # One named through `changed` as well, or not in flight (not launched, or collected at once), is
            # re-read in full.
            dirty = self._dirty
            for holder in self._launched:
                if holder.gone or holder in dirty:
                    continue
                if holder.request.codec_busy and holder.codec is not None:
                    self._drop_codec(holder)
                    holder.codec = None
                else:
                    dirty[holder] = None
            self._launched = []
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            refresh = self.refresh
            for holder in dirty:
                if not holder.gone:
                    refresh(holder)

    def refresh(self, holder: _Holder) -> None:
        """Read the request and file the holder under the work it has ready (the checks `decide` made per
        holder before, unchanged). About 12 holders a decision under load (bench/engine_sim.py, 100 RPS): each
        attribute is read once into a local, and what did not change is left where it is filed."""
        request = holder.request
        stepping = False
        deadline = codec = prefill = None
        generated_limit = fed_limit = _NEVER
        paused = False
        if not (request.cancelled or request.done):
            output = request.output
            emitted = output.emitted_samples
            sample_rate = request.sample_rate
            if emitted - output.consumed_samples >= self._max_buffered_s * sample_rate:
                paused = True  # back-pressure: a consumer that stopped reading stops its stream's work (slot kept)
            else:
                playback_start = request.playback_start
                if playback_start is not None:
                    deadline = playback_start + emitted / sample_rate
                generated = request.frames_generated
                decoded = request.frames_decoded
                pending = generated - decoded
                want = _next_chunk_frames(request)
                phase = request.phase
                text_open = request.text_open
                # Waiting for text (RequestState.waiting_for_text): no generation item, see the module doc.
                waiting = text_open and phase is _NEED_DECODE and (
                    request.text_fed >= request.text_ready or generated >= request.max_frames)
                max_pending = self._max_pending
                # Generation waits for the codec to catch up once max_pending frames are not decoded yet.
                if pending < max_pending and not waiting:
                    if phase is _NEED_DECODE or phase is _NEED_CODE_PREDICT:
                        stepping = True
                    elif phase is _NEED_PREFILL:
                        prefill = holder.prefill
                        if prefill is None or prefill.deadline != deadline:
                            prefill = _Item(request, _PREFILL, deadline, order=holder.order)
                # Codec work is ready once the next chunk's frames are there, or whatever is left once
                # generation has finished or waits for text; it decodes the chunk's frames (or the rest).
                codec_busy = request.codec_busy
                if pending > 0 and not codec_busy and (pending >= want or phase is _FINISHED or waiting):
                    codec = holder.codec
                    frames = pending if pending < want else want
                    if codec is None or codec.deadline != deadline:
                        codec = _Item(request, _CODEC, deadline, frames, holder.order)
                    else:
                        codec.frames = frames  # its place in the fill order is its deadline's, not its frames'
                if stepping:
                    holder.chunk_end = chunk_end = decoded + want
                    generated_limit = decoded + max_pending
                    if codec is None and not codec_busy:
                        generated_limit = min(generated_limit, chunk_end)
                    if text_open:
                        generated_limit = min(generated_limit, request.max_frames)
                        fed_limit = request.text_ready
        holder.generated_limit, holder.fed_limit = generated_limit, fed_limit
        if paused is not holder.paused:
            holder.paused = paused
            if paused:
                self._paused[holder] = None
            else:
                self._paused.pop(holder, None)
        was_stepping, old_key = holder.stepping, holder.deadline_key
        if stepping is not was_stepping:
            holder.stepping = stepping
            self._file_stepping(holder, stepping)
        if stepping and deadline is not None:
            deadline_key = old_key if old_key is not None and old_key[0] == deadline else (deadline, holder.order)
        else:
            deadline_key = None
        if deadline_key is not old_key:
            by_deadline = self.by_deadline
            if old_key is not None:
                del by_deadline[bisect_left(by_deadline, old_key)]
            if deadline_key is not None:
                insort(by_deadline, (*deadline_key, holder))
            holder.deadline_key = deadline_key
        fresh = stepping and deadline is None  # it is in `fresh` when it was so at its last reading
        if fresh is not (was_stepping and old_key is None):
            if fresh:
                self.fresh[holder] = None
            else:
                del self.fresh[holder]
        if codec is not holder.codec:
            if holder.codec is not None:
                self._drop_codec(holder)
            if codec is not None:
                key = _codec_key(codec)
                index = bisect_left(self.codec_keys, key)
                self.codec_keys.insert(index, key)
                self.codec_items.insert(index, codec)
                holder.codec_key = key
            holder.codec = codec
        if prefill is not holder.prefill:
            if (prefill is None) != (holder.prefill is None):
                if prefill is None:
                    self._prefill.pop(holder)
                else:
                    self._prefill[holder] = None
            holder.prefill = prefill
            self._prefill_items = None

    def _file_stepping(self, holder: _Holder, stepping: bool) -> None:
        """Add the holder to the streams that can step, or take it out, in its admission order's place."""
        index = bisect_left(self._stepping_list, holder.order, key=_admission)
        if stepping:
            self._stepping_list.insert(index, holder)
            self._stepping_requests.insert(index, holder.request)
        else:
            del self._stepping_list[index]
            del self._stepping_requests[index]

    def _drop_codec(self, holder: _Holder) -> None:
        index = bisect_left(self.codec_keys, holder.codec_key)
        del self.codec_keys[index]
        del self.codec_items[index]
        holder.codec_key = None

    def _clear(self, holder: _Holder) -> None:
        if holder.stepping:
            self._file_stepping(holder, False)
        if holder.deadline_key is not None:
            del self.by_deadline[bisect_left(self.by_deadline, holder.deadline_key)]
        self.fresh.pop(holder, None)
        if holder.codec is not None:
            self._drop_codec(holder)
        if self._prefill.pop(holder, 0) is None:
            self._prefill_items = None

    # ---- what a decision reads ---------------------------------------------------------------------
    def stepping(self) -> list[RequestState]:
        """The requests that can step, in admission order."""
        return self._stepping_requests

    def prefill_items(self) -> list[_Item]:
        if self._prefill_items is None:
            self._prefill_items = [h.prefill for h in sorted(self._prefill, key=_admission)]
        return self._prefill_items


_admission = attrgetter("order")  # a holder's admission order (a C-level key)


def _codec_key(item: _Item) -> tuple:
    """A codec item's place in `_Readiness.codec_items`: `_fill_order`, then admission, which is the order a
    stable sort by `_fill_order` leaves items listed in admission order in (as they were listed before)."""
    deadline = item.deadline
    return (deadline is not None, deadline or 0.0, item.arrival, item.order)


_PLAYING = (True,)  # sorts after every codec key of a request with no audio yet, before every other


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._requests: dict[int, RequestState] = {}  # insertion order = arrival order
        self._waiting: dict[int, RequestState] = {}  # no slot yet, arrival order (resumed requests first)
        self._active: dict[int, RequestState] = {}  # holding a slot, admission (= arrival) order
        self._free_slots = list(range(self.config.max_active - 1, -1, -1))
        self._served_at = {stage: -1 for stage in Stage}
        self._decisions = 0
        self._cost = {stage: self.config.initial_stage_cost_s for stage in Stage}  # EWMA seconds per batch
        self._bulk_codec_due = False  # the last codec call was a first chunk: the next decodes in bulk
        self._readiness = _Readiness(self.config)
        # Requests given a slot and not yet prefilled, admission order (pruned as they move on): the candidates
        # of decide_between, read once per frame without a pass over every slot holder.
        self._unprefilled: dict[int, RequestState] = {}

    def observe(self, stage: Stage, seconds: float) -> None:
        """The engine reports how long a batch of `stage` took; rule 2 plans with these costs."""
        self._cost[stage] = 0.8 * self._cost[stage] + 0.2 * seconds

    def codec_lead(self) -> float:
        """How long before a playing stream runs dry its codec work must start. When it turns urgent a
        codec batch may still be in flight ahead of it (one codec call) and a generation batch may be running
        (one frame); then its own codec call runs. From the measured costs, never less than
        `codec_reserve_s`: under load these costs grow, and a fixed lead let streams run dry by a few ms
        (H200, 40 RPS: codec calls of 8-9 ms, frames of 6 ms, against a fixed 25 ms)."""
        return max(self.config.codec_reserve_s, 2 * self._cost[_CODEC] + self._cost[_FRAME])

    # ---- membership -------------------------------------------------------------------------------
    def add(self, request: RequestState) -> None:
        request.phase = Phase.WAITING
        self._requests[request.request_id] = request
        if request.resume is not None and self._waiting:
            # A resumed request's listener is in the middle of a sentence, hearing nothing: it takes the next
            # free slot before the new requests waiting (after the resumed ones). Rare, so rebuilt in place.
            waiting = self._waiting
            self._waiting = {k: r for k, r in waiting.items() if r.resume is not None}
            self._waiting[request.request_id] = request
            self._waiting.update((k, r) for k, r in waiting.items() if r.resume is None)
        else:
            self._waiting[request.request_id] = request
        self._admit()

    def remove(self, request: RequestState) -> int | None:
        """Forget a request (finished or cancelled) and free its slot at once; returns the slot."""
        self._requests.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._unprefilled.pop(request.request_id, None)
        if self._active.pop(request.request_id, None) is not None:
            self._readiness.remove(request)
        slot = request.slot
        if slot is not None:
            self._free_slots.append(slot)
            request.slot = None
            self._admit()
        return slot

    def _admit(self) -> None:
        """Slots go to waiting requests in arrival order, resumed requests first (`add`)."""
        while self._free_slots and self._waiting:
            request_id = next(iter(self._waiting))
            request = self._waiting.pop(request_id)
            request.slot = self._free_slots.pop()
            request.phase = _NEED_PREFILL
            self._active[request_id] = request
            self._unprefilled[request_id] = request
            self._readiness.admit(request)

    def changed(self, request: RequestState) -> None:
        """The engine changed `request` other than by running the batch it was in (the scheduler re-reads
        those anyway): text arrived for it, its codec batch was collected, or it finished. The scheduler
        re-reads it at the next decision; a change it is not told of is a change it does not see."""
        self._readiness.changed(request)

    @property
    def requests(self) -> list[RequestState]:
        return list(self._requests.values())

    @property
    def active(self) -> int:
        return self.config.max_active - len(self._free_slots)

    def get(self, request_id: int) -> RequestState | None:
        return self._requests.get(request_id)

    # ---- readiness --------------------------------------------------------------------------------
    def _ready(self, now: float, codec_in_flight: bool, first_chunk_lane: tuple[int, int] | None = None) -> _Ready:
        """Every piece of work ready now: at most one generation item and one codec item per request holding
        a slot, each sorted into the urgency rules it qualifies for (frame work as `_Ready` says). What each
        holder is ready for is kept by `_Readiness`; this applies the clock and the measured costs to it."""
        readiness = self._readiness
        readiness.catch_up()
        ready = _Ready(now)
        codec_lead = self.codec_lead()
        codec_limit = now + codec_lead
        pressing_limit = now + self.config.pressing_lead_s
        startup, pressing = ready.startup, ready.pressing
        prefill_items = readiness.prefill_items()
        if prefill_items:
            ready.by_stage[_PREFILL] = prefill_items
            for item in prefill_items:
                deadline = item.deadline
                if deadline is None:
                    startup.append(item)
                elif deadline <= pressing_limit:
                    pressing.append(item)
        # Codec items are in fill order: those of requests with no audio yet first, then by deadline, so
        # each rule's are a slice.
        codec_items, codec_keys = readiness.codec_items, readiness.codec_keys
        playing = bisect_left(codec_keys, _PLAYING)
        if codec_items and not codec_in_flight:
            ready.by_stage[_CODEC] = codec_items
            startup.extend(codec_items[:playing])
            ready.urgent_codec = codec_items[playing:bisect_right(codec_keys, (True, codec_limit, _NEVER))]
            pressing.extend(codec_items[playing:bisect_right(codec_keys, (True, pressing_limit, _NEVER))])
        elif codec_items and first_chunk_lane is not None:
            # The codec queue is full but the first-chunk lane is free: the first chunks it can take are ready,
            # unless a playing stream's codec work is urgent (rule 1 would go first: the lane's batch would
            # delay the queue that stream waits for).
            most, lane_frames = first_chunk_lane
            if playing == len(codec_keys) or codec_keys[playing][1] > codec_limit:
                lane_items = [it for it in codec_items[:playing] if it.frames == lane_frames]
                if lane_items:
                    ready.by_stage[_CODEC] = lane_items
                    startup.extend(lane_items)
                    ready.codec_cap = most
        frames = readiness.stepping()
        if frames:
            ready.by_stage[_FRAME] = ready.frames = frames
            # The anchor candidates of frame work; between equal deadlines the earlier admission.
            fresh = min(readiness.fresh, key=_admission) if readiness.fresh else None
            if fresh is not None:
                startup.append(_Item(fresh.request, _FRAME, None))
            by_deadline = readiness.by_deadline
            if by_deadline:
                deadline, order, earliest = by_deadline[0]
                if deadline <= pressing_limit:
                    pressing.append(_Item(earliest.request, _FRAME, deadline))
                # Rule 5 reads a stream with no audio yet as deadline 0.0.
                if fresh is None or deadline < 0.0 or (deadline == 0.0 and order < fresh.order):
                    ready.round_robin_frame = earliest.request
                else:
                    ready.round_robin_frame = fresh.request
                urgent = self._urgent_frame(by_deadline, now, codec_lead)
                if urgent is not None:
                    ready.urgent_generation.append(urgent)
            else:
                ready.round_robin_frame = fresh.request
        return ready

    def _urgent_frame(self, by_deadline: list[tuple], now: float, codec_lead: float) -> _Item | None:
        """Rule 2's anchor among the playing streams that can step: the earliest deadline whose next chunk
        cannot be ready in time unless it runs now (the frames it still lacks at the measured cost of a
        frame, then its codec call). Read in deadline order, it stops at the first such stream, or at the
        first deadline that no stream's plan reaches (a whole chunk of the largest size still to make)."""
        frame_cost = self._cost[_FRAME]
        codec_cost = self._cost[_CODEC] + codec_lead
        furthest = self._readiness.most_frames_wanted * frame_cost
        for deadline, _, holder in by_deadline:
            if deadline - furthest - codec_cost > now:
                return None
            # _late_unless_now's test, read through what the holder keeps: a dozen or more streams a decision.
            lacking = holder.chunk_end - holder.request.frames_generated
            if lacking > 0 and now >= deadline - lacking * frame_cost - codec_cost:
                return _Item(holder.request, _FRAME, deadline)
        return None

    def _frame_items(self, ready: _Ready) -> tuple[list[_Item], list[_Item]]:
        """Items for every request that can step, and those of them urgent or pressing (rules 2 and 4):
        needed only to order them when more can step than the largest bucket holds."""
        frame_cost = self._cost[_FRAME]
        codec_lead = self.codec_lead()
        codec_cost = self._cost[_CODEC] + codec_lead
        now = ready.now
        pressing_limit = now + self.config.pressing_lead_s
        items, priority = [], []
        for request in ready.frames:
            deadline = _deadline(request)
            item = _Item(request, _FRAME, deadline)
            items.append(item)
            if deadline is None:
                continue
            if _late_unless_now(request, deadline, now, frame_cost, codec_cost) or deadline <= pressing_limit:
                priority.append(item)
        return items, priority

    # ---- the decision -----------------------------------------------------------------------------
    def decide(self, now: float, codec_in_flight: bool = False,
               first_chunk_lane: tuple[int, int] | None = None) -> Batch | None:
        """The next batch, or None when nothing is ready. `codec_in_flight`: the runner takes no more codec
        batches now (as many are in flight as it queues), so no codec work is ready. A stream in a codec
        batch in flight (`codec_busy`) has no codec work either: its frames_decoded has not advanced yet, and
        if its audio is about to run out, rule 1 picks it as soon as the engine has collected that batch
        (at the start of a step, before it decides).

        `first_chunk_lane`: (most requests, frames each) of the runner's first-chunk lane while it is free
        (ModelRunner.first_chunk_lane), else None. A first chunk queued behind bulk codec batches waits for
        them (H100, 60 RPS: 7-9 ms each, two queued); the lane runs it beside them. While the queue is full
        the first chunks that fit the lane are ready codec work (rule 3 picks them); the decision is otherwise
        the one without the lane, and a codec batch it makes that fits the lane is marked for it."""
        ready = self._ready(now, codec_in_flight, first_chunk_lane)
        if not ready.by_stage:
            return None
        self._gather_arrivals(ready, now)
        if ready.urgent_codec:
            anchor = ready.urgent_codec[0]  # in fill order: the earliest deadline, then arrival, then admission
            batch = self._fill(anchor, ready, ready.urgent_codec, "urgent_codec")
        elif ready.urgent_generation:
            anchor = min(ready.urgent_generation, key=lambda it: (it.deadline, int(it.stage), it.arrival))
            batch = self._fill(anchor, ready, ready.urgent_generation, "urgent_generation")
        elif ready.startup:
            # The codec stream takes one batch at a time, and a first chunk is a small call (2 frames, most
            # often of one stream): at 60 RPS new streams came often enough that first chunks took nearly
            # every codec turn, the other streams' frames piled up undecoded to max_pending_frames and they
            # dropped out of the frames. So after a first-chunk call, a lagging codec's next turn is in bulk.
            bulk_anchor = self._bulk_codec_anchor(ready) if self._bulk_codec_due else None
            if bulk_anchor is not None:
                batch = self._fill(bulk_anchor, ready, ready.pressing, "bulk_codec", bulk=True)
            else:
                anchor = min(ready.startup, key=lambda it: (int(it.stage), it.arrival))
                batch = self._fill(anchor, ready, ready.startup, "startup")
        elif ready.pressing:
            anchor = min(ready.pressing, key=lambda it: (it.deadline, int(it.stage), it.arrival))
            batch = self._fill(anchor, ready, ready.pressing, "pressing", bulk=True)
        else:
            stage = min(ready.by_stage, key=lambda s: (self._served_at[s], _ROUND_ROBIN_ORDER.index(s)))
            if stage is _FRAME:
                request = ready.round_robin_frame
                anchor = _Item(request, _FRAME, _deadline(request))
            else:
                anchor = min(ready.by_stage[stage], key=lambda it: (it.deadline or 0.0, it.arrival, it.order))
            batch = self._fill(anchor, ready, [], "round_robin", bulk=True)
        if batch.stage is _CODEC:
            if first_chunk_lane is not None and self._fits_lane(batch, first_chunk_lane):
                batch.first_chunk_lane = True  # it takes no turn of the codec queue: bulk_codec_due stays
            else:
                self._bulk_codec_due = batch.rule == "startup"
        self._decisions += 1
        self._served_at[batch.stage] = self._decisions
        self._readiness.ran(batch)
        return batch

    @staticmethod
    def _fits_lane(batch: Batch, first_chunk_lane: tuple[int, int]) -> bool:
        most, frames = first_chunk_lane
        return (batch.frames == frames and len(batch.requests) <= most
                and all(_deadline(r) is None for r in batch.requests))

    def decide_between(self, now: float, room: int, urgent: bool = False) -> Batch | None:
        """A prefill of fresh arrivals to run inside the frame under way, between its Talker step and its
        predictor, or None. The engine asks once per frame, after taking in the requests submitted while the
        Talker step ran; the prefilled requests' predictor then runs in that frame's, so their first frame is
        out at its end. Decided between frames instead, an arrival that came during a frame's Talker step
        waited for that frame's predictor, its prefill, then a whole frame more (some 5.5 ms on the H100),
        because the next frame had already been decided without it.

        `room`: streams the predictor's batch can still take (its largest bucket less the frame's). `urgent`:
        the frame was decided for a stream about to run dry (rules 1 and 2), whose frame a prefill would delay:
        none then. The rules otherwise are rule 3's: fresh arrivals (no audio out, first come first), held for
        company under load as `_gather_arrivals` holds them."""
        if not self.config.admit_mid_frame or urgent or room <= 0 or not self._unprefilled:
            return None
        fresh: list[RequestState] = []
        for request_id, request in list(self._unprefilled.items()):
            if request.phase is not _NEED_PREFILL or request.done or request.cancelled:
                del self._unprefilled[request_id]
            elif request.playback_start is None:
                fresh.append(request)
        if not fresh or self._hold_for_company(fresh, len(self._readiness.stepping()), now):
            return None
        batch = Batch(_PREFILL, fresh[:min(room, self.config.max_batch[_PREFILL])], rule="between")
        self._decisions += 1
        self._served_at[_PREFILL] = self._decisions
        self._readiness.ran(batch)
        return batch

    def _hold_for_company(self, requests: list[RequestState], stepping: int, now: float) -> bool:
        """Whether a prefill of fresh arrivals waits for company, `stepping` streams being able to step, other
        work being ready: `_gather_arrivals`' test (the callers hold nothing when nothing else would run)."""
        config = self.config
        if len(requests) >= config.max_batch[_PREFILL]:
            return False
        resume_gather = config.resume_gather_s
        if resume_gather:
            latest = first = None
            for r in requests:
                if r.resume is not None:
                    latest = r.arrival if latest is None else max(latest, r.arrival)
                    first = r.arrival if first is None else min(first, r.arrival)
            if latest is not None and now < min(latest + resume_gather,
                                                first + max(resume_gather, config.resume_gather_most_s)):
                return True
        gather = config.prefill_gather_s
        if not gather or not stepping or stepping < config.prefill_gather_streams:
            # At light load a prefill's device time is not what limits anyone: admit at once. With no stream
            # stepping there is no frame to wait for (and nothing else to run: the decision would be empty).
            return False
        return all(now - r.arrival < gather for r in requests)

    def _gather_arrivals(self, ready: _Ready, now: float) -> None:
        """Hold a prefill of a few fresh arrivals back for one frame while other streams can step, so that
        arrivals are admitted in groups: a prefill costs about the same for 1 prompt as for 8 (H100: 2.8 ms
        for 2 x 32 positions, 3.6 ms for 8 x 32), and each is an engine step of its own."""
        items = ready.by_stage.get(_PREFILL)
        if not items or len(ready.by_stage) == 1 or not self._hold_for_company(
                [it.request for it in items], len(ready.by_stage.get(_FRAME, ())), now):
            return  # (with only prefill work ready, holding it would leave the engine idle)
        del ready.by_stage[_PREFILL]
        ready.startup = [it for it in ready.startup if it.stage is not _PREFILL]

    def _bulk_codec_anchor(self, ready: _Ready) -> _Item | None:
        """The playing stream whose codec work is due first, if the codec is falling behind: some stream
        has half of max_pending_frames generated and not decoded (at low load first chunks keep priority)."""
        lag = self.config.max_pending_frames // 2
        anchor = None
        for it in ready.by_stage.get(_CODEC, ()):  # in fill order: the first playing one is due first
            if it.deadline is None:
                continue
            if anchor is None:
                anchor = it
            request = it.request
            if request.frames_generated - request.frames_decoded >= lag:
                return anchor
        return None

    def _bulk_frames(self, items: list[_Item]) -> tuple[int, list[_Item]]:
        """Frames per stream for a codec batch that nothing urgent waits for, and the streams that can take
        it: the count that decodes the most frames in one call (count x streams that can take it, up to the
        batch cap). A stream can take F frames when F is at least its next chunk and at most what it has
        generated. One codec batch is in flight at a time and the engine launches the next only at a step
        boundary, so a call's volume is the codec's throughput: on the H100 a call of 16 streams x 12
        frames costs 88 us per stream-frame, one of 1 x 2 over 1 ms (bench/results/engine_step_h100.json).
        Streams whose audio is about to run out are not left to this: rule 1 decodes them first."""
        cap = self.config.max_batch[_CODEC]
        most = self.config.max_codec_frames
        # The least and the most frames each stream can take (`it.frames`, and what it has generated capped at
        # max_codec_frames: no count above it is a candidate), read once. This runs at every bulk codec
        # decision, over every stream with codec work (about 90 at 100 RPS), so the streams that can take each
        # count are counted in one pass, as spans opening at `least` and closing after `top` (both at least 1:
        # a stream has codec work only with frames generated and not decoded, and a chunk is a frame or more).
        opening = [0] * (most + 2)
        tops = []
        for it in items:
            request = it.request
            top = request.frames_generated - request.frames_decoded
            if top > most:
                top = most
            tops.append(top)
            least = it.frames
            if least <= top:
                opening[least] += 1
                opening[top + 1] -= 1
        takers = list(accumulate(opening))  # at each count, the streams that can take it
        best, best_volume = 0, 0
        for frames in sorted(set(tops)):
            volume = frames * min(cap, takers[frames])
            if volume >= best_volume:
                best, best_volume = frames, volume
        return best, [it for it, top in zip(items, tops) if it.frames <= best <= top]

    def _fill(self, anchor: _Item, ready: _Ready, priority: list[_Item], rule: str, bulk: bool = False) -> Batch:
        """The anchor, then compatible priority items (in fill order), then the other compatible items, up
        to the stage's batch cap. A codec batch decodes one frame count (one captured shape per count): the
        anchor's. A stream joins it when that count is at least what its next chunk wants and no more than
        it has generated, so a stream never ships a smaller chunk than its schedule says, and a stream that
        is ahead ships a larger one now instead of paying for a codec call of its own later (a codec call
        costs about the same for 1 stream as for 8)."""
        stage = anchor.stage
        cap = self.config.max_batch[stage]
        everyone = ready.by_stage[stage]
        if stage is _CODEC:
            return self._fill_codec(anchor, ready, priority, rule, bulk, cap)

        def compatible(it: _Item) -> bool:  # every frame item is compatible with every other (module doc)
            return it.stage is stage and it is not anchor

        if stage is _FRAME:
            lead = anchor.request
            if len(everyone) <= cap:
                # Every stream that can step fits: no order to decide (the anchor first, as always).
                index = everyone.index(lead)
                return Batch(stage, [lead, *everyone[:index], *everyone[index + 1:]], rule=rule)
            # More can step than the largest bucket holds: urgent and pressing ones first (`_Ready`).
            everyone, priority = self._frame_items(ready)
            anchor = next(it for it in everyone if it.request is lead)
        chosen = [anchor.request]
        urgent = [it for it in priority if compatible(it)]
        if len(urgent) + 1 < cap:
            marked = {id(it) for it in urgent}
            rest = [it for it in everyone if compatible(it) and id(it) not in marked]
            rest.sort(key=_fill_order)
        else:
            rest = []
        urgent.sort(key=_fill_order)
        for it in urgent + rest:
            if len(chosen) >= cap:
                break
            chosen.append(it.request)
        return Batch(stage, chosen, rule=rule)

    def _fill_codec(self, anchor: _Item, ready: _Ready, priority: list[_Item], rule: str, bulk: bool,
                    cap: int) -> Batch:
        """`_fill` for codec work. The codec items are listed in fill order (`_Readiness`) and a rule's share
        of them is a slice of that list, so the compatible ones are taken as they come, without a sort, and
        only until the batch is full."""
        frames = anchor.frames
        everyone = ready.by_stage[_CODEC]
        if bulk:
            # The streams that can take the bulk count are exactly those compatible with it, in fill order: the
            # rest of the batch comes from them, not from a second reading of every codec item.
            frames, everyone = self._bulk_frames(everyone)
            if anchor not in everyone:  # the most urgent of the streams that can take the bulk count
                anchor = everyone[0]
        if ready.codec_cap is not None:
            cap = min(cap, ready.codec_cap)
        chosen = [anchor.request]
        taken = {id(anchor)}
        # The rule's candidates first (they may hold other stages' items), then the rest; the cheapest test first.
        for it in chain(priority, everyone):
            if len(chosen) >= cap:
                break
            if it.frames <= frames and it.stage is _CODEC and id(it) not in taken:
                request = it.request
                if frames <= request.frames_generated - request.frames_decoded:
                    chosen.append(request)
                    taken.add(id(it))
        return Batch(_CODEC, chosen, frames=frames, rule=rule)
