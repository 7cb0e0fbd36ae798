"""One request's state inside the engine: generation phase, frames, chunks, playback deadline, buffering.

Everything here is owned by the engine thread, except the two counters of `OutputAccounting` that the
consumer (the asyncio side) advances as it takes audio; reading a Python int written by another thread is
atomic under the GIL, and the engine only ever compares it, so no lock is needed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CHUNK_SCHEDULE: tuple[int, ...] = (2, 4, 8, 12)


class Stage(enum.IntEnum):
    """Kinds of work. The integer is the startup rank: for a request with no audio yet, finishing a
    nearly-ready first chunk outranks admitting new prefills, which outrank frames.

    FRAME is one whole frame for every stream in it: the Talker step of the streams that need one, then the
    code-predictor loop of all of them (a stream just prefilled has its codebook 0 already and only
    predicts). It is one stage, not two, so that every stream that can step is in the same step: run as two
    kinds of batch, the streams split into two cohorts half a frame apart, and each batch carried only one."""

    CODEC = 0
    PREFILL = 1
    FRAME = 2


class Phase(enum.Enum):
    """Where a request's generation stands (codec work runs beside it, on frames already made)."""

    WAITING = "waiting"  # admitted to the engine, no KV slot yet
    NEED_PREFILL = "need_prefill"  # has a slot; the prompt has not been run
    NEED_CODE_PREDICT = "need_code_predict"  # prefilled: codebook 0 of frame 0 is sampled, its residuals are not
    NEED_DECODE = "need_decode"  # the last frame is complete; the Talker must step to the next one
    FINISHED = "finished"  # EOS sampled or the frame cap reached; codec work may remain


def validate_schedule(schedule: tuple[int, ...]) -> tuple[int, ...]:
    schedule = tuple(int(x) for x in schedule)
    if not schedule or any(x < 1 or x > 64 for x in schedule):
        raise ValueError(f"chunk schedule must be 1..64 frames per chunk, got {schedule}")
    return schedule


def quick_start_schedule(schedule: tuple[int, ...]) -> tuple[int, ...]:
    """`schedule` with its first chunk split into one frame and the rest of it (2, 4, 8 -> 1, 1, 4, 8): the
    first audio comes a frame sooner, and every chunk boundary of `schedule` is still one, so the chunks after
    any of them are the same chunks (a resumed request goes on in the calls the uninterrupted one made, whichever
    of the two it started with)."""
    if schedule[0] == 1:
        return schedule
    # The last size repeats: a one-size schedule keeps repeating its size, not the remainder.
    return (1, schedule[0] - 1, *(schedule[1:] or schedule))


def schedule_pieces(schedule: tuple[int, ...], frames: int) -> list[int]:
    """The codec calls a chunk schedule makes of `frames` frames: its sizes in turn, the last repeated, the
    final call what is left."""
    pieces: list[int] = []
    done = 0
    while done < frames:
        size = min(schedule[min(len(pieces), len(schedule) - 1)], frames - done)
        pieces.append(size)
        done += size
    return pieces


class OutputAccounting:
    """Audio handed to the consumer vs audio it has taken: the difference is what is buffered."""

    __slots__ = ("emitted_samples", "consumed_samples")

    def __init__(self) -> None:
        self.emitted_samples = 0  # advanced by the engine thread
        self.consumed_samples = 0  # advanced by the consumer

    @property
    def buffered_samples(self) -> int:
        return self.emitted_samples - self.consumed_samples


@dataclass(eq=False, slots=True)
class RequestState:
    """One request. `prompt` is opaque to the scheduler: the model runner knows what it holds."""

    request_id: int
    prompt: Any
    seed: int | None  # per-request sampling seed; None draws one
    max_frames: int
    chunk_schedule: tuple[int, ...]
    arrival: float  # monotonic seconds when the engine accepted it (admission order)
    sample_rate: int
    samples_per_frame: int
    output: OutputAccounting = field(default_factory=OutputAccounting)

    phase: Phase = Phase.WAITING
    slot: int | None = None
    cancelled: bool = False
    frames_generated: int = 0  # complete frames (all 16 codebooks)
    frames_decoded: int = 0  # frames the codec has turned into PCM
    chunks_decoded: int = 0  # codec calls that shipped audio, for the chunk schedule
    playback_start: float | None = None  # when the first audio left the engine (moved on after a text wait)
    done: bool = False
    codec_busy: bool = False  # in a codec batch launched and not yet collected (its slot is held until then)
    # Text streaming: the text is still being written. Each Talker decode step takes one text token (the
    # runner holds them); `text_ready` counts those it holds, `text_fed` those the steps took. While the text
    # is open the step after the last ready token cannot run: the request waits for text.
    text_open: bool = False
    text_ready: int = 0
    text_fed: int = 0
    text_wait_since: float | None = None  # engine clock when its wait for text began (None: not waiting)
    text_waited: bool = False  # it waited for text since it last shipped audio
    # Resume from codes: what the runner continues this request after (opaque here; the Qwen3 runner takes
    # the delivered frames' codes), None for a request from its start.
    resume: Any = None
    held_codes: bytes = b""  # codes of frames whose audio the leading-silence trimmer held or dropped

    @property
    def waiting_for_text(self) -> bool:
        """Its next Talker step needs a text token that has not come (or its frame cap may still grow)."""
        return self.text_open and self.phase is Phase.NEED_DECODE and (
            self.text_fed >= self.text_ready or self.frames_generated >= self.max_frames)

    @property
    def pending_frames(self) -> int:
        return self.frames_generated - self.frames_decoded

    @property
    def next_chunk_frames(self) -> int:
        """The frames of its next chunk: the chunk schedule grows, then repeats its last size."""
        schedule, chunks = self.chunk_schedule, self.chunks_decoded
        return schedule[chunks] if chunks < len(schedule) else schedule[-1]

    @property
    def playing(self) -> bool:
        return self.playback_start is not None
