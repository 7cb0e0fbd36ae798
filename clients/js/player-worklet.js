// AudioWorklet processor of StreamPlayer (player.js): plays streamed 16-bit PCM with a jitter buffer.
//
// The main thread posts sentences' samples as they arrive, at the stream's rate; this processor resamples
// them to the AudioContext's rate, queues them, and starts playing once `prerollMs` of audio is buffered
// (or the sentence is complete), so that network jitter does not turn into clicks. Running dry in the
// middle of a sentence is an underrun: it is counted, and playback waits for a fresh pre-roll. Running
// dry after a sentence's last sample is not an underrun: the next sentence's text may simply not exist yet
// while an LLM is still writing it. The listener hears that silence all the same, so when the next
// sentence starts after `audibleGapMs` or more of it, it is counted as a gap (`gaps`, `gapFrames`, a `gap`
// event). Silence before a new request (`request`) or after an interrupt is no gap.
//
// `tag` names a sentence (any cloneable value, unique among sentences not yet fully played).
//
// Messages in (port.postMessage):
//   {type: "write", samples: Int16Array, sampleRate, tag}   audio of sentence `tag`
//   {type: "segment-end", tag}                              sentence `tag` has no more audio
//   {type: "interrupt"}                                      drop everything queued, now
//   {type: "drain-check", id}                                answer `drain` once all written so far played
//   {type: "request"}                                        new text was sent: the silence so far is no gap
//   {type: "config", prerollMs}
// Messages out: {event: "stats", ...counters}, {event: "segment-start", tag, contextTime, frame},
//   {event: "underrun", tag}, {event: "gap", tag, frames}, {event: "drained"},
//   {event: "interrupted", droppedFrames, droppedByTag},
//   {event: "drain", id, interrupted}. Stats are posted just before `interrupted` and `drain`, so that
//   the counters a listener reads then are current.

const STATS_EVERY_QUANTA = 16; // ~43 ms at 48 kHz

class VoxgatePlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const settings = options.processorOptions || {};
    this.prerollFrames = Math.round(((settings.prerollMs ?? 50) * sampleRate) / 1000);
    this.audibleGapFrames = Math.round(((settings.audibleGapMs ?? 150) * sampleRate) / 1000);
    this.queue = []; // [{data: Float32Array at context rate, read: index, tag}]
    this.bufferedFrames = 0;
    this.state = "idle"; // idle -> buffering -> playing -> (idle | buffering)
    this.completeTags = new Set(); // sentences whose last sample is queued
    this.startedTags = new Set();
    this.resampler = { inputRate: 0, position: 0, previous: 0 };
    this.counters = {
      samplesReceived: 0, // input samples, at the stream's rate
      framesQueued: 0, // after resampling, at the context's rate
      framesPlayed: 0, // audio frames written to the output (silence excluded)
      underruns: 0,
      underrunFrames: 0, // silence played while starved inside a sentence
      gaps: 0, // silences of at least audibleGapMs between a sentence's end and the next one's start
      gapFrames: 0, // their length
      interrupts: 0,
      droppedFrames: 0, // discarded by interrupts
    };
    this.lastTag = undefined; // sentence of the last frame played
    this.silentSince = null; // the frame at which the queue ran dry after a sentence's last sample
    this.quanta = 0;
    this.drainChecks = []; // ids of drain-checks waiting for the queue to empty
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(message) {
    switch (message.type) {
      case "write":
        this.write(message.samples, message.sampleRate, message.tag);
        break;
      case "segment-end":
        this.completeTags.add(message.tag);
        break;
      case "interrupt": {
        const dropped = this.bufferedFrames;
        const droppedByTag = new Map();
        for (const segment of this.queue) {
          droppedByTag.set(segment.tag, (droppedByTag.get(segment.tag) ?? 0) + segment.data.length - segment.read);
        }
        this.queue = [];
        this.bufferedFrames = 0;
        this.forgetSentences();
        this.resampler = { inputRate: 0, position: 0, previous: 0 };
        this.silentSince = null;
        this.counters.interrupts += 1;
        this.counters.droppedFrames += dropped;
        this.postStats();
        this.port.postMessage({ event: "interrupted", droppedFrames: dropped, droppedByTag });
        this.answerDrainChecks(true);
        break;
      }
      case "drain-check":
        // Messages arrive in order, so every write posted before this one is in the queue already.
        this.drainChecks.push(message.id);
        if (this.queue.length === 0) this.answerDrainChecks(false);
        break;
      case "request":
        this.silentSince = null;
        break;
      case "config":
        if (message.prerollMs !== undefined) this.prerollFrames = Math.round((message.prerollMs * sampleRate) / 1000);
        break;
      default:
        break;
    }
  }

  write(samples, inputRate, tag) {
    this.counters.samplesReceived += samples.length;
    const data = this.resample(samples, inputRate);
    if (data.length === 0) return;
    this.queue.push({ data, read: 0, tag });
    this.bufferedFrames += data.length;
    this.counters.framesQueued += data.length;
    if (this.state === "idle") this.state = "buffering";
  }

  // Linear interpolation with its phase carried across chunks, so that a sentence split into many frames
  // resamples exactly as if it had arrived whole. Position is measured in input samples from `previous`
  // (the last sample of the preceding chunk). Upsampling a speech band this way is clean enough for
  // monitoring; equal rates are passed through untouched.
  resample(samples, inputRate) {
    const n = samples.length;
    if (inputRate === sampleRate) {
      const out = new Float32Array(n);
      for (let i = 0; i < n; i++) out[i] = samples[i] / 32768;
      return out;
    }
    const state = this.resampler;
    if (state.inputRate !== inputRate) {
      state.inputRate = inputRate;
      state.position = 0;
      state.previous = 0;
    }
    const step = inputRate / sampleRate;
    const count = Math.max(0, Math.ceil((n - state.position) / step));
    const out = new Float32Array(count);
    let position = state.position;
    for (let k = 0; k < count; k++) {
      const index = Math.floor(position);
      const fraction = position - index;
      const a = index === 0 ? state.previous : samples[index - 1] / 32768;
      const b = samples[index] / 32768;
      out[k] = a + (b - a) * fraction;
      position += step;
    }
    state.position = position - n;
    if (n > 0) state.previous = samples[n - 1] / 32768;
    return out;
  }

  process(inputs, outputs) {
    const output = outputs[0];
    const channel = output[0];
    const frames = channel.length;
    let written = 0;

    if (this.state === "buffering") {
      // A sentence shorter than the pre-roll (or its tail after an underrun) plays once it is complete.
      const newest = this.queue[this.queue.length - 1];
      const allComplete = newest !== undefined && this.completeTags.has(newest.tag);
      if (this.bufferedFrames >= this.prerollFrames || allComplete) this.state = "playing";
    }

    while (this.state === "playing" && written < frames) {
      const segment = this.queue[0];
      if (!segment) {
        this.onStarved(currentFrame + written);
        break;
      }
      if (segment.read === 0 && !this.startedTags.has(segment.tag)) {
        this.startedTags.add(segment.tag);
        if (this.silentSince !== null) this.endGap(segment.tag, currentFrame + written - this.silentSince);
        this.port.postMessage({
          event: "segment-start",
          tag: segment.tag,
          contextTime: currentTime + written / sampleRate,
          frame: currentFrame + written,
        });
      }
      const take = Math.min(frames - written, segment.data.length - segment.read);
      channel.set(segment.data.subarray(segment.read, segment.read + take), written);
      segment.read += take;
      written += take;
      this.bufferedFrames -= take;
      this.counters.framesPlayed += take;
      this.lastTag = segment.tag;
      if (segment.read === segment.data.length) this.queue.shift();
    }

    if (written < frames) {
      channel.fill(0, written);
      const silence = frames - written;
      if (this.state === "buffering" && this.lastTag !== undefined) this.counters.underrunFrames += silence;
    }
    for (let c = 1; c < output.length; c++) output[c].set(channel);

    this.quanta += 1;
    if (this.drainChecks.length && this.queue.length === 0) this.answerDrainChecks(false);
    else if (this.quanta % STATS_EVERY_QUANTA === 0) this.postStats();
    return true;
  }

  // Everything written before the waiting drain-checks has played (or, interrupted, was dropped).
  answerDrainChecks(interrupted) {
    if (this.drainChecks.length === 0) return;
    this.postStats();
    for (const id of this.drainChecks) this.port.postMessage({ event: "drain", id, interrupted });
    this.drainChecks = [];
  }

  // The queue ran dry while playing. Inside a sentence that is an underrun; after a sentence's last
  // sample it is the end of what was asked for (or a gap until the next sentence arrives).
  onStarved(frame) {
    if (!this.completeTags.has(this.lastTag)) {
      this.counters.underruns += 1;
      this.state = "buffering";
      this.port.postMessage({ event: "underrun", tag: this.lastTag });
    } else {
      this.forgetSentences();
      this.silentSince = frame;
      this.port.postMessage({ event: "drained" });
    }
    this.postStats();
  }

  // Sentence `tag` starts after `frames` of silence since the previous one ended.
  endGap(tag, frames) {
    this.silentSince = null;
    if (frames < this.audibleGapFrames) return;
    this.counters.gaps += 1;
    this.counters.gapFrames += frames;
    this.port.postMessage({ event: "gap", tag, frames });
  }

  // Everything queued has been played or dropped: no tag seen so far can receive audio again, so a later
  // stream may reuse tags (a new session counts its sentences from 0 again).
  forgetSentences() {
    this.state = "idle";
    this.completeTags.clear();
    this.startedTags.clear();
    this.lastTag = undefined;
  }

  postStats() {
    this.port.postMessage({
      event: "stats",
      ...this.counters,
      bufferedFrames: this.bufferedFrames,
      bufferedMs: (this.bufferedFrames / sampleRate) * 1000,
      state: this.state,
      contextRate: sampleRate,
      contextTime: currentTime,
    });
  }
}

registerProcessor("voxgate-player", VoxgatePlayerProcessor);
