"""The model runner: executes one batch of one kind of work on the device.

The engine thread is the only caller. A runner keeps its per-request device state (KV caches, last hidden
state, sampled codes, codec streaming state, sampler state) in preallocated buffers indexed by the
request's slot, so a batch is just a list of slots.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .request import Phase, RequestState

import torch

from .graphs import GraphSet
from .sampling_noise import gumbel_noise
from .voice_kv import VoiceKVCache

log = logging.getLogger(__name__)


@dataclass(eq=False)
class CodecHandle:
    """A launched codec batch. `pcm` is set once the audio is on the host; `device_s` is the device time the
    codec took when the runner measured it (CUDA events), None otherwise. A runner may subclass it."""

    count: int  # requests in the batch
    frames: int  # frames each request decodes
    pcm: list[np.ndarray] | None = None
    device_s: float | None = None
    # Per request, the codes of the frames it decoded (uint16 LE, frame-major), set with `pcm` by a runner that
    # tells its codes (resume from codes, base.py); None from one that does not.
    codes: list[bytes] | None = None


class ModelRunner(abc.ABC):
    sample_rate: int = 24000
    samples_per_frame: int = 1920
    max_slots: int = 64

    def prepare(self) -> None:
        """Allocate, capture and warm up. Called once on the engine thread before it takes work."""

    @abc.abstractmethod
    def prefill(self, requests: list[RequestState]) -> list[bool] | None:
        """Run each request's prompt; afterwards each has codebook 0 of its first frame sampled. A request that
        resumes (`RequestState.resume`, frames already delivered) has its delivered frames run after its prompt
        and codebook 0 of the next frame sampled; it may sample EOS there. Returns per request whether it
        sampled EOS (None: none did, as for requests that do not resume, whose first frame is never EOS)."""

    @abc.abstractmethod
    def frame(self, requests: list[RequestState],
              admit: Callable[[], list[RequestState]] | None = None) -> list[bool]:
        """One whole frame for each request: the Talker step of those in NEED_DECODE (a request just
        prefilled has its codebook 0 already), then the code predictor (codebooks 1..15), the frame appended
        to the request's frames. Returns, per request, whether its Talker step sampled EOS (never for one
        that only predicted); the frame of a request that sampled EOS is never used.

        `admit`, where given, may be called once between the Talker step and the predictor: the engine
        prefills the requests that arrived meanwhile (through this runner's `prefill`) and returns those
        whose predictor runs in this frame's, in NEED_CODE_PREDICT; their first frame is made with this one.
        A runner that cannot split its frame there never calls it."""

    # How many codec batches may be in flight at once; they run in launch order and are collected in it.
    codec_depth: int = 1
    # Whether a resumed request's chunk schedule goes on where the uninterrupted request's was, so that its codec
    # calls are that request's (a codec call's size moves its output in the last bits: with the same calls the
    # audio is bitwise the same where nothing else varies, the CPU), or starts again at its first, smallest
    # chunk, so that the first new audio comes sooner (a GPU, whose numerics vary with the batch company anyway:
    # at 12 frames a chunk the listener would wait for 12 frames, some 80 ms, where 2 take some 15).
    resume_continues_schedule: bool = True
    # The first-chunk lane, where the runner has one (set by `prepare`): (most requests, frames each) of a codec
    # batch that may run beside the `codec_depth` queued ones, on a stream of its own of higher priority, when
    # every request in it has no audio out yet. A first chunk queued behind bulk batches waited for them (H100,
    # 60 RPS: two of 7-9 ms). One lane batch is in flight at a time; it is launched with `lane=True` and may
    # be collected before older queued batches. None: no lane (codec_launch is never passed `lane`).
    first_chunk_lane: tuple[int, int] | None = None

    @abc.abstractmethod
    def codec_launch(self, requests: list[RequestState], frames: int) -> CodecHandle:
        """Start decoding the next `frames` frames of each request. At most `codec_depth` batches are in
        flight, a request in at most one of them: launch again only after the oldest was collected. A runner
        with a first-chunk lane also takes `lane=True` (first_chunk_lane)."""

    @abc.abstractmethod
    def codec_collect(self, handle: CodecHandle) -> list[np.ndarray] | None:
        """The launched batch's float32 PCM in [-1, 1], one array per request, or None while the device is
        still working on it. Never blocks."""

    @abc.abstractmethod
    def codec_wait(self, handle: CodecHandle) -> list[np.ndarray]:
        """`codec_collect`, blocking until the device has finished."""

    def codec(self, requests: list[RequestState], frames: int) -> list[np.ndarray]:
        """Decode the next `frames` frames of each request, synchronously."""
        return self.codec_wait(self.codec_launch(requests, frames))

    def release(self, request: RequestState) -> None:
        """The request left the engine (done or cancelled); its slot may be reused at once."""

    def push_text(self, request: RequestState, tokens: list) -> None:
        """More text for a request whose text is still being written: its decode steps take these tokens
        one per step after those it already holds (before or after its prefill). Raises ValueError when the
        request cannot hold them; the engine then fails that request alone."""
        raise ValueError("this model runner cannot take text while it speaks")

    def push_texts(self, pushes: list[tuple[RequestState, list]]) -> list[Exception | None]:
        """`push_text` for every (request, tokens) of one engine turn, at most one pair per request; returns
        per pair None or the error that fails that request alone. A runner on a device overrides it to
        upload the turn's text in one copy: the engine calls it once per turn with every word pushed since."""
        errors: list[Exception | None] = []
        for request, tokens in pushes:
            try:
                self.push_text(request, tokens)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - handed back: it fails that request, no other
                errors.append(exc)
        return errors


# ------------------------------------------------------------------------------------------------------------
# The Qwen3-TTS runner
# ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Qwen3RunnerConfig:
    max_slots: int = 64
    max_len: int = 2048  # Talker KV positions per slot: prompt + frames
    frame_ring: int = 64  # frames generated but not yet decoded, per slot
    trailing_capacity: int = 256  # streaming-text mode: text tokens fed one per frame
    # "reference": per-request torch generators, draws in the reference's order (equals Qwen3TTS.generate_codes
    # for a seed; eager only). "stateless": counter-based Gumbel noise per (seed, draw) (graph-capturable,
    # batch-independent). "auto": stateless when CUDA graphs are used, reference otherwise.
    sampler: str = "auto"
    greedy: bool = False
    cuda_graphs: bool = True
    # Fused fast path (engine/fused.py): concatenated weights, one function per layer, compiled with
    # TorchInductor on CUDA. "auto": on with the stateless sampler on CUDA; the plain modules otherwise.
    fused: str | bool = "auto"
    compile: bool = True
    # Decode layers of the fused path: "triton" (engine/kernels.py, five kernels per layer), "inductor" (the
    # compiled layer function), or "auto": Triton on CUDA when it is installed and the shapes suit it.
    kernels: str = "auto"
    # No bucket of 1: a batch of one row runs padded to 2, because TorchDynamo traces a size of 1 as a shape of
    # its own, and every traced variant is a TorchInductor compile (~8 s of start-up on the H200, issue 22);
    # on a bandwidth-bound GPU the padding row costs next to nothing.
    decode_buckets: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64)
    attend_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    prefill_batch_buckets: tuple[int, ...] = (2, 4, 8)
    prefill_len_buckets: tuple[int, ...] = (16, 32, 64, 128)
    # Prompt lengths of the captured prefill for cloned voices (Base checkpoints only), whose prompts carry
    # vectors (the x-vector, the reference frames) and so enter the graph as embeddings: an in-context voice's
    # prompt holds its reference frames (126 positions for a 10 s clip, 376 for 30 s) besides the text.
    clone_prefill_len_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    codec_batch_buckets: tuple[int, ...] = (2, 4, 8, 16)
    # Frame counts of the captured codec calls; a call of another count runs as captured pieces (largest
    # first: 7 = 4 + 2 + 1). Every count up to 12 was captured before, 48 graphs and 10 s of the H100's
    # start-up, for calls of which 90 % are the chunk schedule's 2, 4 and 12 frames (60 RPS profile).
    codec_frames: tuple[int, ...] = (1, 2, 4, 8, 12)
    # In-context cloned voices whose reference-primed codec state is kept (about 5 MB each at the released
    # size), so a registered voice's reference frames go through the codec once, not before every request.
    primed_codec_states: int = 16
    # Bytes of Talker K/V kept per runner for cloned voices' text-free prompt prefixes (engine/voice_kv.py): a
    # request in a voice whose prefix is kept copies it into its slot and prefills only the rest of its
    # prompt. "auto": 512 MiB on CUDA (a 1.7B Talker's K/V is 112 KiB a position in bf16: a prefix of 40
    # positions, 4.5 MB), 32 MiB elsewhere; 0 turns it off (every prompt prefilled whole).
    voice_kv_bytes: int | str = "auto"
    # Positions of the captured prefill of the rest of a prompt after a cached voice prefix, each captured
    # against every attended length of clone_prefill_len_buckets from it to four times it. Finer than those:
    # a whole-text request's rest (its text, then the reference frames) is most of its prompt, so with
    # powers of two it would mostly land in the whole prompt's bucket (10 s clip: 138 of 160 positions).
    voice_kv_rest_buckets: tuple[int, ...] = (16, 32, 64, 96, 128, 160, 192, 224, 256, 384)
    # Run codec batches on a CUDA stream of their own, overlapping generation, and hand their PCM back
    # through a pinned buffer and an event instead of blocking the engine thread (CUDA only; off elsewhere).
    codec_stream: bool = True
    # Codec batches queued on that stream at once (ModelRunner.codec_depth): with one, the stream idled from
    # the end of a batch until the engine's next step boundary launched the next, and then waited for the
    # frame in flight (H100, 60 RPS: in flight 77 % of the wall time, on the device 40 %).
    codec_in_flight: int = 2
    # The first-chunk lane (ModelRunner.first_chunk_lane; CUDA with codec_stream and graphs): a second codec
    # stream of the highest priority, with graphs captured for `first_chunk_frames` (the engine's chunk
    # schedule's first size, request.DEFAULT_CHUNK_SCHEDULE[0]) at these batch sizes only: first chunks come
    # one or two at a time, and every graph costs start-up. Empty: no lane, the default until a GPU shows it
    # pays: bench/engine_sim.py --first-chunk-lane predicts no gain at 10-60 RPS and a loss at 80.
    first_chunk_lane_buckets: tuple[int, ...] = ()
    first_chunk_frames: int = 2
    # The priority of the CUDA stream generation (prefill, frames, resume passes) runs on, made current on the
    # engine thread at prepare (lower is higher, clamped to the device's range; the codec stream keeps the
    # default, the lowest). When a codec batch and a frame both have work queued, the GPU hands freed SMs to
    # the higher priority's blocks first: a frame is a chain of small latency-bound kernels, a codec batch a
    # few large ones, so the frame no longer waits behind the codec's blocks (H100, 60-80 RPS: the codec on
    # the device 40-47 % of the time). None: the thread's default stream, as before (CUDA only).
    generation_stream_priority: int | None = None
    # Whether PyTorch may pick cuDNN's attention for scaled_dot_product_attention (CUDA; process-wide when
    # False: torch.backends.cuda.enable_cudnn_sdp). cuDNN builds an execution plan the first time it meets a
    # shape, on the host. Captured graphs meet their shapes at capture; the uncaptured passes (a resume's
    # batched Talker pass over prompt + delivered frames, whose length is new for nearly every request) meet
    # them while serving, where a pause is a listener's pause: on the H100 and H200 some single resumes took
    # 0.7-1.4 s, host and device clocks alike, where others of similar length took 15-80 ms. False (the
    # default) leaves those passes to the memory-efficient kernel, which needs no plan: on the H100 the resume
    # check's resumed first audio went from median 81.5 / p95 829 ms with cuDNN to 43.4 / 59.8 ms without
    # (bench/results/resume_h100.md).
    cudnn_attention: bool = False
    # cuDNN's benchmark mode while the codec's graphs are captured (CUDA; restored afterwards): each convolution
    # shape is timed once before capture and the graph keeps the fastest kernel, where without it cuDNN's
    # heuristics pick. At some of the shapes the engine captures they pick kernels that make the fused codec
    # collapse under load: on the H100 the channels-last codec without it served 61 of 875 requests at 60 RPS
    # (p95 4.2 s), with it all, p95 51 ms (bench/results/engine_h100.md, 2026-12-07 second session). The price
    # is start-up: cuDNN times every convolution shape of the codec's graphs at every start (their capture
    # 16 -> 52 s on the H100 with the compile cache warm).
    codec_cudnn_benchmark: bool = True
    # How many of cuDNN's algorithms benchmark mode times per convolution shape (torch.backends.cudnn
    # .benchmark_limit; 0: all of them; None: PyTorch's 10). On the H100 with the compile cache warm, 3 took
    # the codec's capture from 40-50 s to 29 s and the worker's start to ready in 50.5 s, and served 80 RPS
    # in-process as 10 did (p95 64 against 62 ms, codec 4.99 against 5.13 ms per batch on the device): the
    # fastest kernels are among cuDNN's first three suggestions (bench/results/engine_h100.md, 2026-12-07
    # third session).
    codec_cudnn_benchmark_limit: int | None = 3
    # The codec's precision on CUDA: "bfloat16", or "float32" (as released; TF32 matmuls and convolutions).
    # On the H100 (bench/results/codec_profile_h100.json) a call of 16 streams x 12 frames costs 11.3 ms in
    # bfloat16 against 16.5 in float32, with the output 44.6 dB above its difference from float32's (random
    # weights); under load (engine_profile_h100_codec_bf16.json) p95 first audio at 80 RPS fell from 243 to
    # 162 ms and underrunning requests from 62 to 27. Elsewhere always float32.
    codec_dtype: str = "bfloat16"
    # The codec's convolution stages fused on CUDA (engine/fused.py _route_codec_convolutions: conv biases,
    # SnakeBetas, history updates and residual adds inside compiled functions and GEMMs); False keeps only the
    # compiled SnakeBeta and pre-transformer layers. Its functions are Inductor compiles of their own at a
    # start without the compile cache (5 more traced variants than the 3 of the rest of the codec: at about
    # 8 s each, a cold start's largest share), so the two trade codec time against cold start-up. "auto": on
    # CUDA (with codec_channels_last and codec_cudnn_benchmark, the H100's fastest codec under load).
    codec_fused_convolutions: bool | str = "auto"
    # Those fused stages with the activations kept [B, T, C] from the pre-transformer's output to the final
    # conv (engine/codec_channels_last.py: every conv an NHWC 2-D conv on channels-last views and weights,
    # SnakeBetas and history windows along whole rows). A layout of the fused stages, so it needs
    # codec_fused_convolutions; one traced variant fewer than those (4 more than the rest of the codec). On the
    # H200 the fused path's call of 16 x 12 frames spent 1.44 of 9.7 ms in cuDNN's NCHW<->NHWC transforms and
    # 3.3 ms in SnakeBeta kernels 5x below memory bandwidth (bench/results/codec_profile_h200_fused.json). On
    # the H100 a call of 16 x 12 frames takes 7.9 ms against the fused NCHW stages' 11.6 (0.68-0.73 x at every
    # size), and under load with cuDNN's benchmark mode p95 first audio fell from 72.6 to 51.1 ms at 60 RPS and
    # from 100.7 to 72.6 at 80 (bench/results/engine_h100.md, 2026-12-07 second session). "auto": on wherever
    # the fused convolution stages are.
    codec_channels_last: bool | str = "auto"
    # How a resumed request (resume from codes) runs its delivered frames through the Talker: "batched" (one
    # pass over the prompt and the frames, as a prefill), "stepwise" (the prompt, then one decode step a frame,
    # exactly the steps the uninterrupted request took) or "auto": batched on CUDA, stepwise elsewhere. Why
    # both: a prefill over prompt+k positions computes the same function as the k decode steps, but not in the
    # same floating-point order, so its logits differ in the last bits; on the CPU, where the engine in
    # bfloat16 is otherwise bitwise independent of batch company (with attended lengths in whole vectors,
    # qwen3.talker.attend_length; float32 matmuls there still vary with the row count), only the stepwise
    # path resumes byte for byte. On a GPU
    # the company already varies the numerics, and the batched pass costs one prefill where the steps cost k
    # decode steps (100 frames: 100 launches of a few ms against one pass).
    resume_prefill: str = "auto"
    # (rows, positions) of the batched resume pass's captured graphs, for requests without a voice prefix in
    # the slot (a cloned voice's rest goes on the clone prefill's graphs): the rows padded on the scratch slot
    # and every row's prompt + delivered frames right-padded to the positions, more resumes than the most rows
    # in passes of that many. Uncaptured, the pass is the compiled layers launched from the host, which the
    # GPU waits for: on the H100 one resume's pass took 14.7 ms, a drain's 8 together 55 ms, host and device
    # alike, against 3-5 ms for a captured prefill of 2 x 64 to 8 x 64 positions (bench/results/resume_h100.md,
    # fourth session). A longer request resumes uncaptured. Each shape is a graph at start-up (about 1 s).
    # 8 x 64: a failover's streams are mostly early in their sentences (a streaming-text prompt is some ten
    # positions; the H100 drain's 7 resumes had 8-28 frames), and 8 x 128 ran twice the positions they needed.
    resume_graph_shapes: tuple[tuple[int, int], ...] = ((2, 128), (8, 64), (8, 128), (8, 256))
    # The most delivered frames a resume runs through the codec to rebuild its left context: its last ones,
    # from a fresh codec state (an in-context voice's reference priming, older context still, then skipped).
    # None: every delivered frame, which leaves the state the uninterrupted request's codec calls left (the
    # CPU's byte-exact resume). Priming costs codec calls of 12 frames: a failover 200 frames into a long
    # sentence (the gateway takes 300 characters, some 20 s) was 17 calls before the listener heard anything,
    # a pause past 150 ms where 8 streams resume at once. The reference's own whole-utterance decode
    # (qwen-tts chunked_decode) joins its 300-frame windows after re-decoding 25 frames of left context from
    # a fresh start; 36 is three captured calls, more context than that. "auto": 36 where the chunk schedule
    # starts again after a resume (a GPU, whose numerics vary with the batch company anyway), else None.
    resume_codec_context: int | None | str = "auto"


@contextmanager
def _cudnn_benchmark(on: bool, limit: int | None = None) -> Iterator[None]:
    """cuDNN's benchmark mode on for the block when `on` (never turned off where the process had it on), trying
    at most `limit` algorithms per convolution shape when given (None: PyTorch's own limit, 10); both restored."""
    saved, saved_limit = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
    torch.backends.cudnn.benchmark = saved or on
    if on and limit is not None:
        torch.backends.cudnn.benchmark_limit = limit
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved
        torch.backends.cudnn.benchmark_limit = saved_limit


def _auto_flag(name: str, setting: bool | str, auto: bool) -> bool:
    """A runner option that is True, False or "auto" (then `auto`)."""
    if setting == "auto":
        return auto
    if not isinstance(setting, bool):
        raise ValueError(f"{name} must be true, false or \"auto\", not {setting!r}")
    return setting


def codec_pieces(frames: int, counts: Sequence[int]) -> list[int]:
    """A codec call of `frames` frames as calls of the captured `counts`, largest first (7 from 1, 2, 4, 8,
    12: [4, 2, 1]); [frames] when it is a captured count itself, or when no split covers it (then it runs
    uncaptured). The codec streams, so the pieces decode what the one call would."""
    if frames in counts:
        return [frames]
    pieces, left = [], frames
    for f in sorted(counts, reverse=True):
        while left >= f:
            pieces.append(f)
            left -= f
    return pieces if left == 0 and pieces else [frames]


def priming_calls(frames: Sequence[tuple[int, int]], most: int, widest: int) -> list[tuple[int, int, list[int]]]:
    """The codec calls that prime resumed requests' states with their delivered frames (slot, frames it
    primes: the last resume_codec_context at most) together: (first frame, frames, slots) per call, in order.
    Round r decodes frames from r x most on: every slot with `most` or more left takes `most`, the others what
    they have left, and the slots with as many left go in one call of at most `widest` (the largest captured
    batch). Each slot's calls cover its frames once, in order, so its state ends as one request's priming
    alone leaves it."""
    calls = []
    longest = max((k for _, k in frames), default=0)
    for start in range(0, longest, most):
        by_count: dict[int, list[int]] = {}
        for slot, k in frames:
            if k > start:
                by_count.setdefault(min(most, k - start), []).append(slot)
        for n, slots in by_count.items():
            calls += [(start, n, slots[i: i + widest]) for i in range(0, len(slots), widest)]
    return calls


def priming_ring_writes(calls: Sequence[tuple[int, int, list[int]]], offsets: dict[int, int],
                        ring: int, firsts: dict[int, int] | None = None) -> torch.Tensor:
    """Where priming_calls' frames go, as one host tensor [3, W] of (ring row, ring position, row of the resumed
    requests' frames stacked in order) for every frame each call decodes, call after call (a call of n frames
    over s slots is s x n columns, slot by slot): one indexed write per call instead of one per slot and call.
    `offsets`: each slot's first row in the stack; `firsts`: the request's frame that row is (0 where not
    given: resume_codec_context); its frame f sits at ring position f mod `ring`."""
    columns = []
    for start, n, slots in calls:
        frames = torch.arange(start, start + n)
        for slot in slots:
            first = firsts.get(slot, 0) if firsts else 0
            columns.append(torch.stack((torch.full((n,), slot), (first + frames) % ring, offsets[slot] + frames)))
    return torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)


def _bucket(value: int, buckets: Sequence[int]) -> int | None:
    for b in buckets:
        if b >= value:
            return b
    return None


class Qwen3ModelRunner(ModelRunner):
    """Batched Talker prefill/decode, the 15-step code-predictor loop and the stateful codec over slots.

    Per-slot state lives in preallocated device buffers (row `max_slots` is a scratch row that padding rows
    of a captured batch point at). Each step reads and writes only those buffers, so the same Python code
    runs eagerly (CPU, CI) and inside CUDA graphs captured per shape at start-up (GPU).
    """

    def __init__(self, model, config: Qwen3RunnerConfig | None = None) -> None:
        from tts_backend.qwen3.sampling import SamplingParams

        self.model = model
        self.config = cfg = config or Qwen3RunnerConfig()
        self.device = torch.device(model.device)
        self.max_slots = cfg.max_slots
        if model.codec is None:
            raise ValueError("the runner needs the codec decoder (load_codec=True)")
        if cfg.codec_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"codec_dtype must be float32 or bfloat16, not {cfg.codec_dtype!r}")
        if cfg.codec_dtype == "bfloat16" and self.device.type == "cuda":
            model.codec.to(torch.bfloat16)
        self.codec_module = model.codec
        self.samples_per_frame = int(self.codec_module.samples_per_frame)
        self.sample_rate = int(getattr(model.codec_config, "output_sample_rate", 24000))
        use_graphs = cfg.cuda_graphs and self.device.type == "cuda"
        sampler = cfg.sampler if cfg.sampler != "auto" else ("stateless" if use_graphs else "reference")
        if sampler not in ("reference", "stateless"):
            raise ValueError(f"sampler must be reference, stateless or auto, got {cfg.sampler!r}")
        if sampler == "reference":
            use_graphs = False  # per-request generators cannot live inside a graph
        self.sampler = sampler
        fused = cfg.fused if cfg.fused != "auto" else (sampler == "stateless" and self.device.type == "cuda")
        if fused and sampler != "stateless":
            raise ValueError("the fused path samples statelessly; use sampler='stateless'")
        self.fused = bool(fused)
        self.fused_prefill = self.fused
        self.compile = bool(cfg.compile and self.fused and self.device.type == "cuda")
        # The codec's fast stages ("auto": on CUDA on the fused path, the only path that has them).
        self.codec_fused_convolutions = _auto_flag("codec_fused_convolutions", cfg.codec_fused_convolutions,
                                                   self.fused and self.device.type == "cuda")
        self.codec_channels_last = _auto_flag("codec_channels_last", cfg.codec_channels_last,
                                              self.codec_fused_convolutions)
        if self.codec_channels_last and not self.codec_fused_convolutions:
            raise ValueError("codec_channels_last is a layout of the fused convolution stages: it needs "
                             "codec_fused_convolutions too")
        limit = cfg.codec_cudnn_benchmark_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"codec_cudnn_benchmark_limit must be a whole number >= 0 or null, not {limit!r}")
        self.triton = self.fused and self._use_triton(cfg.kernels, model)
        params = model.sampling_params()
        self.params: SamplingParams = params.greedy() if cfg.greedy else params
        self.codec_async = bool(cfg.codec_stream and self.device.type == "cuda")
        # Codec graphs replay on the codec stream while generation graphs replay on the main one: separate pools.
        lane_buckets = tuple(sorted(b for b in cfg.first_chunk_lane_buckets if b <= cfg.max_slots))
        self.lane_buckets = lane_buckets if self.codec_async and use_graphs else ()
        self.graphs = GraphSet(self.device, use_graphs, own_pools=(
            ("codec",) + (("codec_lane",) if self.lane_buckets else ())) if self.codec_async else ())
        self.decode_buckets = self._buckets(cfg.decode_buckets, cfg.max_slots)
        # The Triton decode attends each row's own length, so one captured decode graph serves every length.
        self._length_buckets = tuple(a for a in cfg.attend_buckets if a < cfg.max_len) + (cfg.max_len,)
        self.attend_buckets = (cfg.max_len,) if self.triton else self._length_buckets
        self.codec_buckets = tuple(sorted(b for b in cfg.codec_batch_buckets if b <= cfg.max_slots)) or (1,)
        self.prefill_buckets = tuple(sorted(b for b in cfg.prefill_batch_buckets if b <= cfg.max_slots)) or (1,)
        # Only a Base checkpoint speaks in cloned voices; other models capture no embedding prefill.
        self.clones = getattr(model, "speaker_encoder", None) is not None
        self.clone_len_buckets = tuple(sorted(n for n in cfg.clone_prefill_len_buckets if n <= cfg.max_len))
        self.voice_kv = VoiceKVCache(self._voice_kv_bytes(cfg.voice_kv_bytes)) if self.clones else None
        if self.voice_kv is not None and self.voice_kv.max_bytes == 0:
            self.voice_kv = None
        # With the voice cache, the rest of a prompt after a cached prefix is captured on (rest positions,
        # attended positions) shapes, attending up to four times as far as it has positions (a prefix is the
        # head and the reference transcript, shorter than the text and frames that follow it).
        self.rest_len_buckets = tuple(sorted(cfg.voice_kv_rest_buckets))
        self.rest_graph_shapes = tuple(
            (q, k) for k in self.clone_len_buckets for q in self.rest_len_buckets
            if self.voice_kv is not None and q < k <= 4 * q)
        if cfg.resume_prefill not in ("auto", "batched", "stepwise"):
            raise ValueError(f"resume_prefill must be auto, batched or stepwise, not {cfg.resume_prefill!r}")
        self.resume_batched = cfg.resume_prefill == "batched" or (
            cfg.resume_prefill == "auto" and self.device.type == "cuda")
        self.resume_continues_schedule = self.device.type != "cuda"
        context = cfg.resume_codec_context
        if not (context in ("auto", None) or (isinstance(context, int) and not isinstance(context, bool)
                                              and context >= 1)):
            raise ValueError(f"resume_codec_context must be a number of frames >= 1, null or \"auto\", "
                             f"not {context!r}")
        # The resume pass's shapes by rows, each row count's positions ascending (see resume_graph_shapes).
        self.resume_shapes: dict[int, tuple[int, ...]] = {}
        for rows, positions in cfg.resume_graph_shapes:
            if 0 < rows <= cfg.max_slots and 0 < positions <= cfg.max_len:
                self.resume_shapes[rows] = tuple(sorted({*self.resume_shapes.get(rows, ()), positions}))
        self.resume_shapes = dict(sorted(self.resume_shapes.items()))
        self._allocated = False
        self.kernel_check: dict | None = None  # the start-up kernel check's measurements, when it ran
        self.codec_compiled = False

    def fast_path(self) -> dict[str, bool]:
        """Which pieces of the fast path serve now (after any start-up fallback), for monitoring: a piece that
        fell back costs speed, and an operator should see that without reading the start-up log."""
        return {
            "cuda_graphs": self.graphs.enabled and len(self.graphs) > 0,
            "fused_layers": self.fused,
            "compiled": self.compile,
            "triton_layers": self.triton,
            "sampling_tail": bool(self.fused and self._allocated and self.fused_cp.fused_tail),
            "fused_prefill": self.fused_prefill,
            "compiled_codec": self.codec_compiled,
            "codec_stream": self.codec_async,
        }

    def _use_triton(self, kernels: str, model) -> bool:
        from .fused import kernels_fit, triton_kernels

        if kernels not in ("auto", "triton", "inductor"):
            raise ValueError(f"kernels must be auto, triton or inductor, got {kernels!r}")
        if kernels == "inductor":
            return False
        tcfg = model.config.talker
        fits = kernels_fit(tcfg) and kernels_fit(tcfg.code_predictor) and triton_kernels() is not None
        if kernels == "triton":
            if not fits:
                raise ValueError("kernels='triton' needs Triton installed and kernel-friendly model shapes")
            if self.device.type != "cuda" and model.dtype != torch.float32:
                raise ValueError("off CUDA the Triton kernels run in Triton's interpreter, which takes fp32 only")
            return True
        return fits and self.device.type == "cuda"

    def _voice_kv_bytes(self, setting: int | str) -> int:
        if setting == "auto":
            return (512 if self.device.type == "cuda" else 32) << 20
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
            raise ValueError(f"voice_kv_bytes must be auto or a number of bytes >= 0, not {setting!r}")
        return setting

    def uncaptured_passes(self) -> dict[str, int] | None:
        """Passes run without a captured graph by kind, where this runner captures graphs (None elsewhere)."""
        return dict(self.graphs.uncaptured) if self.graphs.enabled else None

    def voice_kv_stats(self) -> dict | None:
        """The voice prefix cache's counters (hits, misses, evictions, bytes, entries, positions_saved), or None
        where there is none (not a Base checkpoint, or turned off). Plain ints, safe to read from any thread."""
        return self.voice_kv.stats() if self.voice_kv is not None else None

    @staticmethod
    def _buckets(buckets: Sequence[int], limit: int) -> tuple[int, ...]:
        kept = tuple(b for b in sorted(buckets) if b < limit)
        return kept + (limit,)

    # ---- set-up -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self) -> None:
        started = time.perf_counter()
        if self.device.type == "cuda" and not self.config.cudnn_attention:
            torch.backends.cuda.enable_cudnn_sdp(False)
            log.info("cuDNN attention is off for this process (cudnn_attention=False)")
        if self.device.type == "cuda" and self.config.generation_stream_priority is not None:
            # Thread-local: the engine thread's work (and the graphs it replays) goes to this stream from here on.
            self.generation_stream = torch.cuda.Stream(self.device, priority=self.config.generation_stream_priority)
            torch.cuda.set_stream(self.generation_stream)
            log.info("generation runs on a CUDA stream of priority %d (device range %s)",
                     self.generation_stream.priority, torch.cuda.Stream.priority_range())
        self._allocate()
        log.info("allocated the slots and fused the weights in %.1f s", time.perf_counter() - started)
        if self.triton:
            started = time.perf_counter()
            self._check_kernels()
            log.info("checked the Triton kernels in %.1f s", time.perf_counter() - started)
        if self.graphs.enabled:
            self._capture_all()

    def _check_kernels(self) -> None:
        """Serve on the Triton kernels only if they compute what the layers compute on this device (see
        kernel_check); a piece that disagrees falls back like a piece that fails to capture."""
        from .kernel_check import check_triton_path

        check = check_triton_path(self.fused_talker, self.model.config.talker, self.fused_cp, self.config.max_len)
        self.kernel_check = check.as_dict()
        if not check.layers_ok:
            log.error("the Triton decode kernels disagree with the layer function on this device (%s); serving "
                      "on the compiled layers", self.kernel_check)
            self._drop_triton()
        elif not check.tail_ok:
            log.error("the Triton sampling tail disagrees with the compiled sampler on this device (%s); "
                      "drawing with the compiled sampler", self.kernel_check)
            self._drop_sampling_tail()
        else:
            log.info("Triton kernels agree with the layers on this device: %s", self.kernel_check)

    def _allocate(self) -> None:
        if self._allocated:
            return
        m, cfg, dev = self.model, self.config, self.device
        tcfg = m.config.talker
        S = cfg.max_slots + 1
        self.scratch = cfg.max_slots
        D = tcfg.hidden_size
        G = m.num_code_groups
        self.vocab = tcfg.vocab_size
        self.eos_id = tcfg.codec_eos_token_id
        self.codebook_size = tcfg.codebook_size
        dtype = m.dtype
        cp_rows = max(self.decode_buckets)
        if self.fused:
            from .codec_fast import fuse_codec_activations
            from .fused import FusedCodePredictor, FusedStack, PerLayerKV, talker_sampler

            self.kv = PerLayerKV.for_stack(tcfg, S, cfg.max_len, dev, dtype)
            self.cp_cache = PerLayerKV.for_stack(tcfg.code_predictor, cp_rows, G, dev, dtype)
            self.fused_talker = FusedStack(m.talker.model, self.compile, self.triton)
            self.fused_cp = FusedCodePredictor(m.code_predictor, m.talker, self.params, self.compile, self.triton,
                                               max_rows=cp_rows)
            self.talker_sample_fn = talker_sampler(self.params, self.compile)
            fuse_codec_activations(self.codec_module, self.compile, convolutions=self.codec_fused_convolutions,
                                   channels_last=self.codec_channels_last)
            self.codec_compiled = self.compile
            if dev.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 codec's matmuls (convs already use TF32)
        else:
            from .fused import unfuse_codec_activations

            unfuse_codec_activations(self.codec_module)  # a failed fast-path start may have patched it
            self.kv = m.new_talker_cache(S, cfg.max_len)
            self.cp_cache = m.new_predictor_cache(cp_rows)
        self.cp_rows = torch.arange(max(self.decode_buckets), device=dev)
        self.hidden = torch.zeros(S, D, device=dev, dtype=dtype)
        self.next_embed = torch.zeros(S, D, device=dev, dtype=dtype)
        self.c0 = torch.zeros(S, device=dev, dtype=torch.long)
        self.pos = torch.zeros(S, device=dev, dtype=torch.long)
        self.generated = torch.zeros(S, device=dev, dtype=torch.long)
        self.presence = torch.zeros(S, self.vocab, device=dev, dtype=torch.bool)
        self.seeds = torch.zeros(S, device=dev, dtype=torch.long)
        self.draws = torch.zeros(S, device=dev, dtype=torch.long)
        self.ring = torch.zeros(S, cfg.frame_ring, G, device=dev, dtype=torch.long)
        self.written = torch.zeros(S, device=dev, dtype=torch.long)
        self.decoded = torch.zeros(S, device=dev, dtype=torch.long)
        self.frame_offsets = torch.arange(max(cfg.codec_frames + (64,)), device=dev)
        self.trail_buf = torch.zeros(S, cfg.trailing_capacity, D, device=dev, dtype=dtype)
        self.trail_len = torch.zeros(S, device=dev, dtype=torch.long)
        self.trail_pos = torch.zeros(S, device=dev, dtype=torch.long)
        self.pad_embed = m.text_embeds([m.config.tts_pad_token_id])[0]
        self.eos_out = torch.zeros(max(self.decode_buckets), device=dev, dtype=torch.bool)
        codec_dtype = next(self.codec_module.parameters()).dtype
        self.wav_out = torch.zeros(max(self.codec_buckets), 64 * self.samples_per_frame, device=dev,
                                   dtype=codec_dtype)
        # The codes each codec batch decoded, as the codec read them (clamped), handed back with its PCM.
        self.codes_out = torch.zeros(max(self.codec_buckets), 64, G, device=dev, dtype=torch.int16)
        # A call of an uncaptured frame count gathers its pieces' audio and codes here (_run_codec).
        self.wav_stage = torch.zeros_like(self.wav_out)
        self.codes_stage = torch.zeros_like(self.codes_out)
        self.codec_pool = self.codec_module.init_state(S, device=dev)
        self.primed_codec: OrderedDict[bytes, object] = OrderedDict()  # reference codes digest -> CodecState
        self.codec_static = {b: self.codec_module.init_state(b, device=dev) for b in self.codec_buckets}
        self._codec_in_flight: deque[CodecHandle] = deque()
        self.codec_depth = max(1, cfg.codec_in_flight) if self.codec_async else 1
        if self.codec_async:
            # The codec stream's inputs and outputs. The graphs' static inputs, `codec_static[b]` and `wav_out`
            # exist once per runner: batches in flight together run one after the other on the codec stream,
            # each reading them after the one before has finished with them. What the host reads or writes
            # while a batch is in flight (its slots, its PCM, its events) is one set per batch in flight.
            self.codec_stream = torch.cuda.Stream(dev)
            self.codec_io = deque(_CodecIO(
                slots_host=torch.empty(max(self.codec_buckets), dtype=torch.long, pin_memory=True),
                pcm_host=torch.empty(max(self.codec_buckets) * 64 * self.samples_per_frame, dtype=codec_dtype,
                                     pin_memory=True),
                codes_host=torch.empty(max(self.codec_buckets) * 64 * G, dtype=torch.int16, pin_memory=True),
                started=torch.cuda.Event(enable_timing=True),
                done=torch.cuda.Event(enable_timing=True)) for _ in range(self.codec_depth))
        self.lane: _CodecLane | None = None
        if self.lane_buckets:
            # Everything the lane's graphs read or write apart from the per-slot pool rows is its own: it runs
            # concurrently with the codec stream (see the ordering notes at codec_launch).
            most, frames = max(self.lane_buckets), self.config.first_chunk_frames
            self.lane = _CodecLane(
                stream=torch.cuda.Stream(dev, priority=-1),  # lower is higher; PyTorch clamps to the range
                static={b: self.codec_module.init_state(b, device=dev) for b in self.lane_buckets},
                wav_out=torch.zeros(most, frames * self.samples_per_frame, device=dev, dtype=codec_dtype),
                codes_out=torch.zeros(most, frames, G, device=dev, dtype=torch.int16),
                io=_CodecIO(
                    slots_host=torch.empty(most, dtype=torch.long, pin_memory=True),
                    pcm_host=torch.empty(most * frames * self.samples_per_frame, dtype=codec_dtype,
                                         pin_memory=True),
                    codes_host=torch.empty(most * frames * G, dtype=torch.int16, pin_memory=True),
                    started=torch.cuda.Event(enable_timing=True),
                    done=torch.cuda.Event(enable_timing=True)))
        self.eos_onehot = torch.zeros(self.vocab, device=dev, dtype=torch.bool)
        self.eos_onehot[self.eos_id] = True
        self._true = torch.ones((), device=dev, dtype=torch.bool)
        self.suppress = m.suppress_mask
        # Host mirrors (reference sampler, attention bucket choice); never read from the device.
        self.pos_host = [0] * S
        self.trail_len_host = [0] * S  # mirrors trail_len, so pushed text lands after what a slot holds
        self.generators: dict[int, torch.Generator] = {}
        self.history: dict[int, list[int]] = {}
        self._host_slots: list[int] = []
        self._allocated = True

    def _capture_all(self) -> None:
        """Capture every steady-state shape. The Talker decode and code-predictor graphs must capture; if a
        fast-path piece fails to (the Triton sampling tail, the Triton layers, the compiled codec functions,
        the compiled prefill), that piece falls back (logged) so one compiler problem does not cost the
        whole fast path."""
        dev = self.device
        started = time.perf_counter()
        mark = self._capture_mark()
        self._capture_generation_with_fallbacks()
        mark = self._log_capture("Talker decode and code-predictor", mark)
        benchmark = self.config.codec_cudnn_benchmark and dev.type == "cuda"
        benchmark_limit = self.config.codec_cudnn_benchmark_limit
        try:
            with _cudnn_benchmark(benchmark, benchmark_limit):
                self._capture_codec()
        except Exception:
            if not self.fused:
                raise
            from .codec_fast import fuse_codec_activations
            from .fused import unfuse_codec_activations

            log.exception("codec capture failed with the compiled codec functions; capturing without them")
            unfuse_codec_activations(self.codec_module)
            fuse_codec_activations(self.codec_module, compile=False)  # the RVQ tables need no compiler
            self.codec_compiled = False
            self.graphs.discard("codec")
            with _cudnn_benchmark(benchmark, benchmark_limit):
                self._capture_codec()
        mark = self._log_capture("codec", mark)
        if self.lane is not None:
            try:
                with _cudnn_benchmark(benchmark, benchmark_limit):
                    self._capture_codec_lane()
                self.first_chunk_lane = (max(self.lane_buckets), self.config.first_chunk_frames)
            except Exception:
                log.exception("capturing the first-chunk codec lane failed; first chunks queue with the others")
                self.graphs.discard("codec_lane")
                self.lane = None
            mark = self._log_capture("first-chunk codec lane", mark)
        try:
            self._capture_prefill()
        except Exception:
            if not self.fused_prefill:
                raise
            log.exception("prefill capture failed on the fast path; capturing the model's own prefill")
            self.fused_prefill = False
            self.graphs.discard("prefill")
            self._capture_prefill()
        mark = self._log_capture("prefill", mark)
        if self.rest_graph_shapes:
            try:
                self._capture_rest_prefill()
            except Exception:
                # The rest of a cached voice's prompt then runs on the square bucket of the whole prompt.
                log.exception("capturing the prefill after cached voice prefixes failed; it runs on the whole "
                              "prompt's buckets")
                self.graphs.discard("prefill_rest")
            self._log_capture("prefill after voice prefixes", mark)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - started)

    def _capture_mark(self) -> tuple[float, int, int]:
        """(now, graphs captured, functions compiled so far): start-up time is mostly compilation, and which
        kind of step compiles how many variants is what decides where to cut it (issue 22)."""
        from torch._dynamo.utils import counters

        return time.perf_counter(), len(self.graphs), int(counters["stats"]["unique_graphs"])

    def _log_capture(self, what: str, mark: tuple[float, int, int]) -> tuple[float, int, int]:
        now = self._capture_mark()
        log.info("captured %d %s graphs in %.1f s, compiling %d graph variants", now[1] - mark[1], what,
                 now[0] - mark[0], now[2] - mark[2])
        return now

    def _capture_generation_with_fallbacks(self) -> None:
        """The Talker decode and code-predictor graphs as configured; if that fails, without the predictor's
        Triton sampling tail; then on the compiled layers instead of the Triton kernels."""
        attempts = (("as configured", None), ("without the Triton sampling tail", self._drop_sampling_tail),
                    ("on the compiled layers instead of the Triton kernels", self._drop_triton))
        error: Exception | None = None
        for what, fall_back in attempts:
            if fall_back is not None and not fall_back():
                continue  # nothing of that kind in use
            try:
                self._capture_generation()
            except Exception as exc:
                log.exception("Talker/code-predictor capture failed %s", what)
                error = exc
                continue
            if error is not None:
                log.warning("captured the Talker and code predictor %s", what)
            return
        raise error

    def _capture_generation(self) -> None:
        """Every Talker decode and code-predictor shape not captured yet (a fallback keeps what still holds)."""
        for b in sorted(self.decode_buckets, reverse=True):
            slots = torch.full((b,), self.scratch, device=self.device, dtype=torch.long)
            for a in self.attend_buckets:
                if ("decode", b, a) not in self.graphs:
                    self.graphs.capture(("decode", b, a), lambda s, a=a: self._decode_fn(s, a), [slots])
            if ("cp", b) not in self.graphs:
                self.graphs.capture(("cp", b), self._cp_fn, [slots])

    def _drop_sampling_tail(self) -> bool:
        """The compiled sampler for the predictor's draws; the Talker's graphs stay."""
        if not (self.fused and self.fused_cp.fused_tail):
            return False
        self.fused_cp.fused_tail = False
        self.graphs.discard("cp")
        return True

    def _drop_triton(self) -> bool:
        """Back to the compiled (Inductor) decode layers, attended length in buckets again."""
        if not self.triton:
            return False
        self.triton = False
        self.fused_talker.kernels = None
        self.fused_cp.stack.kernels = None
        self.fused_cp.triton = self.fused_cp.fused_tail = False
        self.attend_buckets = self._length_buckets
        self.graphs.discard("decode")
        self.graphs.discard("cp")
        return True

    def _capture_codec(self) -> None:
        for b in sorted(self.codec_buckets, reverse=True):
            slots = torch.full((b,), self.scratch, device=self.device, dtype=torch.long)
            for f in self.config.codec_frames:
                self.graphs.capture(("codec", f, b), lambda s, f=f, b=b: self._codec_fn(s, f, self.codec_static[b]),
                                    [slots])

    def _capture_codec_lane(self) -> None:
        lane, f = self.lane, self.config.first_chunk_frames
        for b in sorted(self.lane_buckets, reverse=True):
            slots = torch.full((b,), self.scratch, device=self.device, dtype=torch.long)
            self.graphs.capture(("codec_lane", f, b), lambda s, b=b: self._codec_fn(
                s, f, lane.static[b], lane.wav_out, lane.codes_out), [slots])

    def _capture_prefill(self) -> None:
        dev, sc = self.device, self.scratch
        for b in self.prefill_buckets:
            for n in self.config.prefill_len_buckets:
                if n > self.config.max_len:
                    continue
                example = [torch.full((b,), sc, device=dev, dtype=torch.long),
                           torch.zeros(b, n, device=dev, dtype=torch.long),
                           torch.full((b, n), -1, device=dev, dtype=torch.long),
                           torch.ones(b, device=dev, dtype=torch.long)]
                self.graphs.capture(("prefill", b, n), self._prefill_fn, example)
        if self.resume_batched and self.can_resume:
            for b, lengths in self.resume_shapes.items():
                for n in lengths:
                    self.graphs.capture(("resume", b, n), self._prefill_embeds, self._embeds_example(b, n))
        if not self.clones:
            return
        for b in self.prefill_buckets:
            for n in self.clone_len_buckets:
                self.graphs.capture(("prefill_embeds", b, n), self._prefill_embeds, self._embeds_example(b, n))

    def _capture_rest_prefill(self) -> None:
        for b in self.prefill_buckets:
            for q, k in self.rest_graph_shapes:
                self.graphs.capture(("prefill_rest", b, q, k), lambda *a, k=k: self._prefill_embeds(*a, attend_len=k),
                                    self._embeds_example(b, q))

    def _embeds_example(self, b: int, n: int) -> list[torch.Tensor]:
        """Inputs of an embeddings prefill of b rows of n positions: slots (scratch), embeddings, lengths,
        starts."""
        dev, talker = self.device, self.model.talker.codec_head.weight
        return [torch.full((b,), self.scratch, device=dev, dtype=torch.long),
                torch.zeros(b, n, talker.shape[1], device=dev, dtype=talker.dtype),
                torch.ones(b, device=dev, dtype=torch.long), torch.zeros(b, device=dev, dtype=torch.long)]

    # ---- sampling -----------------------------------------------------------------------------------
    def _sample_c0(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """fp32 talker logits [B, V] -> codebook-0 ids [B], updating penalty history and draw counters."""
        from tts_backend.qwen3.sampling import sample_talker, warp

        p = self.params
        if self.sampler == "reference":
            out = []
            for i, slot in enumerate(self._host_slots):
                hist = self.history[slot]
                hist_t = torch.tensor([hist], device=self.device, dtype=torch.long) if hist else None
                c = sample_talker(logits[i:i + 1], hist_t, len(hist), p, self.eos_id, self.suppress,
                                  self.generators[slot])
                hist.append(int(c))
                out.append(c)
            return torch.cat(out)
        if self.fused:
            draws = self.draws[slots]
            c0 = self.talker_sample_fn(logits, self.presence[slots], self.generated[slots], self.seeds[slots], draws,
                                       self.suppress, self.eos_onehot)
            if p.do_sample:
                self.draws[slots] = draws + 1
            self.presence.index_put_((slots, c0), self._true)
            self.generated[slots] = self.generated[slots] + 1
            return c0
        scores = logits
        if p.repetition_penalty != 1.0:
            seen = self.presence[slots]
            penalised = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        block = (self.generated[slots] < p.min_new_tokens)[:, None] & self.eos_onehot[None]
        scores = scores.masked_fill(block, float("-inf")).masked_fill(self.suppress, float("-inf"))
        if p.do_sample:
            scores = warp(scores, p.temperature, p.top_k, p.top_p)
            draws = self.draws[slots]
            c0 = torch.argmax(scores + gumbel_noise(self.seeds[slots], draws, scores.shape[1]), dim=-1)
            self.draws[slots] = draws + 1
        else:
            c0 = torch.argmax(scores, dim=-1)
        self.presence.index_put_((slots, c0), self._true)
        self.generated[slots] = self.generated[slots] + 1
        return c0

    def _residual_chooser(self, slots: torch.Tensor):
        from tts_backend.qwen3.sampling import sample_residual, warp

        p = self.params
        if self.sampler == "reference":
            gens = [self.generators[s] for s in self._host_slots]
            return lambda logits: sample_residual(logits, p, gens)
        seeds = self.seeds[slots]
        base = self.draws[slots]
        step = [0]

        def choose(logits: torch.Tensor) -> torch.Tensor:
            if not p.subtalker_do_sample:
                return torch.argmax(logits, dim=-1)
            scores = warp(logits.float(), p.subtalker_temperature, p.subtalker_top_k, p.subtalker_top_p)
            code = torch.argmax(scores + gumbel_noise(seeds, base + step[0], scores.shape[1]), dim=-1)
            step[0] += 1
            return code

        return choose

    # ---- the steps (eager or captured) --------------------------------------------------------------
    def _trailing(self, slots: torch.Tensor) -> torch.Tensor:
        tp = self.trail_pos[slots]
        emb = self.trail_buf[slots, tp.clamp(max=self.config.trailing_capacity - 1)]
        self.trail_pos[slots] = tp + 1
        return torch.where((tp < self.trail_len[slots])[:, None], emb, self.pad_embed)

    def _prefill_fn(self, slots, text_ids, codec_ids, lengths) -> None:
        talker = self.model.talker
        emb = talker.embed_text(text_ids)
        has_codec = codec_ids >= 0
        emb = torch.where(has_codec[..., None], emb + talker.embed_codec(codec_ids.clamp(min=0)), emb)
        self._prefill_embeds(slots, emb, lengths)

    def _prefill_embeds(self, slots, emb, lengths, starts=None, attend_len: int | None = None) -> None:
        """emb [B, S, D] (rows right-padded), lengths [B] -> each row's prompt in its slot, c0 sampled. With
        `starts` [B], row b holds its prompt's positions starts[b].. (its slot already holds those before: a
        voice prefix) and attends the slot's positions below `attend_len` (at least every start + length)."""
        B, S, _ = emb.shape
        # Contiguous, with or without starts, in every prefill (here and _prefill_prefixes): TorchDynamo guards
        # on strides, and a broadcast [B, S] beside a materialised one is one more compiled variant (~8 s).
        pos = torch.arange(S, device=self.device).repeat(B, 1)
        if starts is not None:
            # A padding position past a row's end may lie past the slot's end: it writes the last position,
            # which only this row's own later decode steps read, after writing it themselves.
            pos = (pos + starts[:, None]).clamp(max=self.config.max_len - 1)
        attend = S if attend_len is None else attend_len
        if self.fused_prefill:
            hidden = self.fused_talker.forward(emb, self.kv, slots, pos, attend)
        else:
            hidden = self.model.talker(emb, self.kv, slots, pos, attend_len=attend)
        last = hidden[torch.arange(B, device=self.device), lengths - 1]
        self._after_talker(slots, last, lengths if starts is None else starts + lengths)

    # ---- cloned voices' prompt prefixes (engine/voice_kv.py) -------------------------------------------
    def _voice_prefixes(self, requests: list[RequestState], embeds: list[torch.Tensor]) -> list[int]:
        """Put each request's voice prefix (Prompt.voice_prefix) in its slot and return, per request, how many
        leading prompt positions its slot now holds: copied from the voice cache, or, for a voice it lacks,
        prefilled once for the batch (in the slot of its first request, then kept). 0 without a prefix or a
        cache. Every request in a voice thus attends the same prefix K/V, made by a prefill of the prefix
        alone, whichever request came first."""
        cache = self.voice_kv
        if cache is None:
            return [0] * len(requests)
        keys = [r.prompt.voice_prefix_digest() for r in requests]
        entries: dict[bytes, torch.Tensor] = {}  # held for the batch: a put below may evict what a get found
        builders: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key is None or key in entries or key in builders:
                continue
            kv = cache.get(key)
            if kv is None:
                builders[key] = i
            else:
                entries[key] = kv
        if builders:
            first = [requests[i] for i in builders.values()]
            self._prefill_prefixes([r.slot for r in first],
                                   [embeds[i][: requests[i].prompt.voice_prefix] for i in builders.values()])
            for key, r in zip(builders, first):
                entries[key] = self._read_prefix(r.slot, r.prompt.voice_prefix)
                cache.put(key, entries[key])
            cache.count_misses(len(builders))
        copies = [(requests[i].slot, entries[key]) for i, key in enumerate(keys)
                  if key is not None and builders.get(key) != i]
        if copies:
            self._copy_prefixes(copies)
            cache.count_hits(len(copies), sum(kv.shape[2] for _, kv in copies))
        return [r.prompt.voice_prefix if key is not None else 0 for r, key in zip(requests, keys)]

    def _prefill_prefixes(self, slots: list[int], embeds: list[torch.Tensor]) -> None:
        """The Talker over prefixes alone (K/V written, nothing sampled), uncaptured: it runs once per voice."""
        from tts_backend.qwen3.generate import right_padded

        if self.fused_prefill and len(embeds) == 1:
            slots, embeds = slots + [self.scratch], embeds + [embeds[0][:1]]  # two rows: see _resume
        x = right_padded(embeds)
        B, S, _ = x.shape
        slots_t = self._upload(torch.tensor(slots, dtype=torch.long))
        pos = torch.arange(S, device=self.device).repeat(B, 1)  # as in _prefill_embeds
        if self.fused_prefill:
            self.fused_talker.forward(x, self.kv, slots_t, pos, S, final_norm=False)
        else:
            self.model.talker(x, self.kv, slots_t, pos, attend_len=S)

    def _read_prefix(self, slot: int, n: int) -> torch.Tensor:
        """Positions 0..n-1 of a slot's K/V -> [2, layers, n, kv heads, head dim] (position-major, so entries
        concatenate along positions for one scatter per layer)."""
        layers = range(len(self.kv.k))
        k = torch.stack([self.kv.k[i][slot, :, :n] for i in layers])
        v = torch.stack([self.kv.v[i][slot, :, :n] for i in layers])
        return torch.stack((k, v)).transpose(2, 3).contiguous()

    def _copy_prefixes(self, copies: list[tuple[int, torch.Tensor]]) -> None:
        """Each (slot, entry): the entry's K/V at positions 0.. of the slot; one scatter per layer and tensor for
        the whole batch."""
        rows: list[int] = []
        positions: list[int] = []
        for slot, kv in copies:
            n = kv.shape[2]
            rows += [slot] * n
            positions += range(n)
        src = copies[0][1] if len(copies) == 1 else torch.cat([kv for _, kv in copies], dim=2)
        index = self._upload(torch.tensor(rows + positions, dtype=torch.long))
        rows_t, pos_t = index[: len(rows)], index[len(rows):]
        for i in range(len(self.kv.k)):
            self.kv.k[i][rows_t, :, pos_t] = src[0, i]
            self.kv.v[i][rows_t, :, pos_t] = src[1, i]

    def _prime_codec(self, slot: int, ref_codes: torch.Tensor) -> None:
        """An in-context clone's audio continues its reference clip (the reference decodes ref ++ generated and
        cuts the reference's share): run the reference frames through the slot's fresh codec state, audio
        dropped. On the main stream, like the slot's reset (see the ordering notes at codec_launch)."""
        rows = self._upload(torch.tensor([slot], dtype=torch.long))
        codes_host = ref_codes.detach().to("cpu", torch.int64).contiguous()
        key = hashlib.sha256(codes_host.numpy().tobytes()).digest() + str(tuple(codes_host.shape)).encode()
        state = self.primed_codec.get(key)
        if state is None:
            codes = codes_host.to(self.device).T[None].contiguous()  # [1, G, F]
            # 64-frame pieces bound the activations of a long clip.
            state = self._codec_through(self.codec_pool.index_select(rows), codes, [64] * -(-codes.shape[2] // 64))
            self.primed_codec[key] = state
            while len(self.primed_codec) > self.config.primed_codec_states:
                self.primed_codec.popitem(last=False)
        else:
            self.primed_codec.move_to_end(key)
        self.codec_pool.index_copy_(rows, state)

    # ---- resume from codes -----------------------------------------------------------------------------
    def primed_from(self, frames: int) -> int:
        """The first of a resumed request's `frames` delivered frames that its codec priming runs
        (resume_codec_context); 0: all of them, after any reference priming."""
        context = self.config.resume_codec_context
        if context == "auto":
            context = None if self.resume_continues_schedule else 36
        return frames - context if context is not None and frames > context else 0

    def _primed_from(self, request: RequestState) -> int:
        return self.primed_from(request.resume.shape[0])

    @property
    def can_resume(self) -> bool:
        """Whether a request can go on after frames it delivered: the stateless sampler draws step i's noise
        from (seed, i) alone, so step k draws what the uninterrupted request drew there; the reference
        sampler's generators hold the state of every draw before, which the delivered codes do not give back
        (greedy decoding draws nothing)."""
        p = self.params
        return self.sampler == "stateless" or not (p.do_sample or p.subtalker_do_sample)

    def _resume(self, requests: list[RequestState]) -> list[bool]:
        """Requests that continue after their delivered frames (`RequestState.resume`, a host tensor [k, G] of
        codes): run the prompt and the k frames through the Talker, teacher-forced (frame i's input is the sum
        of its code embeddings plus the text token the step took: the trailing text in streaming-text mode,
        the pad otherwise, as _decode_fn makes it), set every per-slot counter as the uninterrupted request
        had it after k frames, prime the slot's codec state with the k frames (audio dropped) and sample
        codebook 0 of frame k with the request's own noise for that step. Their slots were made fresh
        (_fresh_slots). Returns per request whether it sampled EOS. See Qwen3RunnerConfig.resume_prefill for
        why the Talker pass is batched on a GPU and stepwise on the CPU."""
        from .request import schedule_pieces

        if not self.can_resume:
            raise ValueError("the reference sampler cannot resume a request from its codes; use sampler=stateless")
        m = self.model
        cap = self.config.trailing_capacity
        started = time.perf_counter()
        # Device time on the main stream of the inputs (with an uncaptured priming) and of the Talker pass, and
        # of a captured priming on the codec stream (with any codec work queued before it), beside their host
        # time, for the log below: a slow resume on the H100 was neither's host time alone.
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.device.type == "cuda" else []
        if events:
            events[0].record()
        # The codec's priming through its captured calls, for every resumed request at once, on the codec
        # stream beside the Talker pass (_prime_codec_captured); else one request at a time, before it.
        priming_buckets = self._codec_priming_buckets()
        primes = []
        # Every request's frames in one upload and one pass of embedding ops, split after: a failover resumes
        # its worker's streams together, and per request these were some twenty small launches from the host
        # (H100 drain: 15.8 ms before the Talker pass for 8 requests).
        ks = [r.resume.shape[0] for r in requests]
        host = torch.zeros(4, sum(ks), dtype=torch.long)
        at = 0
        for r, k in zip(requests, ks):
            steps = torch.arange(k)
            host[0, at: at + k] = steps.clamp(max=cap - 1)
            host[1, at: at + k] = r.slot
            host[2, at: at + k] = steps < self.trail_len_host[r.slot]
            at += k
        host[3, : len(requests)] = torch.tensor(ks)
        index = self._upload(host)
        all_codes = self._upload(torch.cat([r.resume for r in requests]))
        text = torch.where(index[2].bool()[:, None], self.trail_buf[index[1], index[0]], self.pad_embed)
        inputs = list((m.frame_embeds(all_codes[:, 0], all_codes[:, 1:]) + text).split(ks))
        slots_k = self._upload(torch.tensor([r.slot for r in requests], dtype=torch.long))
        self.trail_pos[slots_k] = index[3, : len(requests)]
        self.written[slots_k] = index[3, : len(requests)]

        def counters() -> None:
            self._resumed_counters(requests, slots_k, index[3, : len(requests)], index[1], all_codes[:, 0])
        for r, k, codes in zip(requests, ks, all_codes.split(ks)):
            first = self._primed_from(r)
            if priming_buckets:
                primes.append((r.slot, first, codes[first:]))  # the priming leaves decoded[slot] at k
                continue
            # The codec state the uninterrupted request's codec batches left. Where the schedule goes on (the
            # CPU) in the pieces its chunk schedule decoded (the codec's output depends on its call sizes in the
            # last bits; with the same pieces the state is the same, bit for bit); else in 64-frame pieces.
            if self.resume_continues_schedule and not first:
                pieces = schedule_pieces(r.chunk_schedule, k)
            else:
                pieces = [64] * (-(-(k - first) // 64))
            self._prime_codec_frames(r.slot, codes[first:], pieces)
            self.decoded[r.slot] = k
        priming = self._prime_codec_captured(primes, priming_buckets) if primes else None
        slot_list, slots_t = [r.slot for r in requests], slots_k
        primed = time.perf_counter()
        if events:
            events[1].record()
        if self.resume_batched:
            prompts = m.prompts_embeds([r.prompt for r in requests], self._upload)
            starts = self._voice_prefixes(requests, prompts)
            embeds = [torch.cat((e[s:], x)) for e, s, x in zip(prompts, starts, inputs)]
            counters()
            eos_rows = self._resume_pass(requests, embeds, starts)
        else:
            self._prompt_pass(requests, slot_list, slots_t)  # its sample is drawn again below, counters set
            last = []
            for r, x in zip(requests, inputs):  # one request at a time: each takes as many steps as it has frames
                slot = self._upload(torch.tensor([r.slot], dtype=torch.long))
                hidden = self.hidden[slot]
                for i in range(x.shape[0]):
                    pos = len(r.prompt) + i
                    hidden = self._talker_step(slot, x[i: i + 1], self._upload(torch.tensor([pos])), pos + 1)
                last.append(hidden)
            counters()
            self._host_slots = slot_list
            new_pos = self._upload(torch.tensor([len(r.prompt) + r.resume.shape[0] for r in requests]))
            self._after_talker(slots_t, torch.cat(last), new_pos)
        for r in requests:
            self.pos_host[r.slot] = len(r.prompt) + r.resume.shape[0]
        passed = time.perf_counter()
        if events:
            events[2].record()
        if priming is not None:
            # The slots' next frames write their frame rings, which the priming reads: they wait for it.
            torch.cuda.current_stream(self.device).wait_stream(self.codec_stream)
        eos = eos_rows.tolist() if self.resume_batched else self.eos_out[: len(requests)].tolist()  # waits
        # A resume is a failover or a hand-over: rare, and what it costs is the listener's pause.
        device = ""
        if events:
            device = (f"; on the device {events[0].elapsed_time(events[1]):.1f} and "
                      f"{events[1].elapsed_time(events[2]):.1f} ms")
            if priming is not None:
                priming[1].synchronize()
                device += f", the priming {priming[0].elapsed_time(priming[1]):.1f} ms on the codec stream beside them"
        log.info("resumed %d requests (%s frames) in %.1f ms: codec priming queued in %.1f ms, the Talker pass "
                 "in %.1f ms%s", len(requests), ",".join(str(r.resume.shape[0]) for r in requests),
                 1000 * (time.perf_counter() - started), 1000 * (primed - started), 1000 * (passed - primed), device)
        return eos

    def _resume_pass(self, requests: list[RequestState], embeds: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
        """The batched resume's Talker pass over each request's `embeds` (its prompt after the `starts`
        positions its slot already holds, then its delivered frames), c0 sampled; returns the EOS flags [N].
        Without voice prefixes, in groups of the most captured rows on the resume graphs where the longest
        fits one (resume_graph_shapes; eager where graphs are off, on the same padded inputs); a cloned
        voice's rest on the clone prefill's graphs where one fits (_prefill_rest); else uncaptured, at two rows
        at least."""
        from tts_backend.qwen3.generate import right_padded

        longest = max(e.shape[0] for e in embeds)
        most = max(self.resume_shapes, default=0)
        if not any(starts) and any(longest <= n for n in self.resume_shapes.get(most, ())):
            flags = []
            for first in range(0, len(requests), most):
                group, rest = requests[first: first + most], embeds[first: first + most]
                rows = next(b for b in self.resume_shapes if b >= len(group) and longest <= max(self.resume_shapes[b]))
                n = next(n for n in self.resume_shapes[rows] if n >= longest)
                self._replay_embeds(("resume", rows, n), group, rest, [0] * len(group))
                flags.append(self.eos_out[: len(group)].clone())
            return torch.cat(flags)
        slot_list = [r.slot for r in requests]
        attend = max(s + e.shape[0] for s, e in zip(starts, embeds))
        if any(starts) and self._embeds_graph(self._graph_bucket(len(requests), self.prefill_buckets), longest,
                                              attend) is not None:
            self._prefill_rest(requests, slot_list, self._upload(torch.tensor(slot_list, dtype=torch.long)), embeds,
                               starts)
            return self.eos_out[: len(requests)].clone()
        rows = self._upload(torch.tensor(slot_list, dtype=torch.long))
        if self.fused_prefill and len(embeds) == 1:
            # TorchDynamo traces a batch of one as a shape of its own, and each traced shape is an Inductor
            # compile of seconds on the engine thread (see decode_buckets): a padding row on the scratch slot
            # keeps the pass at two rows, as the captured prefill's buckets do.
            embeds, starts = embeds + [embeds[0][:1]], starts + [0]
            rows = self._upload(torch.tensor(slot_list + [self.scratch], dtype=torch.long))
        lengths = [e.shape[0] for e in embeds]
        up = self._upload(torch.tensor([lengths, starts], dtype=torch.long))
        self._host_slots = slot_list
        self.graphs.ran_uncaptured("resume")
        self._prefill_embeds(rows, right_padded(embeds), up[0], up[1], attend)
        return self.eos_out[: len(requests)].clone()

    def _resumed_counters(self, requests: list[RequestState], slots: torch.Tensor, frames: torch.Tensor,
                          frame_slots: torch.Tensor, c0: torch.Tensor) -> None:
        """The sampler's per-slot state as the uninterrupted request had it before it sampled frame k's
        codebook 0: the c0 codes it sampled (repetition penalty), how many (min_new_tokens), and the stateless
        noise draws it made (one per c0 when sampling, one per residual codebook). From what _resume uploaded,
        for every resumed request at once: their slots and delivered frame counts [N], and each delivered
        frame's slot and codebook-0 code [sum k] (one request at a time, these were an upload and four indexed
        writes a request)."""
        per_frame = int(self.params.do_sample) + self.model.num_code_groups - 1
        self.presence[slots] = False
        self.presence[frame_slots, c0] = True
        self.generated[slots] = frames.to(self.generated.dtype)
        self.draws[slots] = (frames * per_frame).to(self.draws.dtype)
        if self.sampler == "reference":
            for r in requests:
                self.history[r.slot] = r.resume[:, 0].tolist()

    def _prime_codec_frames(self, slot: int, codes: torch.Tensor, pieces: list[int]) -> None:
        """Run a resumed request's delivered frames [k, G] through its slot's codec state in `pieces`, audio
        dropped, so the next frame's audio joins the last delivered sample (the codec's left context is that
        of the uninterrupted request). After a cloned voice's reference priming, which it continues. On the
        main stream, like the slot's reset (see the ordering notes at codec_launch), uncaptured; where the
        codec's calls are captured, _prime_codec_captured primes every resumed request through them."""
        rows = self._upload(torch.tensor([slot], dtype=torch.long))
        frames = codes.clamp(0, self.codebook_size - 1).T[None].contiguous()  # [1, G, k]
        self.codec_pool.index_copy_(rows, self._codec_through(self.codec_pool.index_select(rows), frames, pieces))

    def _codec_priming_buckets(self) -> tuple[int, ...]:
        """The codec batch buckets whose largest frame count is captured, where the codec runs on its own
        stream: _prime_codec_captured's calls (empty: prime uncaptured, _prime_codec_frames)."""
        if not self.codec_async:
            return ()
        most = max(self.config.codec_frames)
        return tuple(b for b in self.codec_buckets if ("codec", most, b) in self.graphs)

    def _prime_codec_captured(self, primes: list[tuple[int, int, torch.Tensor]],
                              buckets: tuple[int, ...]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """_prime_codec_frames for every resumed request (slot, its first primed frame, the frames from there
        [k - first, G]) through the captured codec calls: the frames go into each slot's frame ring, at most
        the largest captured count at a time, and the requests with as many frames left are decoded together,
        as a codec batch of their own would be (audio dropped). Uncaptured, each frame count the codec had not
        run before cost 100-250 ms on the H100 (a failover of 7 streams: 1.7 s of priming before any of them
        spoke again); one request at a time, 8 resumed requests took 25-34 ms.

        On the codec stream, after what is queued there (the captured calls share its static buffers) and
        after the main stream's work so far (the slots' resets). The main stream does not wait for it here:
        the Talker pass neither reads nor writes the rings, the codec state or `decoded`, so the two run side
        by side, and `_resume` has the main stream wait before the slots' next frames write their rings.
        Returns the priming's start and end events on the codec stream."""
        stream, main = self.codec_stream, torch.cuda.current_stream(self.device)
        ring = self.config.frame_ring
        calls = priming_calls([(slot, codes.shape[0]) for slot, _, codes in primes], max(self.config.codec_frames),
                              max(buckets))
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        with torch.cuda.stream(stream):
            stream.wait_stream(main)
            events[0].record(stream)
            # Made on the codec stream, so that when they are freed only its later work may reuse their memory:
            # made on the main stream, the Talker pass could be handed it while these calls still read it.
            # (`primes`' own tensors, the main stream's, are the caller's until the main stream waits.)
            stacked = torch.cat([codes for _, _, codes in primes]).to(self.ring.dtype)
            offsets, firsts, at = {}, {}, 0
            for slot, first, codes in primes:
                offsets[slot], firsts[slot], at = at, first, at + codes.shape[0]
            writes = self._upload(priming_ring_writes(calls, offsets, ring, firsts))
            self.decoded[self._upload(torch.tensor(list(offsets), dtype=torch.long))] = \
                self._upload(torch.tensor(list(firsts.values()), dtype=torch.long))
            column = 0
            for start, n, slots in calls:
                w = writes[:, column: column + n * len(slots)]
                column += n * len(slots)
                self.ring[w[0], w[1]] = stacked[w[2]]
                b = _bucket(len(slots), buckets)
                rows = self._upload(torch.tensor(slots + [self.scratch] * (b - len(slots)), dtype=torch.long))
                self._run_codec(rows, n, b)  # advances decoded[slot] by n for each
            events[1].record(stream)
        return events

    def _codec_through(self, state: CodecState, codes: torch.Tensor, pieces: list[int]) -> CodecState:
        """A one-row codec state after frames [1, G, F] went through it in `pieces` (audio dropped), uncaptured.
        With the compiled codec it runs as two rows, the second a copy of the first and dropped after:
        TorchDynamo traces a batch of one as a shape of its own, each traced shape is an Inductor compile of
        seconds on the engine thread, and every captured codec call has two rows or more (H100, resume check:
        the first resumed request's audio came 34 s late)."""
        from tts_backend.qwen3.codec import CodecState

        rows = 2 if self.codec_compiled else 1
        if rows == 2:
            state, codes = CodecState.cat([state, state]), codes.expand(2, -1, -1).contiguous()
        start = 0
        for n in pieces:
            self.codec_module.decode_chunk(codes[..., start: start + n], state)
            start += n
        return state.index_select([0]) if rows == 2 else state

    def _after_talker(self, slots, hidden, new_pos) -> None:
        self.hidden[slots] = hidden
        self.pos[slots] = new_pos
        logits = self.model.talker.logits(hidden).float()
        c0 = self._sample_c0(logits, slots)
        self.c0[slots] = c0
        self.eos_out[: slots.shape[0]] = c0 == self.eos_id
        self.pos.narrow(0, self.scratch, 1).fill_(0)  # padding rows must never walk off the scratch slot's end

    def _decode_fn(self, slots: torch.Tensor, attend_len: int) -> None:
        x = self.next_embed[slots] + self._trailing(slots)
        pos = self.pos[slots]
        self._after_talker(slots, self._talker_step(slots, x, pos, attend_len), pos + 1)

    def _talker_step(self, slots: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, attend_len: int) -> torch.Tensor:
        """One Talker position per row: inputs x [B, D] at positions pos [B] -> hidden [B, D], KV written."""
        if self.triton:
            return self.fused_talker.decode(x, self.kv, slots, pos)
        if self.fused:
            return self.fused_talker.forward(x[:, None], self.kv, slots, pos[:, None], attend_len)[:, 0]
        return self.model.decode_step(self.kv, slots, pos, x, attend_len)

    def _cp_fn(self, slots: torch.Tensor) -> None:
        m = self.model
        B = slots.shape[0]
        c0 = self.c0[slots]
        if self.fused:
            draws = self.draws[slots]
            residual, frame_embed = self.fused_cp.run(self.hidden[slots], c0, self.cp_cache, self.cp_rows[:B],
                                                      self.seeds[slots], draws)
            self.draws[slots] = draws + residual.shape[1]
        else:
            choose = self._residual_chooser(slots)
            residual = m.residual_codes(self.cp_cache, self.cp_rows[:B], self.hidden[slots], c0, choose)
            if self.sampler == "stateless":
                self.draws[slots] = self.draws[slots] + residual.shape[1]
            frame_embed = m.frame_embeds(c0, residual)
        written = self.written[slots]
        self.ring[slots, written % self.config.frame_ring] = torch.cat((c0[:, None], residual), dim=1)
        self.written[slots] = written + 1
        self.next_embed[slots] = frame_embed

    def _codec_fn(self, slots: torch.Tensor, frames: int, state, wav_out: torch.Tensor | None = None,
                  codes_out: torch.Tensor | None = None) -> None:
        """Decode `frames` frames of each slot into `wav_out` and `codes_out` (default: the codec stream's)."""
        start = self.decoded[slots]
        idx = (start[:, None] + self.frame_offsets[:frames][None]) % self.config.frame_ring
        codes = self.ring[slots[:, None], idx].clamp(0, self.codebook_size - 1)  # [B, f, G]
        if state is None:
            state = self.codec_pool.index_select(slots)
        else:
            state.copy_rows_from_(self.codec_pool, slots)
        wav = self.codec_module.decode_chunk(codes.transpose(1, 2).contiguous(), state)
        self.codec_pool.index_copy_(slots, state)
        self.decoded[slots] = start + frames
        wav_out = self.wav_out if wav_out is None else wav_out
        codes_out = self.codes_out if codes_out is None else codes_out
        wav_out[: slots.shape[0], : wav.shape[1]] = wav
        codes_out[: slots.shape[0], :frames] = codes

    # ---- the ModelRunner interface ----------------------------------------------------------------------
    def _slots(self, requests: list[RequestState], bucket: int | None) -> torch.Tensor:
        slots = [r.slot for r in requests]
        self._host_slots = slots
        if bucket is not None:
            slots = slots + [self.scratch] * (bucket - len(slots))
        return self._upload(torch.tensor(slots, dtype=torch.long))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device without waiting for the device. Only a copy from pinned memory
        is asynchronous: from pageable memory CUDA syncs the stream before it stages the bytes, so each
        pushed word and each prefill held the engine thread for the rest of the frame in flight (H100, token
        mode at 30 sessions/s: 2.5 ms per decision, 36 % of the thread, with `non_blocking=True` on pageable
        memory as much as without it). The pinned block comes from PyTorch's caching host allocator, which
        keeps it from reuse until the copy has run, so `host` may be dropped at once."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _graph_bucket(self, n: int, buckets: Sequence[int]) -> int | None:
        return _bucket(n, buckets) if self.graphs.enabled else None

    @torch.inference_mode()
    def prefill(self, requests: list[RequestState]) -> list[bool] | None:
        slot_list = [r.slot for r in requests]
        slots_t = self._upload(torch.tensor(slot_list, dtype=torch.long))
        self._fresh_slots(requests, slots_t)
        resuming = [r for r in requests if r.resume is not None]
        if not resuming:
            self._prompt_pass(requests, slot_list, slots_t)
            return None
        plain = [r for r in requests if r.resume is None]
        if plain:
            self._prompt_pass(plain, [r.slot for r in plain], self._upload(torch.tensor(
                [r.slot for r in plain], dtype=torch.long)))
        eos = dict(zip((r.request_id for r in resuming), self._resume(resuming)))
        return [eos.get(r.request_id, False) for r in requests]

    def _fresh_slots(self, requests: list[RequestState], slots_t: torch.Tensor) -> None:
        """Reset the new requests' per-slot state: counters, seeds, trailing text, codec state (a cloned
        voice's primed with its reference frames)."""
        import secrets

        m = self.model
        # Fresh per-slot state for the new requests.
        for buf in (self.presence, self.generated, self.draws, self.written, self.decoded, self.trail_pos,
                    self.trail_len):
            buf[slots_t] = 0
        self.codec_pool.reset_(slots_t)
        seeds = [r.seed if r.seed is not None else secrets.randbits(31) for r in requests]
        self.seeds[slots_t] = self._upload(torch.tensor(seeds, dtype=torch.long))
        for r, seed in zip(requests, seeds):
            prompt = r.prompt
            if len(prompt) + r.max_frames + 1 > self.config.max_len:
                raise ValueError(f"prompt of {len(prompt)} positions plus {r.max_frames} frames exceeds max_len")
            if prompt.trailing:
                n = len(prompt.trailing)
                if n > self.config.trailing_capacity:
                    raise ValueError(f"{n} trailing text tokens exceed trailing_capacity")
                self.trail_buf[r.slot, :n] = m.talker.embed_text(self._upload(torch.tensor(prompt.trailing)))
                self.trail_len[r.slot] = n
            self.trail_len_host[r.slot] = len(prompt.trailing)
            self.pos_host[r.slot] = len(prompt)
            if self.sampler == "reference":
                self.generators[r.slot] = torch.Generator(device=self.device).manual_seed(seed)
                self.history[r.slot] = []
        cloned = [r for r in requests if r.prompt.speaker_embedding is not None]
        for r in cloned:
            # A resume whose priming starts after its first frames starts from a fresh state (_primed_from).
            if r.prompt.ref_codes is not None and (r.resume is None or not self._primed_from(r)):
                self._prime_codec(r.slot, r.prompt.ref_codes)

    def _prompt_pass(self, requests: list[RequestState], slot_list: list[int], slots_t: torch.Tensor) -> None:
        """The Talker over each request's prompt (captured where a bucket fits), codebook 0 of frame 0 sampled."""
        from tts_backend.qwen3.prompt import NO_CODEC

        m = self.model
        cloned = [r for r in requests if r.prompt.speaker_embedding is not None]
        if cloned:
            # A cloned voice's prompt carries vectors (its x-vector, its reference frames) that the id tracks
            # of the captured prefill cannot hold: the batch's embeddings are made here (a few lookups and a
            # sum per frame) and enter a prefill graph captured on embeddings, padded to its bucket as the id
            # prefill is (pad rows on the scratch slot; positions past a row's end are overwritten by its own
            # decode steps before any query sees them). Without a bucket (too long a prompt) it runs uncaptured.
            # A voice prefix in the cache is copied into the slot first; only the rest is prefilled.
            embeds = m.prompts_embeds([r.prompt for r in requests], self._upload)
            starts = self._voice_prefixes(requests, embeds)
            self._prefill_rest(requests, slot_list, slots_t, [e[s:] for e, s in zip(embeds, starts)], starts)
            return
        longest = max(len(r.prompt) for r in requests)
        b = self._graph_bucket(len(requests), self.prefill_buckets)
        n = self._graph_bucket(longest, self.config.prefill_len_buckets)
        captured = b is not None and n is not None and ("prefill", b, n) in self.graphs
        if captured or self.fused:
            if not captured:
                b, n = len(requests), longest
            text = torch.zeros(b, n, dtype=torch.long)
            codec = torch.full((b, n), NO_CODEC, dtype=torch.long)
            lengths = torch.ones(b, dtype=torch.long)
            for i, r in enumerate(requests):
                k = len(r.prompt)
                text[i, :k] = torch.tensor(r.prompt.text_track)
                codec[i, :k] = torch.tensor(r.prompt.codec_track)
                lengths[i] = k
            slots = self._slots(requests, b)
            inputs = [slots, self._upload(text), self._upload(codec), self._upload(lengths)]
            self.graphs.run(("prefill", b, n), self._prefill_fn, inputs)
            return
        # Eager: exactly the model's own prefill (right-padded to the longest prompt of the batch).
        self.graphs.ran_uncaptured("prefill")
        self._host_slots = slot_list
        embeds = m.prompts_embeds([r.prompt for r in requests], self._upload)
        hidden = m.prefill(self.kv, slots_t, embeds)
        lengths_t = self._upload(torch.tensor([len(r.prompt) for r in requests], dtype=torch.long))
        self._after_talker(slots_t, hidden, lengths_t)

    def _prefill_rest(self, requests: list[RequestState], slot_list: list[int], slots_t: torch.Tensor,
                      rest: list[torch.Tensor], starts: list[int]) -> None:
        """Embeddings `rest` [S_i, D] of each request's positions starts[i].. through the Talker, c0 sampled: on
        the captured bucket of (rest positions, attended positions) where one fits, else the square bucket of
        the attended positions, else uncaptured."""
        from tts_backend.qwen3.generate import right_padded

        count = len(requests)
        lengths = [e.shape[0] for e in rest]
        attend = max(s + n for s, n in zip(starts, lengths))
        b = self._graph_bucket(count, self.prefill_buckets)
        key = self._embeds_graph(b, max(lengths), attend)
        if key is not None:
            self._replay_embeds(key, requests, rest, starts)
            return
        up = self._upload(torch.tensor([lengths, starts], dtype=torch.long))
        self._host_slots = slot_list
        self.graphs.ran_uncaptured("prefill_rest")
        self._prefill_embeds(slots_t, right_padded(rest), up[0], up[1], attend)

    def _replay_embeds(self, key: tuple, requests: list[RequestState], rest: list[torch.Tensor],
                       starts: list[int]) -> None:
        """Embeddings `rest` [S_i, D] of each request's positions starts[i].. on the captured embeddings prefill
        `key` (key[1] rows, key[2] positions run, key[-1] attended; eager on the same inputs where graphs are
        off): the rows padded on the scratch slot with one position each, every row right-padded."""
        rows, count = key[1], len(requests)
        host = torch.zeros(2, rows, dtype=torch.long)
        host[0] = 1  # padding rows: one position at the scratch slot's start
        host[0, :count] = torch.tensor([e.shape[0] for e in rest], dtype=torch.long)
        host[1, :count] = torch.tensor(starts, dtype=torch.long)
        up = self._upload(host)
        x = rest[0].new_zeros(rows, key[2], rest[0].shape[-1])
        for i, e in enumerate(rest):
            x[i, : e.shape[0]] = e
        self.graphs.run(key, lambda *a: self._prefill_embeds(*a, attend_len=key[-1]),
                        [self._slots(requests, rows), x, up[0], up[1]])

    def _embeds_graph(self, b: int | None, rest: int, attend: int) -> tuple | None:
        """The captured embeddings prefill for `b` rows of at most `rest` new positions attending `attend`
        (key[2]: the positions it runs, key[-1]: those it attends)."""
        k = self._graph_bucket(attend, self.clone_len_buckets)
        if b is None or k is None:
            return None
        q = _bucket(rest, self.rest_len_buckets)
        for key in (("prefill_rest", b, q, k), ("prefill_embeds", b, k)):
            if key in self.graphs:
                return key
        return None

    @torch.inference_mode()
    def frame(self, requests: list[RequestState],
              admit: Callable[[], list[RequestState]] | None = None) -> list[bool]:
        """The Talker step of the streams that need one, then the predictor for every stream that did not
        sample EOS. Reading the EOS flags between the two costs one launch latency of idle device per frame
        (tens of microseconds of a 5-11 ms frame); it keeps every frame the predictor makes a frame the
        engine counts. The host waits there for the Talker step, so that is where the engine takes in the
        requests submitted meanwhile (`admit`): their prefill runs before this frame's predictor, which then
        makes their first frame too."""
        stepping = [r for r in requests if r.phase is Phase.NEED_DECODE]
        eos = iter(self.decode(stepping) if stepping else [])
        stops = [next(eos) if r.phase is Phase.NEED_DECODE else False for r in requests]
        predicting = [r for r, stop in zip(requests, stops) if not stop]
        if admit is not None:
            predicting += admit()
        if predicting:
            self.code_predict(predicting)
        return stops

    @torch.inference_mode()
    def code_predict(self, requests: list[RequestState]) -> None:
        b = self._graph_bucket(len(requests), self.decode_buckets)
        slots = self._slots(requests, b)
        self.graphs.run(("cp", b), self._cp_fn, [slots])

    @torch.inference_mode()
    def decode(self, requests: list[RequestState]) -> list[bool]:
        longest = max(self.pos_host[r.slot] for r in requests) + 1
        for r in requests:
            self.pos_host[r.slot] += 1
        b = self._graph_bucket(len(requests), self.decode_buckets)
        slots = self._slots(requests, b)
        if b is None:
            self.graphs.ran_uncaptured("decode")
            self._decode_fn(slots, longest)  # eager: attend exactly the positions in use
        else:
            a = _bucket(longest, self.attend_buckets)
            self.graphs.run(("decode", b, a), lambda s: self._decode_fn(s, a), [slots])
        return self.eos_out[: len(requests)].tolist()

    # Ordering of the codec stream against the main stream (CUDA, codec_async). Per slot, the codec reads
    # `ring` (frames decoded .. decoded+frames-1, mod frame_ring) and reads and writes `codec_pool` and
    # `decoded`; the main stream writes `ring` and `written` (code predictor) and resets all of them for a
    # new request's slot (prefill).
    # - The frames a codec batch reads were written by code-predictor steps issued before the launch: the
    #   codec stream waits on the main stream before it starts.
    # - Code-predictor steps issued while a batch is in flight write ring position `written`, which is at
    #   least decoded + frames and at most decoded + max_pending_frames - 1 (the scheduler stops generation
    #   at max_pending_frames, counted from the engine's frames_decoded, which advances only at collect), so
    #   with max_pending_frames <= frame_ring (the backend uses frame_ring minus the largest chunk) they never
    #   hit a position the batch reads.
    # - Prefill resets the rows of its own slots only, and the engine frees the slot of a finished or
    #   cancelled request only after it collected the codec batch covering that slot: the host saw the
    #   batch's event complete before it issued the prefill that reuses the slot, so no stream wait is needed.
    # - Padding rows of both streams point at the scratch slot; what they race on there is discarded (ring
    #   codes are clamped and `decoded` is taken mod frame_ring before use, so garbage stays in range).
    # - Codec graph temporaries live in a graph pool of their own; eager codec temporaries are allocated on
    #   the codec stream, so the caching allocator hands them only to later codec-stream work.
    # - The first-chunk lane's batch runs concurrently with the codec stream's: its requests are in no batch
    #   of the codec stream (the engine puts a request in one batch in flight at a time), so the two touch
    #   disjoint rows of `codec_pool` and `decoded` but for the scratch slot's padding rows, raced on as above;
    #   its static inputs, codec state, outputs, host buffers and graph pool are its own (_CodecLane). It
    #   waits on the main stream at launch as the codec stream does.
    @torch.inference_mode()
    def codec_launch(self, requests: list[RequestState], frames: int, lane: bool = False) -> CodecHandle:
        if lane:
            return self._lane_launch(requests, frames)
        if len(self._codec_in_flight) >= self.codec_depth:
            raise RuntimeError(f"{self.codec_depth} codec batches in flight; collect the oldest before launching")
        n = len(requests)
        samples = frames * self.samples_per_frame
        b = self._graph_bucket(n, self.codec_buckets)
        if not self.codec_async:
            self._run_codec(self._slots(requests, b), frames, b)
            # A copy, never a view of wav_out (on the CPU .float().cpu() would be one): the next batch
            # overwrites wav_out while the engine may still hold these arrays (the silence trimmer does).
            wav = self.wav_out[:n, :samples].to("cpu", torch.float32, copy=True).numpy()
            codes = self.codes_out[:n, :frames].to("cpu", copy=True).numpy().astype("<u2")
            return CodecHandle(n, frames, pcm=[wav[i] for i in range(n)], codes=[c.tobytes() for c in codes])
        # The buffers of a batch that was collected: its copies out of them are complete.
        io = self.codec_io[0]
        self.codec_io.rotate(-1)
        handle = self._launch_async(requests, frames, b, self.codec_stream, io, self.wav_out, self.codes_out,
                                    lambda slots: self._run_codec(slots, frames, b))
        self._codec_in_flight.append(handle)
        return handle

    def _launch_async(self, requests: list[RequestState], frames: int, b: int | None, stream, io: _CodecIO,
                      wav_out: torch.Tensor, codes_out: torch.Tensor, run) -> _AsyncCodecHandle:
        """`run(slots)` (a codec call writing wav_out / codes_out) on `stream` after the main stream's work,
        its PCM and codes copied into io's pinned buffers, and the handle that collects them."""
        n = len(requests)
        samples = frames * self.samples_per_frame
        slots_host = io.slots_host[: b or n]
        slots_host.fill_(self.scratch)
        slots_host[:n] = torch.tensor([r.slot for r in requests], dtype=torch.long)
        host = io.pcm_host[: n * samples].view(n, samples)
        codes_host = io.codes_host[: n * frames * self.model.num_code_groups].view(n, frames, -1)
        main = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.stream(stream):
                slots = slots_host.to(self.device, non_blocking=True)
                stream.wait_stream(main)
                io.started.record(stream)
                run(slots)
                # wav_out[:n, :samples] is strided: copy_ makes it contiguous on this stream, then copies async.
                host.copy_(wav_out[:n, :samples], non_blocking=True)
                codes_host.copy_(codes_out[:n, :frames], non_blocking=True)
                io.done.record(stream)
        except Exception:
            # The engine frees these slots once the launch failed: let what was queued finish first.
            stream.synchronize()
            raise
        return _AsyncCodecHandle(n, frames, host=host, codes_host=codes_host, started=io.started, done=io.done)

    def _lane_launch(self, requests: list[RequestState], frames: int) -> CodecHandle:
        lane, n = self.lane, len(requests)
        if lane is None or self.first_chunk_lane is None:
            raise RuntimeError("this runner has no first-chunk lane")
        if lane.handle is not None:
            raise RuntimeError("a first-chunk batch is in flight; collect it before launching another")
        b = _bucket(n, self.lane_buckets)
        if b is None or frames != self.config.first_chunk_frames:
            raise ValueError(f"the first-chunk lane takes up to {max(self.lane_buckets)} requests of "
                             f"{self.config.first_chunk_frames} frames, not {n} of {frames}")
        lane.handle = self._launch_async(
            requests, frames, b, lane.stream, lane.io, lane.wav_out, lane.codes_out,
            lambda slots: self.graphs.run(("codec_lane", frames, b), lambda s: self._codec_fn(
                s, frames, lane.static[b], lane.wav_out, lane.codes_out), [slots]))
        return lane.handle

    def codec_collect(self, handle: CodecHandle) -> list[np.ndarray] | None:
        if handle.pcm is None:
            if not self._settled(handle, block=False):
                return None
            self._take_pcm(handle)
        return handle.pcm

    def codec_wait(self, handle: CodecHandle) -> list[np.ndarray]:
        if handle.pcm is None:
            self._settled(handle, block=True)
            self._take_pcm(handle)
        return handle.pcm

    def _settled(self, handle: _AsyncCodecHandle, block: bool) -> bool:
        try:
            if block:
                handle.done.synchronize()
                return True
            return handle.done.query()
        except Exception:
            self._forget(handle)  # the engine fails the batch and goes on; accept the next launch
            raise

    def _forget(self, handle: CodecHandle) -> None:
        if handle in self._codec_in_flight:
            self._codec_in_flight.remove(handle)
        if self.lane is not None and self.lane.handle is handle:
            self.lane.handle = None

    def _take_pcm(self, handle: _AsyncCodecHandle) -> None:
        self._forget(handle)
        # Copy out of the pinned buffer: the next batch overwrites it, and the engine may keep the arrays
        # (the leading-silence trimmer holds on to them).
        wav = handle.host.to(torch.float32, copy=True).numpy()
        handle.pcm = [wav[i] for i in range(handle.count)]
        codes = handle.codes_host.numpy().astype("<u2")  # a copy, for the same reason
        handle.codes = [c.tobytes() for c in codes]
        handle.device_s = handle.started.elapsed_time(handle.done) / 1000.0

    def _run_codec(self, slots: torch.Tensor, frames: int, b: int | None) -> None:
        if b is None:
            self.graphs.ran_uncaptured("codec")
            self._codec_fn(slots, frames, None)
            return
        pieces = self._codec_pieces(frames, b)
        if len(pieces) == 1:
            self.graphs.run(("codec", frames, b), lambda s: self._codec_fn(s, frames, self.codec_static[b]), [slots])
            return
        # Each piece writes its audio and codes at the front of wav_out / codes_out: gather them in order, then
        # put the whole call's there, where codec_launch reads it.
        spf, done = self.samples_per_frame, 0
        for n in pieces:
            self.graphs.run(("codec", n, b), lambda s, n=n: self._codec_fn(s, n, self.codec_static[b]), [slots])
            self.wav_stage[:b, done * spf: (done + n) * spf] = self.wav_out[:b, : n * spf]
            self.codes_stage[:b, done: done + n] = self.codes_out[:b, :n]
            done += n
        self.wav_out[:b, : frames * spf] = self.wav_stage[:b, : frames * spf]
        self.codes_out[:b, :frames] = self.codes_stage[:b, :frames]

    def _codec_pieces(self, frames: int, b: int) -> list[int]:
        """`frames` as the codec counts captured for bucket b (codec_pieces)."""
        return codec_pieces(frames, [f for f in self.config.codec_frames if ("codec", f, b) in self.graphs])

    def push_text(self, request: RequestState, tokens: list) -> None:
        error = self.push_texts([(request, tokens)])[0]
        if error is not None:
            raise error

    @torch.inference_mode()
    def push_texts(self, pushes: list[tuple[RequestState, list]]) -> list[Exception | None]:
        """Text ids for streaming-text requests. Before its prefill they join a request's prompt trailing
        text, which the prefill writes; after it, they go into the slot's trailing buffer after what it
        holds, on the main stream between two steps, where the next decode step (eager or captured: it reads
        trail_buf and trail_len, never a copy) finds them. Every word of the turn goes up in one pinned copy
        and through one embedding: in token mode words come hundreds a second (20 sessions x 40 words/s),
        and a copy, a lookup and two writes each were a dozen launches per word on the engine thread."""
        capacity = self.config.trailing_capacity
        errors: list[Exception | None] = []
        ids: list[int] = []
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        for request, tokens in pushes:
            if request.phase in (Phase.WAITING, Phase.NEED_PREFILL):
                held = len(request.prompt.trailing)
            else:
                held = self.trail_len_host[request.slot]
            if held + len(tokens) > capacity:
                errors.append(ValueError(f"text too long for streaming-text mode: more than {capacity} tokens"))
                continue
            errors.append(None)
            if request.phase in (Phase.WAITING, Phase.NEED_PREFILL):
                request.prompt.trailing.extend(tokens)
                continue
            ids.extend(tokens)
            rows.extend([request.slot] * len(tokens))
            positions.extend(range(held, held + len(tokens)))
            self.trail_len_host[request.slot] = held + len(tokens)
            slots.append(request.slot)
            lengths.append(held + len(tokens))
        if ids:
            n, k = len(ids), len(slots)
            up = self._upload(torch.tensor(ids + rows + positions + slots + lengths, dtype=torch.long))
            self.trail_buf[up[n: 2 * n], up[2 * n: 3 * n]] = self.model.talker.embed_text(up[:n])
            self.trail_len[up[3 * n: 3 * n + k]] = up[3 * n + k:]
        return errors

    def release(self, request: RequestState) -> None:
        self.generators.pop(request.slot, None)
        self.history.pop(request.slot, None)


@dataclass
class _CodecIO:
    """What the host hands one codec batch in flight and takes back from it."""

    slots_host: torch.Tensor
    pcm_host: torch.Tensor
    codes_host: torch.Tensor
    started: torch.cuda.Event
    done: torch.cuda.Event


@dataclass
class _CodecLane:
    """The first-chunk lane's stream and everything its graphs read or write but the per-slot state."""

    stream: torch.cuda.Stream
    static: dict  # batch bucket -> CodecState, the captured graphs' static codec state
    wav_out: torch.Tensor
    codes_out: torch.Tensor
    io: _CodecIO
    handle: CodecHandle | None = None  # the batch in flight


@dataclass(eq=False)
class _AsyncCodecHandle(CodecHandle):
    """A batch launched on the codec stream: its PCM lands in `host` (pinned) once `done` has completed."""

    host: torch.Tensor | None = None
    codes_host: torch.Tensor | None = None
    started: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
