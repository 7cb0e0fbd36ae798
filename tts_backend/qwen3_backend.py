"""The Qwen3-TTS backend: our model under our serving engine, behind the gateway's one interface.

`voxgate serve --backend qwen3 --model PATH [--device cuda]` builds this. start() loads the checkpoint,
allocates the KV slots and captures the CUDA graphs on the engine thread; `ready` turns true only after
that (and a warm-up request) are done.

With `-o aligner=PATH` (a Qwen3-ForcedAligner checkpoint folder) it also times the words of a request that asks
for them (`word_timestamps`): the audio streams out as usual, and once the sentence's last chunk has gone, the
sentence is aligned (batched with the other sentences finishing then, in a process of its own, see
tts_backend/aligner/process.py) and the words come in one more chunk with no audio. The first audio is never
held for them.

A Base checkpoint (Qwen3-TTS-12Hz-1.7B-Base, 0.6B-Base) speaks only in cloned voices: `clone_voice` turns
reference audio into a voice prompt (qwen3/prompt.py VoicePrompt: x-vector, reference codes, reference text ids,
stamped with the checkpoint's identity), computed once, and every request carries it as `voice_prompt`.

Text streaming (base.py's module doc): a request with a `text_stream` runs in streaming-text mode, whose
Talker takes one text token per frame, so it can start at the first word. Its tokens go to the engine as they
settle (TextTokenizer.settled_text_ids: never a token that more text could change, so they are the whole
text's tokens), then tts_eos once the text is finished; a stream that has used every token it has waits for
text outside the engine's batches (engine/scheduler.py). Before the first token settles (for an in-context
clone: enough text to fill its prefill, as the whole text would) the request waits here, holding no slot.
`streaming_text` chooses the text mode of a whole-text request; the server's `-o streaming_text` is the
default.

Resume from codes (base.py): each chunk carries the codes of the frames its codec batch decoded (16 codebooks,
12.5 frames a second), and a request with `resume_codes` goes on after those frames in whatever batch it lands
in (engine/runner.py Qwen3ModelRunner._resume). Only with a sampler that can continue a request's draws at any
step (the stateless one, or greedy decoding): the reference sampler's generators cannot be rebuilt from codes,
so with it the backend tells no codes and has no "resume_codes" in `honours`. A resumed request's word timings
keep the sentence's time base: the aligner hears the delivered frames' audio, decoded again from their codes,
before the resumed audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import math
import time
from collections.abc import AsyncIterator

from .base import (
    AudioChunk,
    check_codes,
    BackendMetric,
    BackendOverloadedError,
    InvalidReferenceAudioError,
    InvalidVoicePromptError,
    ReferenceAudio,
    SynthesisError,
    SynthesisRequest,
    Synthesizer,
    UnknownVoiceError,
    Voice,
    VoiceCloningUnsupportedError,
    WordTiming,
    split_words,
)

log = logging.getLogger(__name__)

# ISO codes the gateway may pass -> the model's language names.
_LANGUAGE_CODES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ja": "japanese", "fr": "french",
    "ko": "korean", "ru": "russian", "it": "italian", "pt": "portuguese",
}
_SPEAKER_LANGUAGE = {"ryan": "en", "aiden": "en", "ono_anna": "ja", "sohee": "ko"}  # others are Chinese voices
_VOICE_DESIGN_VOICE = "designed"
_CLONE_VOICE = "cloned"  # a Base checkpoint's one listed voice: it names requests that carry a voice prompt
_MAX_WAITING_CLONES = 8  # clone_voice calls queued behind the one running; more are refused as overloaded


def _checkpoint_type(model: str) -> str | None:
    """tts_model_type of a checkpoint folder's config.json, or None when it cannot be read (start() then
    reports the folder's problem properly)."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(model) / "config.json").read_text(encoding="utf-8")).get("tts_model_type")
    except (OSError, ValueError, AttributeError):
        return None


def scheduler_config(runner, max_active: int, chunk_schedule: tuple[int, ...]):
    """The engine's scheduler settings for `runner` (a Qwen3ModelRunner, or a stand-in with its buckets and
    config: bench/engine_sim.py): prefill and codec batches up to the largest captured bucket, frames up to every
    slot, generation held back before it outruns the frame ring, codec calls up to the captured frame counts."""
    from .engine.request import Stage
    from .engine.scheduler import SchedulerConfig

    return SchedulerConfig(
        max_active=max_active,
        max_batch={Stage.PREFILL: max(runner.prefill_buckets), Stage.FRAME: max_active,
                   Stage.CODEC: max(runner.codec_buckets)},
        max_pending_frames=runner.config.frame_ring - max(chunk_schedule),
        max_codec_frames=max(runner.config.codec_frames),
    )


def _scheduler_options(options: dict | None) -> dict:
    """Overrides of the scheduler's policy settings (SchedulerConfig's numeric and true/false fields, e.g.
    `-o scheduler_options='{"prefill_gather_s": 0.02, "admit_mid_frame": false}'`), checked here so a misspelt
    one fails at start-up; the slots, batch caps and frame counts follow the runner (scheduler_config) and are
    not among them."""
    from .engine.scheduler import SchedulerConfig

    options = dict(options or {})
    fields = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
    allowed = set(fields) - {"max_active", "max_batch", "max_codec_frames"}
    for name, value in options.items():
        if name not in allowed:
            raise SynthesisError(f"scheduler_options: {name!r} is not one of {sorted(allowed)}")
        if fields[name].type in ("bool", bool):
            if not isinstance(value, bool):
                raise SynthesisError(f"scheduler_options: {name} must be true or false, not {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SynthesisError(f"scheduler_options: {name} must be a number, not {value!r}")
    return options


def frame_cap(text: str, prompt_len: int, max_new_tokens: int, chars_per_second: float | None, max_len: int) -> int:
    """A request's frame cap: max_new_tokens sampled codebook-0 tokens give max_new_tokens - 1 frames (the last
    is EOS or the cap); with `chars_per_second` no more than the text takes at that speaking rate (random
    weights never sample EOS); and what the slot's max_len positions leave after the prompt."""
    frames = max(1, max_new_tokens - 1)
    if chars_per_second:
        frames = min(frames, max(2, math.ceil(len(text.strip()) / chars_per_second * 12.5)))
    return min(frames, max_len - prompt_len - 1)


class Qwen3Synthesizer(Synthesizer):
    """Qwen3-TTS 12 Hz (CustomVoice, VoiceDesign or Base) served by the batched engine.

    model: checkpoint folder. device: "cuda", "cuda:0", "cpu" (default: cuda when available).
    max_active: concurrent requests holding KV slots. max_len: Talker positions per slot.
    cuda_graphs: capture every steady-state shape at start-up (GPU only).
    sampler: "auto", "reference" or "stateless" (see engine/runner.py). greedy: argmax decoding.
    streaming_text: feed the text one token per frame (fixed 10-position prefill) instead of all at once; the
      default of requests that do not choose (SynthesisRequest.streaming_text).
    chunk_schedule: default frames per codec chunk. max_new_tokens: cap on sampled codebook-0 tokens.
    quick_start_below: while fewer requests than this are in the engine, one that names no chunk schedule ships
      its first frame alone, a frame sooner (EngineConfig.quick_start_below, whose default this repeats: importing the engine here would import torch); 0:
      never.
    frame_cap_chars_per_second: for random-weight checkpoints, whose EOS never comes naturally: cap each
      request at the frames its text takes at this speaking rate (bench/README.md: 15 characters/s).
    warmup: run one request through every stage before reporting ready.
    warmup_resumes: then this many requests resumed together from the warm-up request's codes (resume from
      codes: a failover's survivor resumes its streams all at once, and the first such call in a process paid
      its first launches there: H100, 4 streams resumed in 33 ms the first time, 12 ms the next). "auto": as
      many as the resume pass's largest captured batch on a GPU, none on the CPU (where nothing is launched).
    aligner: a Qwen3-ForcedAligner checkpoint folder; when given, requests may ask for word timestamps.
    aligner_max_batch: sentences aligned in one forward pass at most.
    aligner_gather_s: how long an aligner pass waits after its first sentence for more (up to aligner_max_batch):
      fewer, fuller passes for words that much later (default 50 ms; 0: a pass takes what is queued). A
      captured pass costs nearly as much for one sentence as for four, and its device time is the engine's: on
      the H100 at 40 requests/s, gathering took the aligner from 1.7 to 3.6 sentences a pass and the p95 first
      audio from 45.3 to 37.7 ms (bench/results/clones_timestamps_h100.md, fifth session).
    aligner_process: run the aligner in a process of its own (aligner/process.py), so that it never holds the
      interpreter the engine thread needs, and an aligner crash costs words only; false (the default): on a
      thread of this process (aligner/batcher.py), whose kernels share the engine's CUDA context instead of
      time-slicing with it: on the H100, p95 first audio 26.4 / 37.7 ms at 20 / 40 requests/s on a thread
      against 26.4 / 42.5 in a process (both gathering). Either way it is captured in CUDA graphs on a GPU.
    """

    name = "qwen3"
    honours = frozenset({"language", "instructions", "max_new_tokens", "chunk_schedule", "seed", "text_mode",
                         "text_streaming"})

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str = "bfloat16",
        max_active: int = 64,
        max_len: int = 2048,
        cuda_graphs: bool = True,
        sampler: str = "auto",
        greedy: bool = False,
        streaming_text: bool = False,
        chunk_schedule: tuple[int, ...] | list[int] = (2, 4, 8, 12),
        quick_start_below: int = 16,
        max_new_tokens: int | None = None,
        frame_cap_chars_per_second: float | None = None,
        max_queued: int = 256,
        warmup: bool = True,
        warmup_resumes: int | str = "auto",
        trim_leading_silence: bool = True,
        runner_options: dict | None = None,
        scheduler_options: dict | None = None,
        aligner: str | None = None,
        aligner_max_batch: int = 16,
        aligner_gather_s: float = 0.05,
        aligner_process: bool = False,
    ) -> None:
        if not model:
            raise SynthesisError("the qwen3 backend needs --model PATH (a Qwen3-TTS checkpoint folder)")
        if importlib.util.find_spec("torch") is None:
            raise SynthesisError("the qwen3 backend needs torch, which is not installed: pip install -e '.[qwen3]'"
                                 " (on a GPU host, install the CUDA build of torch first)")
        self.model_path = model
        self.device = device
        self.dtype = dtype
        self.max_active = int(max_active)
        self.max_len = int(max_len)
        self.cuda_graphs = bool(cuda_graphs)
        self.sampler = sampler
        self.greedy = bool(greedy)
        self.streaming_text = bool(streaming_text)
        self.chunk_schedule = tuple(chunk_schedule)
        self.quick_start_below = int(quick_start_below)
        self.max_new_tokens = max_new_tokens
        self.frame_cap_chars_per_second = frame_cap_chars_per_second
        self.max_queued = int(max_queued)
        self.warmup = bool(warmup)
        if warmup_resumes != "auto" and (isinstance(warmup_resumes, bool) or not isinstance(warmup_resumes, int)
                                         or warmup_resumes < 0):
            raise SynthesisError(f"warmup_resumes must be a whole number >= 0 or \"auto\", not {warmup_resumes!r}")
        self.warmup_resumes = warmup_resumes
        self.trim_leading_silence = bool(trim_leading_silence)
        self.runner_options = dict(runner_options or {})
        self.scheduler_options = _scheduler_options(scheduler_options)
        self.aligner_path = aligner
        self.aligner_max_batch = int(aligner_max_batch)
        self.aligner_gather_s = float(aligner_gather_s)
        self.aligner_process = bool(aligner_process)
        self.aligner_batcher = None
        if aligner:
            self.honours = self.honours | {"word_timestamps"}
        if _checkpoint_type(model) == "base":
            self.honours = self.honours | {"voice_cloning"}
            self.speaks_only_clones = True
        self._clone_lock: asyncio.Lock | None = None
        self._clone_stream = None  # torch.cuda.Stream for clone_voice, made on first use on a GPU
        self._clones_waiting = 0
        self.model = None
        self.engine = None
        self._voices: list[Voice] = []
        self._ready = False
        self._warming = False  # the start-up warm-up request is running: synthesize() accepts it unready

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _load_model(self) -> None:
        import torch

        from .qwen3.generate import Qwen3TTS

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        aligner_process = None
        if self.aligner_path and self.aligner_process:
            from .aligner.process import AlignerProcess

            # Started first: it loads and captures its model while this process loads the speech model.
            aligner_process = AlignerProcess(self.aligner_path, device, self.dtype, self.aligner_max_batch,
                                             gather_s=self.aligner_gather_s)
        try:
            self.model = Qwen3TTS.from_pretrained(self.model_path, device=device, dtype=getattr(torch, self.dtype))
            if aligner_process is not None:
                aligner_process.wait_ready()
        except BaseException:
            if aligner_process is not None:
                aligner_process.close()
            raise
        self.aligner_batcher = aligner_process
        if self.aligner_path and not self.aligner_process:
            from .aligner.batcher import AlignmentBatcher
            from .aligner.loader import load_aligner

            aligner = load_aligner(self.aligner_path, device=device, dtype=getattr(torch, self.dtype))
            aligner.capture(self.aligner_max_batch)  # before the engine runs: nothing else is on the device yet
            self.aligner_batcher = AlignmentBatcher(aligner, self.aligner_max_batch, self.aligner_gather_s)

    def _build(self) -> None:
        from .engine.engine import Engine, EngineConfig
        from .engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig

        runner = Qwen3ModelRunner(self.model, Qwen3RunnerConfig(
            max_slots=self.max_active, max_len=self.max_len, cuda_graphs=self.cuda_graphs, sampler=self.sampler,
            greedy=self.greedy, **self.runner_options,
        ))
        self.engine = Engine(runner, EngineConfig(
            scheduler=dataclasses.replace(scheduler_config(runner, self.max_active, self.chunk_schedule),
                                          **self.scheduler_options),
            max_queued=self.max_queued, chunk_schedule=self.chunk_schedule,
            quick_start_below=self.quick_start_below, trim_leading_silence=self.trim_leading_silence,
        ))
        config = self.model.config
        if config.tts_model_type == "base":
            self._voices = [Voice(id=_CLONE_VOICE, name="cloned", language="en",
                                  description="Qwen3-TTS Base: speaks in voices cloned from reference audio")]
            self.honours = self.honours | {"voice_cloning"}
            self.speaks_only_clones = True
        elif config.supported_speakers:
            self._voices = [
                Voice(id=s, name=s, language=_SPEAKER_LANGUAGE.get(s, "zh"), description="Qwen3-TTS CustomVoice speaker")
                for s in config.supported_speakers
            ]
        else:
            self._voices = [Voice(id=_VOICE_DESIGN_VOICE, name="designed", language="en",
                                  description="Qwen3-TTS VoiceDesign: describe the voice in the instructions")]
            self.honours = self.honours | {"voice_design"}
        if runner.can_resume:
            self.honours = self.honours | {"resume_codes"}
            self.codebooks = self.model.num_code_groups
            self.frame_rate = runner.sample_rate / runner.samples_per_frame
        else:
            self.honours = self.honours - {"resume_codes"}
            self.codebooks, self.frame_rate = 0, 0.0

    async def start(self) -> None:
        # Each phase's time in the log: start-up is a target of its own (issue 29), and which phase grew is
        # what a slower start needs to show.
        started = time.perf_counter()
        await asyncio.to_thread(self._load_model)
        loaded = time.perf_counter()
        log.info("start-up: model loaded in %.1f s", loaded - started)
        await asyncio.to_thread(self._build)
        self.engine.start()
        try:
            await asyncio.to_thread(self.engine.wait_ready)
        except SynthesisError:
            if not self.engine.runner.fused or "fused" in self.runner_options:
                raise
            # The compiled fast path failed to build on this machine: serve with the plain modules
            # (slower, same results) rather than not at all, and say so in the log.
            log.exception("fused fast path failed at start-up; falling back to the plain model modules")
            await asyncio.to_thread(self.engine.stop)
            self.engine = None
            self.runner_options["fused"] = False
            await asyncio.to_thread(self._build)
            self.engine.start()
            await asyncio.to_thread(self.engine.wait_ready)
        prepared = time.perf_counter()
        log.info("start-up: engine prepared (fast path, kernel check, captured graphs) in %.1f s", prepared - loaded)
        if self.warmup:
            # One short request through every stage (and the first-chunk path) before we say ready.
            warm = SynthesisRequest(text="Warm up.", voice=self.default_voice, seed=0, max_new_tokens=8,
                                    instructions=None if self._voices[0].id != _VOICE_DESIGN_VOICE else "A calm voice.",
                                    voice_prompt=await self._warm_up_voice() if self.can_clone else None)
            # Through synthesize() itself, while `ready` (and so the gateway's /ready) still says no: traffic
            # must not arrive before the warm-up has run.
            self._warming = True
            try:
                codes = bytearray()
                async for chunk in self.synthesize(warm):
                    codes += chunk.codes
                log.info("start-up: warm-up request in %.1f s", time.perf_counter() - prepared)
                resumes = self._warm_up_resume_count()
                if resumes and codes:
                    warmed = time.perf_counter()
                    try:
                        await self._warm_up_resumes(warm, bytes(codes), resumes)
                    except SynthesisError:
                        # What it saves is the first failover's pause: not a reason not to serve.
                        log.exception("start-up: the warm-up resumes failed; serving without them")
                    else:
                        log.info("start-up: %d warm-up requests resumed from its codes in %.1f s", resumes,
                                 time.perf_counter() - warmed)
            finally:
                self._warming = False
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.aligner_batcher is not None:
            await asyncio.to_thread(self.aligner_batcher.close)
            self.aligner_batcher = None

    @property
    def ready(self) -> bool:
        return self._ready and self.engine is not None and self.engine.ready

    def voices(self) -> list[Voice]:
        return list(self._voices)

    def load(self) -> float:
        return self.engine.load() if self.engine is not None else 1.0

    def capacity(self) -> int | None:
        return self.max_active

    def queued(self) -> int:
        return self.engine.waiting() if self.engine is not None else 0

    async def metrics(self) -> list[BackendMetric]:
        if self.engine is None:
            return []
        from .engine.metrics import engine_metrics

        runner = self.engine.runner
        families = engine_metrics(self.engine.stats_snapshot(), runner.fast_path(), runner.kernel_check,
                                  runner.voice_kv_stats(), runner.uncaptured_passes())
        batcher = self.aligner_batcher
        if batcher is not None:
            families += [
                BackendMetric("aligner_batches", "counter", "Forced-aligner forward passes (word timestamps)",
                              samples=(((), float(batcher.batches)),)),
                BackendMetric("aligner_sentences", "counter", "Sentences aligned for word timestamps",
                              samples=(((), float(batcher.sentences)),)),
                BackendMetric("aligner_seconds", "counter", "Wall seconds of the aligner's forward passes",
                              samples=(((), batcher.seconds),)),
                BackendMetric("aligner_restarts", "counter", "Aligner processes started again after one died",
                              samples=(((), float(batcher.restarts)),)),
            ]
        return families

    def _warm_up_resume_count(self) -> int:
        if "resume_codes" not in self.honours:
            return 0
        count = self.warmup_resumes
        if count == "auto":
            runner = self.engine.runner
            count = max(runner.resume_shapes, default=0) if runner.device.type == "cuda" else 0
        return min(count, self.max_active)

    async def _warm_up_resumes(self, warm: SynthesisRequest, codes: bytes, count: int) -> None:
        """`count` requests resumed from the warm-up request's codes at once, cut after 1, 2, ... of its frames
        (the company a failover's survivor resumes: the resume pass, the codec's priming and the batch sizes
        after it, at a size that needs them), each to the warm-up's own end."""
        frame_bytes = 2 * self.codebooks
        frames = len(codes) // frame_bytes

        async def drain(request: SynthesisRequest) -> None:
            async for _ in self.synthesize(request):
                pass

        await asyncio.gather(*(drain(dataclasses.replace(warm, resume_codes=codes[: (1 + i % frames) * frame_bytes]))
                               for i in range(count)))

    # ---- voice cloning ------------------------------------------------------------------------------
    async def _warm_up_voice(self) -> bytes:
        """An in-context voice from one second of a 150 Hz tone, so the warm-up runs the speaker encoder, the
        codec encoder and the reference-frame prefill too."""
        import numpy as np

        t = np.arange(24000, dtype=np.float32) / 24000
        tone = (0.3 * np.sin(2 * np.pi * 150 * t)).astype("<f4")
        return await self.clone_voice(ReferenceAudio(tone.tobytes(), "Warm up."), x_vector_only=False)

    async def clone_voice(self, reference: ReferenceAudio, x_vector_only: bool = False) -> bytes:
        if not self.can_clone:
            raise VoiceCloningUnsupportedError(
                f"the qwen3 backend's checkpoint ({self.model_path}) cannot clone voices; it needs a Base checkpoint")
        if self.model is None:
            raise SynthesisError("the qwen3 backend is not started")
        # One clone at a time: each runs two encoders over up to tens of seconds of audio, off the event loop.
        if self._clone_lock is None:
            self._clone_lock = asyncio.Lock()
        if self._clones_waiting >= _MAX_WAITING_CLONES:
            raise BackendOverloadedError("too many voices are being cloned at once; try again shortly")
        self._clones_waiting += 1
        try:
            async with self._clone_lock:
                return await asyncio.to_thread(self._clone, reference, x_vector_only)
        finally:
            self._clones_waiting -= 1

    def _clone(self, reference: ReferenceAudio, x_vector_only: bool) -> bytes:
        import numpy as np
        import torch

        from .qwen3.prompt import PromptError

        samples = np.frombuffer(reference.samples, "<f4")
        if len(samples) < 2400:  # the speaker encoder's log-mel needs a few frames; the gateway bounds it anyway
            raise InvalidReferenceAudioError(f"reference audio of {len(samples) / 24000:.3f} s is too short")
        if not np.isfinite(samples).all():
            raise InvalidReferenceAudioError("reference audio holds NaN or infinite samples")
        if not np.abs(samples).max() > 0:
            raise InvalidReferenceAudioError("reference audio is silent")
        # On a GPU, a CUDA stream of its own (as the aligner's): the encoders' kernels then overlap the engine's
        # steps instead of queueing among them. clone_prompt returns host tensors, so its work is done on return.
        if self._clone_stream is None and self.model.device.type == "cuda":
            self._clone_stream = torch.cuda.Stream(self.model.device)
        try:
            with torch.cuda.stream(self._clone_stream) if self._clone_stream is not None else contextlib.nullcontext():
                voice = self.model.clone_prompt(torch.from_numpy(samples.copy()), reference.ref_text, x_vector_only)
        except PromptError as exc:
            raise InvalidReferenceAudioError(str(exc)) from exc
        return voice.to_bytes(self.model.identity)

    def _voice_prompt(self, request: SynthesisRequest):
        """The request's VoicePrompt, or None for a preset voice; refuses what this checkpoint cannot speak."""
        from .qwen3.prompt import PromptError, VoicePrompt

        if request.voice_prompt is None:
            if self.can_clone:
                raise SynthesisError("this qwen3 checkpoint (Base) speaks only in cloned voices: register one "
                                     "(voice.add) or send ref_audio")
            return None
        if not self.can_clone:
            raise VoiceCloningUnsupportedError("the qwen3 backend's checkpoint cannot speak with a cloned voice; "
                                               "it needs a Base checkpoint")
        try:
            return VoicePrompt.from_bytes(request.voice_prompt, self.model.identity)
        except PromptError as exc:
            raise InvalidVoicePromptError(str(exc)) from exc

    # ---- requests -----------------------------------------------------------------------------------
    def _language(self, language: str | None) -> str:
        lang = (language or "auto").lower()
        return _LANGUAGE_CODES.get(lang.split("-")[0], lang) if lang != "auto" else "auto"

    def _max_frames(self, request: SynthesisRequest, prompt_len: int, text: str) -> int:
        max_new = request.max_new_tokens or self.max_new_tokens or self.model.generation_config.max_new_tokens
        return frame_cap(text, prompt_len, max_new, self.frame_cap_chars_per_second, self.max_len)

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        from .qwen3.prompt import PromptError

        if not (self.ready or (self._warming and self.engine is not None and self.engine.ready)):
            raise SynthesisError("the qwen3 backend is not ready")
        self.refuse_resume_codes(request)
        voice = self._voice_prompt(request)
        resume_frames = len(request.resume_codes) // (2 * self.codebooks) if request.resume_codes else 0
        if voice is None and not self.has_voice(request.voice):
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        text_stream = request.text_stream
        ids = None  # the text's ids, when only part of the text has come (else make_prompt tokenises it)
        if text_stream is not None:
            # Before the engine: no slot is held while the first words are awaited.
            ids = await self._first_text_ids(text_stream, voice, resume_frames)
            if ids is None:  # finished before the prefill's tokens came: a whole text, in streaming-text mode
                text_stream = None
        text = request.full_text
        if not text.strip():
            raise SynthesisError("text is empty")
        if request.text_stream is not None:
            streaming_text = True  # the text comes one token per frame: the only mode that can take it growing
        else:
            streaming_text = self.streaming_text if request.streaming_text is None else bool(request.streaming_text)
        speaker = None if voice is not None or request.voice == _VOICE_DESIGN_VOICE else request.voice
        try:
            prompt = self.model.make_prompt(
                text, speaker=speaker, language=self._language(request.language),
                instruct=None if voice is not None else request.instructions,
                non_streaming_mode=not streaming_text, voice=voice,
                text_complete=text_stream is None, text_ids=ids,
            )
        except PromptError as exc:
            raise SynthesisError(str(exc)) from exc
        # Refuse here what the runner cannot hold, so one oversized request never fails a batch of others.
        if len(prompt) + 2 > self.max_len:
            raise SynthesisError(f"text too long: its prompt needs {len(prompt)} positions; this server holds "
                                 f"{self.max_len} per request (max_len)")
        trailing_capacity = self.engine.runner.config.trailing_capacity
        if len(prompt.trailing) > trailing_capacity:
            raise SynthesisError(f"text too long for streaming-text mode: {len(prompt.trailing)} tokens, at most "
                                 f"{trailing_capacity}")
        max_frames = self._max_frames(request, len(prompt), text)
        resume = self._resume_codes(request, max_frames) if resume_frames else None
        if resume_frames >= max_frames and text_stream is None:
            return  # the delivered frames were all the request makes: nothing follows them
        try:
            stream = self.engine.submit(
                prompt, seed=request.seed, max_frames=max_frames, chunk_schedule=request.chunk_schedule,
                text_tokens=len(prompt.trailing) if text_stream is not None else None,
                resume=resume, resume_frames=resume_frames,
            )
        except ValueError as exc:  # e.g. a chunk schedule outside 1..64 frames
            raise SynthesisError(str(exc)) from exc
        feeder = None
        if text_stream is not None:
            feeder = asyncio.ensure_future(self._feed_text(stream, text_stream, ids, len(prompt.trailing),
                                                           request, len(prompt)))
        timed = request.word_timestamps and self.aligner_batcher is not None
        with_codes = self.codebooks > 0
        audio = bytearray()
        try:
            async for pcm, codes in stream.chunks():
                if timed:
                    audio += pcm
                if pcm or (codes and with_codes):
                    yield AudioChunk(pcm, codes=codes if with_codes else b"")
        finally:
            stream.cancel()  # frees the slot at once if the consumer left early; no-op once finished
            if feeder is not None:
                feeder.cancel()
        if timed:
            yield AudioChunk(b"", audio_ended=True)  # the aligner's wait is the caller's to bound (base.py)
            if resume is not None:  # words keep the sentence's time base: align the delivered audio too
                audio[:0] = await asyncio.to_thread(self._delivered_audio, resume, request.chunk_schedule)
            yield AudioChunk(b"", words=await self._word_timings(request.full_text, bytes(audio)))

    def _resume_codes(self, request: SynthesisRequest, max_frames: int):
        """The delivered frames of a resumed request as a [k, 16] tensor of codes, once they are shown to be
        whole frames within what the text can produce (base.check_codes), codes the codec has, and no more
        frames than the request makes."""
        import numpy as np
        import torch

        codes = request.resume_codes
        check_codes(codes, self.codebooks, self.max_code_bytes(len(request.full_text)), "resume codes")
        frames = np.frombuffer(codes, "<u2").reshape(-1, self.codebooks)
        codebook_size = self.model.config.talker.codebook_size
        if int(frames.max()) >= codebook_size:
            raise SynthesisError(f"resume codes: a code of {int(frames.max())}, past the codec's {codebook_size}")
        if len(frames) > max_frames and request.text_stream is None:
            raise SynthesisError(f"resume codes: {len(frames)} frames, more than this request makes ({max_frames})")
        return torch.from_numpy(frames.astype(np.int64))

    def _delivered_audio(self, frames, chunk_schedule: tuple[int, ...] | None) -> bytes:
        """The audio a resumed request's delivered frames made, as the uninterrupted request shipped it, for its
        word timings: the codec over them from a fresh state in its chunk schedule's calls (the engine's on the
        CPU, so the same samples there), the leading silence trimmed as the engine trims it. Off the event loop;
        on a GPU on a stream of its own, as clone_voice's encoders run."""
        import numpy as np
        import torch

        from .engine.request import schedule_pieces
        from .engine.silence import LeadingSilenceTrimmer

        engine = self.engine
        codec = self.model.codec
        schedule = chunk_schedule or engine.config.chunk_schedule
        device = self.model.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pieces = []
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            state = codec.init_state(1, device=device)
            codes = frames.to(device).clamp(0, self.model.config.talker.codebook_size - 1).T[None].contiguous()
            start = 0
            for n in schedule_pieces(tuple(schedule), codes.shape[2]):
                pieces.append(codec.decode_chunk(codes[..., start: start + n], state)[0].float().cpu().numpy())
                start += n
        if not pieces:
            return b""
        pcm = np.concatenate(pieces)
        if engine.config.trim_leading_silence:
            trimmer = LeadingSilenceTrimmer(self.sample_rate, engine.config.silence_threshold_dbfs)
            shipped = [trimmer.push(piece) for piece in pieces]
            pcm = np.concatenate(shipped) if trimmer.started else trimmer.flush()
        return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    # ---- text streaming -----------------------------------------------------------------------------
    async def _first_text_ids(self, text_stream, voice, resume_frames: int = 0) -> list[int] | None:
        """The settled ids of a growing text once there are enough for the prefill, or None if the text was
        finished first. The prefill holds the text's first token; an in-context clone's holds the reference
        transcript and the text up to one past its reference frames (prompt.build_clone_prompt), so its
        text must reach that far before the prompt is the whole text's. A request resumed after k frames also
        needs the k tokens those frames' steps took (the delivered part of the text, so it has come)."""
        need = 1
        if voice is not None and voice.ref_codes is not None:
            need = max(1, voice.ref_codes.shape[0] + 2 - len(voice.ref_text_ids or []))
        need += resume_frames
        tokenizer = self.model.tokenizer
        while True:
            finished, text = text_stream.finished, text_stream.text
            if finished:
                return None
            ids = tokenizer.settled_text_ids(text)
            if len(ids) >= need:
                return ids
            await text_stream.wait_beyond(len(text))

    async def _feed_text(self, stream, text_stream, committed: list[int], held: int, request: SynthesisRequest,
                         prompt_len: int) -> None:
        """Push the text's tokens into the engine as they settle, then its end (tts_eos). `held`: the text
        tokens the engine already has for decode steps. A problem fails this request (stream.abort)."""
        tokenizer = self.model.tokenizer
        eos = self.model.config.tts_eos_token_id
        capacity = self.engine.runner.config.trailing_capacity
        try:
            while True:
                finished, text = text_stream.finished, text_stream.text  # finished first: no text missed
                ids = tokenizer.text_ids(text) if finished else tokenizer.settled_text_ids(text)
                if ids[: len(committed)] != committed:
                    # Cannot happen with Qwen2's pre-tokenizer (TextTokenizer.settled_text_ids); were it to, the
                    # model would already have spoken other tokens than the whole text's, so say so.
                    raise SynthesisError("the text's tokens changed as more of it came; send it whole")
                new = ids[len(committed):] + ([eos] if finished else [])
                if held + len(new) > capacity:
                    raise SynthesisError(f"text too long for streaming-text mode: more than {capacity} tokens")
                if new:
                    self.engine.push_text(stream.request_id, new, final=finished,
                                          max_frames=self._max_frames(request, prompt_len, text))
                held += len(new)
                committed = ids
                if finished:
                    return
                await text_stream.wait_beyond(len(text))
        except SynthesisError as exc:
            stream.abort(exc)

    async def _word_timings(self, text: str, pcm: bytes) -> tuple[WordTiming, ...]:
        """The sentence's words (base.split_words) with sample positions in its audio, from the aligner."""
        import numpy as np

        from .aligner.model import AlignRequest
        from .aligner.words import times_of_spans

        spans = split_words(text)
        samples = len(pcm) // 2
        if samples == 0:
            return tuple(WordTiming(word, 0, 0) for word, _, _ in spans)
        # No language: the gateway's words are whitespace tokens, and the aligner's own split (spaces, CJK
        # characters) serves every language for them, Japanese and Korean included.
        try:
            times = await self.aligner_batcher.align(AlignRequest(np.frombuffer(pcm, "<i2"), self.sample_rate, text))
        except Exception as exc:  # the aligner is down, too far behind, or failed on this sentence
            log.debug("no word timings for a sentence: %s", exc)
            # Its words will not come. Timestamps never cost audio (issue 32): this is what words that are late
            # look like to the caller, whose bound on the wait for them (base.py) ends the sentence without them.
            await asyncio.get_running_loop().create_future()
        # The aligner's times are non-decreasing (its monotonic repair); its last classes may pass the audio's end.
        return tuple(
            WordTiming(word, min(round(start_s * self.sample_rate), samples),
                       min(round(end_s * self.sample_rate), samples))
            for (word, _, _), (start_s, end_s) in zip(spans, times_of_spans([w for w, _, _ in spans], times))
        )
