// StreamPlayer: plays a Voxgate audio stream in the browser through an AudioWorklet (player-worklet.js).
//
//   const player = new StreamPlayer({ prerollMs: 50 });
//   await player.start();              // inside a user gesture, or with autoplay allowed
//   player.attach(client);             // play every `audio` event of a VoxgateClient
//   player.on("stats", (s) => ...);    // live counters, ~20 times a second
//   player.interrupt();                // barge-in: the queued audio is gone within one render quantum
//   await player.bargeIn(client, id);  // or: interrupt, then cancel context `id` saying how much was heard
//   await player.whenDrained();        // everything written so far has played
//
// Counters (player.stats): samplesReceived (stream rate), framesQueued / framesPlayed (context rate),
// underruns, underrunFrames, gaps, gapFrames (silences of `audibleGapMs` or more between one sentence's end
// and the next one's start, within a request: a sentence that came late; a `gap` event each, with its
// `ms`), bufferedMs, interrupts, droppedFrames, state, plus ttfaMs (time from
// `markRequest()` to the first sample leaving the worklet) and firstChunkMs (to the first audio written).
// Importing this module in Node is harmless (nothing touches Web Audio before start(), which in Node
// throws an error saying so): a Node program uses VoxgateClient alone and does its own playback.

import { Emitter } from "./emitter.js";

const DEFAULT_WORKLET_URL = new URL("./player-worklet.js", import.meta.url).href;

function now() {
  return performance.now();
}

export class StreamPlayer extends Emitter {
  constructor({
    prerollMs = 50, audibleGapMs = 150, audioContext = null, sampleRate = undefined, workletUrl = DEFAULT_WORKLET_URL,
  } = {}) {
    super();
    this.prerollMs = prerollMs;
    this.audibleGapMs = audibleGapMs;
    this.context = audioContext;
    this.ownsContext = audioContext === null;
    this.contextOptions = sampleRate ? { sampleRate, latencyHint: "interactive" } : { latencyHint: "interactive" };
    this.workletUrl = workletUrl;
    this.node = null;
    this.stats = emptyStats();
    this.requestedAt = null;
    this.sentences = new Map(); // tag -> {firstChunkAt, startedAt}
    // tag -> ms of audio written, less what an interrupt dropped: once played or interrupted, what was heard
    this.written = new Map();
    this.drainChecks = new Map(); // id -> resolve of whenDrained()
    this.contextTags = new Map(); // attach(): context id -> tags of its sentences since its last end
    this.nextDrainCheck = 0;
  }

  async start() {
    if (this.node) return this;
    if (!this.context && typeof AudioContext === "undefined") {
      throw new Error("StreamPlayer needs Web Audio (a browser); in Node, play the client's `audio` events yourself");
    }
    if (!this.context) this.context = new AudioContext(this.contextOptions);
    await this.context.audioWorklet.addModule(this.workletUrl);
    this.node = new AudioWorkletNode(this.context, "voxgate-player", {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { prerollMs: this.prerollMs, audibleGapMs: this.audibleGapMs },
    });
    this.node.port.onmessage = (event) => this.#onWorkletMessage(event.data);
    this.node.connect(this.context.destination);
    if (this.context.state !== "running") await this.context.resume();
    return this;
  }

  get sampleRate() {
    return this.context?.sampleRate ?? null;
  }

  /** Start the clock for time-to-first-audio: call it when the text is sent. The silence before it is
   * no gap between sentences. */
  markRequest(at = now()) {
    this.requestedAt = at;
    this.stats.ttfaMs = null;
    this.stats.firstChunkMs = null;
    this.node?.port.postMessage({ type: "request" });
  }

  /** Queue 16-bit samples of sentence `tag` at `sampleRate` (resampled to the context's rate). */
  write(samples, sampleRate, tag) {
    if (!this.node) throw new Error("StreamPlayer.start() first");
    const at = now();
    if (!this.sentences.has(tag)) this.sentences.set(tag, { firstChunkAt: at, startedAt: null });
    if (this.stats.firstChunkMs === null && this.requestedAt !== null) this.stats.firstChunkMs = at - this.requestedAt;
    this.written.set(tag, (this.written.get(tag) ?? 0) + (samples.length * 1000) / sampleRate);
    // The samples are copied into the message: the caller may reuse its buffer.
    this.node.port.postMessage({ type: "write", samples, sampleRate, tag });
  }

  /** Sentence `tag` has no more audio: its tail may play out without waiting for a pre-roll. */
  endSegment(tag) {
    this.node?.port.postMessage({ type: "segment-end", tag });
  }

  /** Drop everything queued now (barge-in). Resolves with the worklet's report: `droppedFrames`, and
   * `droppedMs`, a Map of tag -> ms of that sentence's audio that was dropped unplayed. */
  interrupt() {
    if (!this.node) return Promise.resolve({ droppedFrames: 0, droppedMs: new Map() });
    const done = new Promise((resolve) => this.once("interrupted", resolve));
    this.node.port.postMessage({ type: "interrupt" });
    return done;
  }

  /** Resolves with {interrupted} once all the audio written before the call has played (interrupted:
   * false) or was dropped by an interrupt (true). The worklet answers it, so it never reads a stale
   * counter: the moment to say an utterance has finished playing. */
  whenDrained() {
    if (!this.node) return Promise.resolve({ interrupted: false });
    const id = this.nextDrainCheck++;
    const done = new Promise((resolve) => this.drainChecks.set(id, resolve));
    this.node.port.postMessage({ type: "drain-check", id });
    return done;
  }

  /** Milliseconds of the sentences `tags` that were heard: what was written, less what an interrupt
   * dropped. Exact once they have played or `interrupt()` has resolved; `input.cancel`'s played_ms. */
  heardMs(tags) {
    let total = 0;
    for (const tag of tags) total += this.written.get(tag) ?? 0;
    return total;
  }

  /** Stop tracking sentences `tags` (their heard time is no longer needed). */
  forget(tags) {
    for (const tag of tags) {
      this.written.delete(tag);
      this.sentences.delete(tag);
    }
  }

  /**
   * Barge-in on context `contextId` of an attached client: drop the queued audio, then cancel the
   * context with how much of its audio was heard, so that context.cancelled's spoken_text is what the
   * listener heard (not what the gateway had sent). Resolves with the worklet's report and `playedMs`.
   */
  async bargeIn(client, contextId = null) {
    const report = await this.interrupt();
    const tags = this.contextTags.get(contextId) ?? [];
    const playedMs = this.heardMs(tags);
    client.cancel({ contextId, playedMs });
    this.forget(tags);
    this.contextTags.delete(contextId);
    return { ...report, playedMs };
  }

  setPrerollMs(prerollMs) {
    this.prerollMs = prerollMs;
    this.node?.port.postMessage({ type: "config", prerollMs });
  }

  /**
   * Play a VoxgateClient's audio: `audio` events are written, `audio.done` ends a sentence, and a
   * cancelled context's queued audio is dropped. Returns a function that detaches.
   */
  attach(client) {
    const key = (index) => `${client.sessionId}:${index}`;
    // The sentences of each context since its last utterance.done: what bargeIn() measures.
    const removers = [
      client.on("audio.start", (message) => {
        const contextId = message.context_id ?? null;
        if (!this.contextTags.has(contextId)) this.contextTags.set(contextId, []);
        this.contextTags.get(contextId).push(key(message.sentence_index));
      }),
      client.on("audio", (chunk) => this.write(chunk.samples, chunk.sampleRate, key(chunk.sentenceIndex))),
      client.on("audio.done", (message) => this.endSegment(key(message.sentence_index))),
      client.on("utterance.done", (message) => this.#endContext(message.context_id ?? null)),
      client.on("session.done", () => this.#endContext(null)),
    ];
    return () => removers.forEach((remove) => remove());
  }

  #endContext(contextId) {
    this.forget(this.contextTags.get(contextId) ?? []);
    this.contextTags.delete(contextId);
  }

  async close() {
    this.node?.disconnect();
    this.node = null;
    if (this.ownsContext && this.context) await this.context.close();
    this.context = null;
  }

  #onWorkletMessage(message) {
    const at = now();
    switch (message.event) {
      case "stats":
        Object.assign(this.stats, message);
        delete this.stats.event;
        this.emit("stats", this.stats);
        break;
      case "segment-start": {
        const record = this.sentences.get(message.tag);
        if (record) record.startedAt = at;
        if (this.stats.ttfaMs === null && this.requestedAt !== null) this.stats.ttfaMs = at - this.requestedAt;
        this.emit("segmentstart", { tag: message.tag, at, contextTime: message.contextTime, ...record });
        break;
      }
      case "underrun":
        this.emit("underrun", { tag: message.tag, at });
        break;
      case "gap":
        this.emit("gap", { tag: message.tag, ms: (message.frames * 1000) / this.context.sampleRate, at });
        break;
      case "drained":
        this.emit("drained", { at });
        break;
      case "interrupted": {
        const droppedMs = new Map();
        for (const [tag, frames] of message.droppedByTag ?? []) {
          const ms = (frames * 1000) / this.context.sampleRate;
          droppedMs.set(tag, ms);
          if (this.written.has(tag)) this.written.set(tag, Math.max(0, this.written.get(tag) - ms));
        }
        this.emit("interrupted", { droppedFrames: message.droppedFrames, droppedMs, at });
        break;
      }
      case "drain": {
        const resolve = this.drainChecks.get(message.id);
        this.drainChecks.delete(message.id);
        resolve?.({ interrupted: message.interrupted });
        break;
      }
      default:
        break;
    }
  }
}

function emptyStats() {
  return {
    samplesReceived: 0,
    framesQueued: 0,
    framesPlayed: 0,
    underruns: 0,
    underrunFrames: 0,
    gaps: 0,
    gapFrames: 0,
    interrupts: 0,
    droppedFrames: 0,
    bufferedFrames: 0,
    bufferedMs: 0,
    state: "idle",
    contextRate: null,
    ttfaMs: null,
    firstChunkMs: null,
  };
}
