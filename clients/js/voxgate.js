// Voxgate JavaScript client: the streaming TTS protocol (version 1) for browsers and Node 20.
//
// One ES module, no build step. In a browser it uses the page's WebSocket and offers `StreamPlayer`, an
// AudioWorklet player with a jitter buffer; in Node it uses the `ws` package (Node 20 has no global
// WebSocket), loaded only when needed.
//
//   import { VoxgateClient } from "./voxgate.js";
//   const client = await VoxgateClient.connect("ws://127.0.0.1:8000", { voice: "tone-mid" });
//   client.on("audio", (chunk) => play(chunk.samples, chunk.sampleRate));
//   const result = await client.speak("Hello there. How are you?");
//
// Protocol: ../../docs/protocol.md (the WebSocket `/v1/audio/speech/stream`).

import { Emitter } from "./emitter.js";

export const STREAM_PATH = "/v1/audio/speech/stream";

// Close codes after which a session is worth resuming: the connection dropped (1006), the server went
// away or restarts (1001, 1012), failed internally (1011) or is overloaded (1013). Not 1000 (finished) or
// the policy and size refusals (1008, 1009), which a retry would only repeat.
const RESUMABLE_CLOSE_CODES = new Set([1001, 1006, 1011, 1012, 1013]);

// With autoResume, every input (each message but ping) is kept until the gateway acknowledges it
// (`inputs_received`); every this many the client asks for that with a ping of its own.
const ACK_EVERY = 32;
const ACK_PING = "voxgate-ack";

const SERVER_EVENTS = [
  "session.started",
  "audio.start",
  "audio.words",
  "audio.done",
  "utterance.done",
  "context.cancelled",
  "session.done",
  "error",
  "pong",
];

// session.config fields, camelCase option name -> protocol name. Anything else in `options.config` is
// sent as given, so new server fields need no client release.
const CONFIG_FIELDS = {
  model: "model",
  voice: "voice",
  language: "language",
  instructions: "instructions",
  taskType: "task_type",
  responseFormat: "response_format",
  sampleRate: "sample_rate",
  maxNewTokens: "max_new_tokens",
  initialCodecChunkFrames: "initial_codec_chunk_frames",
  seed: "seed",
  splitGranularity: "split_granularity",
  chunkSchedule: "chunk_schedule",
  timestampType: "timestamp_type",
  timestampTransportStrategy: "timestamp_transport_strategy",
  // Pronunciation: entries ({text, say, case_sensitive, whole_word}) and registered dictionaries' names;
  // textMarkup "ssml" reads the text as the markup subset (docs/pronunciation.md).
  pronunciations: "pronunciations",
  textMarkup: "text_markup",
};

/** An error the server reported (`type: "error"`), or a failed connection. */
export class VoxgateError extends Error {
  constructor(message, { code = "internal", retryable = false, contextId = null, sentenceIndex = null } = {}) {
    super(message);
    this.name = "VoxgateError";
    this.code = code;
    this.retryable = retryable;
    this.contextId = contextId;
    this.sentenceIndex = sentenceIndex;
  }

  static fromMessage(message) {
    return new VoxgateError(message.message || "error", {
      code: message.code || "internal",
      retryable: Boolean(message.retryable),
      contextId: message.context_id ?? null,
      sentenceIndex: message.sentence_index ?? null,
    });
  }
}

// --------------------------------------------------------------------------------------- audio decoding

function buildMulawTable() {
  const table = new Int16Array(256);
  for (let i = 0; i < 256; i++) {
    const u = ~i & 0xff;
    const exponent = (u >> 4) & 0x07;
    const magnitude = (((u & 0x0f) << 3) + 0x84) << exponent;
    table[i] = u & 0x80 ? 0x84 - magnitude : magnitude - 0x84;
  }
  return table;
}

function buildAlawTable() {
  const table = new Int16Array(256);
  for (let i = 0; i < 256; i++) {
    const a = i ^ 0x55;
    const exponent = (a >> 4) & 0x07;
    let magnitude = (a & 0x0f) << 4;
    magnitude = exponent === 0 ? magnitude + 8 : (magnitude + 0x108) << (exponent - 1);
    table[i] = a & 0x80 ? magnitude : -magnitude;
  }
  return table;
}

const MULAW_TABLE = buildMulawTable();
const ALAW_TABLE = buildAlawTable();

/** Bytes of one sample in a streaming format. */
export function bytesPerSample(format) {
  return format === "mulaw" || format === "alaw" ? 1 : 2;
}

/**
 * Decode one binary frame of a streaming format (`pcm` s16le, `mulaw`, `alaw`) to 16-bit samples.
 * Returns an Int16Array that owns its memory.
 */
export function decodeAudio(bytes, format) {
  const view = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (format === "pcm") {
    const samples = new Int16Array(view.byteLength >> 1);
    // Copy through a DataView: the frame may sit at an odd offset and the host may not be little-endian.
    const data = new DataView(view.buffer, view.byteOffset, view.byteLength);
    for (let i = 0; i < samples.length; i++) samples[i] = data.getInt16(i * 2, true);
    return samples;
  }
  const table = format === "mulaw" ? MULAW_TABLE : format === "alaw" ? ALAW_TABLE : null;
  if (!table) throw new VoxgateError(`cannot decode format ${format}`, { code: "unsupported_format" });
  const samples = new Int16Array(view.byteLength);
  for (let i = 0; i < view.byteLength; i++) samples[i] = table[view[i]];
  return samples;
}

// ------------------------------------------------------------------------------------------- client

/** Turn "http://host:port", "ws://host:port" or a full endpoint URL into the streaming endpoint URL. */
export function streamUrl(base, { apiKey = null, apiKeyParam = "api_key" } = {}) {
  const fallback = globalThis.location?.href;
  const url = new URL(base, fallback);
  if (url.protocol === "http:") url.protocol = "ws:";
  if (url.protocol === "https:") url.protocol = "wss:";
  if (url.pathname === "/" || url.pathname === "") url.pathname = STREAM_PATH;
  if (apiKey) url.searchParams.set(apiKeyParam, apiKey);
  return url.toString();
}

async function resolveWebSocket(explicit) {
  if (explicit) return explicit;
  if (globalThis.WebSocket) return globalThis.WebSocket;
  try {
    const module = await import("ws");
    return module.WebSocket || module.default;
  } catch (error) {
    throw new VoxgateError(
      "no WebSocket implementation: install the `ws` package (npm install ws) or pass options.WebSocket",
      { code: "internal" },
    );
  }
}

// split_granularity "token" unless the options say otherwise: each sentence's synthesis starts at its first
// words where the gateway's backend can take text while it speaks; elsewhere the gateway splits at sentences
// and says so in session.started's warnings (`client.textStreaming`). `splitGranularity: null` sends none.
function configMessage(options) {
  const message = { type: "session.config", stream_audio: true, response_format: "pcm", split_granularity: "token" };
  if (options.splitGranularity === null) delete message.split_granularity;
  for (const [option, field] of Object.entries(CONFIG_FIELDS)) {
    if (options[option] !== undefined && options[option] !== null) message[field] = options[option];
  }
  Object.assign(message, options.config || {});
  return message;
}

/**
 * A Voxgate streaming session over one WebSocket.
 *
 * Events (`client.on(type, fn)`): every server message by its type (`session.started`, `audio.start`,
 * `audio.done`, `utterance.done`, `context.cancelled`, `session.done`, `error`, `pong`) with the parsed
 * message; `audio` for each binary frame as
 * `{sentenceIndex, contextId, format, sampleRate, offset, bytes: Uint8Array, samples: Int16Array}`;
 * `words` (sessions with `timestampType: "word"`) once words' audio has been sent, from `audio.words` or
 * a sync session's `audio.done`, as `{sentenceIndex, contextId, words: [{word, start, end, utteranceStart,
 * utteranceEnd}]}`: `start`/`end` in seconds from the start of the sentence's audio, `utteranceStart`/
 * `utteranceEnd` from the start of the utterance's (each word once, also when a resume replays it);
 * `message` for every JSON message; `close` with `{code, reason}` once the session is over.
 *
 * With `options.autoResume`, a dropped connection is reopened with `session.resume` at the position this
 * client reached (events `reconnecting` and `resumed`); the server replays what was missed, so the audio
 * stream continues byte-exact and pending `speak()`/`streamText()` promises carry on. Messages sent
 * while reconnecting are queued and sent once the session is back.
 *
 * Audio for a context that this client cancelled is not emitted (audio already in flight when the cancel
 * was sent is dropped here, as the server drops what it had not sent), but it still counts for resume.
 */
export class VoxgateClient extends Emitter {
  #pingCounter = 0;
  #intentionalClose = false;
  #outbox = null; // pings waiting for a resumed connection (null while connected)
  // autoResume without lost input: inputs sent (numbered from 1 per session) that the gateway has not
  // acknowledged, as [number, JSON text]; sent again after a resume past the gateway's `inputs_received`.
  #inputsSent = 0;
  #unacked = [];
  #resumeAck = undefined; // inputs_received of the latest session.started
  #askedGranularity = undefined; // split_granularity of the session.config awaiting its session.started

  constructor(url, options = {}) {
    super();
    this.url = url;
    this.options = options;
    this.socket = null;
    this.sessionId = null;
    this.sampleRate = null;
    this.format = null;
    this.voice = null;
    this.voices = [];
    this.closed = false;
    // session.started's warnings for the latest session.config, and whether the gateway starts each
    // sentence's synthesis at its first words (token granularity asked for and not refused in a warning).
    this.warnings = [];
    this.textStreaming = false;
    this.resuming = false;
    this.resumes = 0;
    // Where the audio stream stands: the sentence being received and its bytes so far. That names the
    // next byte the client needs, which is what session.resume sends after a dropped connection.
    this.sentenceIndex = null;
    this.bytesReceived = 0;
    this.totalBytesReceived = 0;
    this.currentSentence = null; // {index, contextId, format, sampleRate, text}
    this.cancelledContexts = new Set();
    this.sentences = new Map(); // index -> {index, contextId, text, bytes, done, error, startSeconds, words}
    // Seconds of audio in the finished sentences of each open utterance (by context id): where the next
    // sentence's audio starts within its utterance, for word times relative to the utterance.
    this.utteranceSeconds = new Map();
    // utterance.done + session.done received: a resume sends it, so lost ends come again, others not.
    this.endsReceived = 0;
  }

  /** Open a session: connect, send session.config, wait for session.started. */
  static async connect(url, options = {}) {
    const client = new VoxgateClient(url, options);
    await client.open(configMessage(options));
    return client;
  }

  /** Reattach to a session after a disconnect (protocol: session.resume as the first message). */
  static async resume(url, state, options = {}) {
    const client = new VoxgateClient(url, options);
    client.sentenceIndex = state.sentence_index ?? state.sentenceIndex ?? null;
    client.bytesReceived = state.bytes_received ?? state.bytesReceived ?? 0;
    await client.open({
      type: "session.resume",
      session_id: state.session_id ?? state.sessionId,
      sentence_index: client.sentenceIndex ?? 0,
      bytes_received: client.bytesReceived,
    });
    return client;
  }

  /** The position to hand to `VoxgateClient.resume` after the connection dropped. */
  resumeState() {
    return {
      session_id: this.sessionId,
      sentence_index: this.sentenceIndex ?? 0,
      bytes_received: this.sentenceIndex === null ? 0 : this.bytesReceived,
    };
  }

  // Open a socket, send `firstMessage` (session.config or session.resume), wait for session.started.
  // Rejects if the server refuses or the socket closes first; after that, the socket's end goes to
  // #onSocketClosed.
  async open(firstMessage) {
    const WebSocketImpl = await resolveWebSocket(this.options.WebSocket);
    const target = streamUrl(this.url, this.options);
    const socketOptions = this.options.apiKey && WebSocketImpl !== globalThis.WebSocket ? { headers: { "X-API-Key": this.options.apiKey } } : undefined;
    const socket = new WebSocketImpl(target, this.options.protocols, socketOptions);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    let established = false;

    await new Promise((resolve, reject) => {
      let settled = false;
      const removers = [];
      const settle = (error) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        removers.forEach((remove) => remove());
        if (error) {
          if (socket.readyState <= 1) socket.close(1000);
          reject(error);
        } else {
          established = true;
          resolve();
        }
      };
      // Failures of the connection itself (nothing listening, no answer, closed before the session
      // started) carry the code "connection_failed"; a refusal the gateway sent carries its own code.
      const failed = (message) => new VoxgateError(message, { code: "connection_failed", retryable: true });
      const timeoutMs = this.options.connectTimeoutMs ?? 10000;
      const timer = setTimeout(() => settle(failed(`no answer from ${target} within ${timeoutMs} ms`)), timeoutMs);
      removers.push(
        this.on("session.started", () => settle()),
        this.on("error", (message) => settle(VoxgateError.fromMessage(message))),
      );
      socket.onopen = () => {
        if (firstMessage.type === "session.config") this.#askedGranularity = firstMessage.split_granularity ?? null;
        socket.send(JSON.stringify(firstMessage));
      };
      socket.onerror = (event) => settle(failed(`cannot connect to ${target}: ${event?.message || "socket error"}`));
      socket.onmessage = (event) => {
        if (socket === this.socket) this.#onFrame(event.data);
      };
      socket.onclose = (event) => {
        const code = event?.code ?? 1006;
        settle(failed(`connection closed before the session started (code ${code}${event?.reason ? `: ${event.reason}` : ""})`));
        if (established && socket === this.socket) this.#onSocketClosed(code, event?.reason ?? "");
        else if (!this.resuming) this.closed = true;
      };
    });
    this.closed = false;
    return this;
  }

  #onSocketClosed(code, reason) {
    const resumable = this.options.autoResume && !this.#intentionalClose && this.sessionId && RESUMABLE_CLOSE_CODES.has(code);
    if (resumable) {
      this.#resumeAfterDrop(code, reason);
      return;
    }
    this.closed = true;
    this.emit("close", { code, reason });
  }

  async #resumeAfterDrop(code, reason) {
    this.resuming = true;
    this.#outbox = [];
    this.emit("reconnecting", { code, reason, ...this.resumeState() });
    const attempts = this.options.resumeAttempts ?? 5;
    let failure = null;
    for (let attempt = 1; attempt <= attempts && !this.#intentionalClose; attempt++) {
      await new Promise((resolve) => setTimeout(resolve, Math.min(2000, 100 * 2 ** (attempt - 1))));
      const state = this.resumeState();
      try {
        // The server starts again with audio.start for the sentence we were in (and replays from our byte).
        this.currentSentence = null;
        await this.open({ type: "session.resume", ...state, ends_received: this.endsReceived });
      } catch (error) {
        failure = error;
        if (error.code === "session_not_found" || error.code === "resume_out_of_range") break;
        continue;
      }
      this.resuming = false;
      this.resumes += 1;
      // Inputs the gateway never got (the old socket or replica lost them) go again first, in order.
      let inputsResent = 0;
      if (this.#resumeAck === undefined) this.#unacked = []; // a gateway without acknowledgements
      else {
        this.#acknowledge(this.#resumeAck);
        for (const [, text] of this.#unacked) this.socket.send(text);
        inputsResent = this.#unacked.length;
      }
      const queued = this.#outbox;
      this.#outbox = null;
      for (const message of queued) this.#sendJson(message);
      this.emit("resumed", { attempt, ...state, inputsResent });
      return;
    }
    this.resuming = false;
    this.#outbox = null;
    this.closed = true;
    this.emit("close", { code, reason: failure ? `resume failed: ${failure.message}` : reason });
  }

  #onFrame(data) {
    if (typeof data === "string") {
      this.#onMessage(JSON.parse(data));
      return;
    }
    // ws may hand over a Buffer (a Uint8Array) even with binaryType "arraybuffer" for some frames.
    const bytes = data instanceof ArrayBuffer ? new Uint8Array(data) : new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    const sentence = this.currentSentence;
    if (!sentence) {
      this.emit("protocol_violation", { reason: "binary frame before audio.start", bytes: bytes.byteLength });
      return;
    }
    const offset = this.bytesReceived;
    this.bytesReceived += bytes.byteLength;
    this.totalBytesReceived += bytes.byteLength;
    this.sentences.get(sentence.index).bytes += bytes.byteLength;
    if (this.cancelledContexts.has(sentence.contextId)) return;
    this.emit("audio", {
      sentenceIndex: sentence.index,
      contextId: sentence.contextId,
      format: sentence.format,
      sampleRate: sentence.sampleRate,
      offset,
      bytes,
      samples: decodeAudio(bytes, sentence.format),
    });
  }

  #onMessage(message) {
    switch (message.type) {
      case "session.started":
        this.sessionId = message.session_id ?? this.sessionId;
        this.sampleRate = message.sample_rate ?? this.sampleRate;
        this.format = message.format ?? this.format;
        this.voices = message.voices ?? this.voices;
        this.voice = message.voice ?? this.voice;
        this.#resumeAck = message.inputs_received;
        if (this.#askedGranularity !== undefined) {
          this.warnings = message.warnings ?? [];
          this.textStreaming = this.#askedGranularity === "token"
            && !this.warnings.some((warning) => warning.field === "split_granularity");
          this.#askedGranularity = undefined;
        }
        break;
      case "audio.start": {
        const contextId = message.context_id ?? null;
        this.currentSentence = {
          index: message.sentence_index,
          contextId,
          format: message.format ?? this.format,
          sampleRate: message.sample_rate ?? this.sampleRate,
          text: message.sentence_text,
        };
        // A resumed sentence continues where the client stood; a new one starts at byte 0.
        if (this.sentenceIndex !== message.sentence_index) this.bytesReceived = 0;
        this.sentenceIndex = message.sentence_index;
        if (!this.sentences.has(message.sentence_index)) {
          this.sentences.set(message.sentence_index, {
            index: message.sentence_index,
            contextId,
            text: message.sentence_text,
            bytes: 0,
            done: false,
            error: false,
            startSeconds: this.utteranceSeconds.get(contextId) ?? 0,
            words: [],
          });
        }
        break;
      }
      case "audio.words":
        this.#addWords(message.sentence_index, message.words || []);
        break;
      case "audio.done": {
        const record = this.sentences.get(message.sentence_index);
        if (record) {
          record.done = true;
          record.error = Boolean(message.error);
          // split_granularity "token": audio.start had the words known when synthesis began; this is all.
          if (message.sentence_text !== undefined) record.text = message.sentence_text;
          record.totalBytes = message.total_bytes;
          record.durationMs = message.duration_ms;
          const alignment = message.timestamp_info?.word_alignment;
          if (alignment) {
            const starts = alignment.word_start_times_seconds || [];
            const ends = alignment.word_end_times_seconds || [];
            this.#addWords(record.index, (alignment.words || []).map((word, i) => ({ word, start: starts[i], end: ends[i] })));
          }
          const seconds = sentenceSeconds(this.currentSentence, message);
          if (seconds !== null) this.utteranceSeconds.set(record.contextId, record.startSeconds + seconds);
        }
        this.currentSentence = null;
        break;
      }
      case "utterance.done":
      case "session.done":
        this.endsReceived += 1;
        this.utteranceSeconds.delete(message.context_id ?? null);
        break;
      case "context.cancelled":
        this.utteranceSeconds.delete(message.context_id ?? null);
        break;
      case "pong":
        if (message.inputs_received !== undefined) this.#acknowledge(message.inputs_received);
        if (message.id === ACK_PING) return;
        break;
      default:
        break;
    }
    this.emit("message", message);
    const contextId = message.context_id ?? null;
    const silenced =
      this.cancelledContexts.has(contextId) && (message.type === "audio.start" || message.type === "audio.done");
    if (SERVER_EVENTS.includes(message.type) && !silenced) this.emit(message.type, message);
  }

  // Words of a sentence, each given out once (a resume replays a sentence's words with its audio), timed
  // also from the start of the utterance; emitted as `words` unless the context was cancelled here.
  #addWords(sentenceIndex, items) {
    const record = this.sentences.get(sentenceIndex);
    if (!record) return;
    const fresh = [];
    for (const { word, start, end } of items) {
      if (record.words.some((known) => known.word === word && known.start === start)) continue;
      const timed = { word, start, end, utteranceStart: record.startSeconds + start, utteranceEnd: record.startSeconds + end };
      record.words.push(timed);
      fresh.push(timed);
    }
    if (fresh.length && !this.cancelledContexts.has(record.contextId)) {
      this.emit("words", { sentenceIndex, contextId: record.contextId, words: fresh });
    }
  }

  // context.cancelled's spoken_words ({word, start, end, sentence_index}), timed also from the start of
  // the utterance; null when the gateway sent none.
  #inUtterance(words) {
    if (!words) return null;
    return words.map((word) => {
      const record = this.sentences.get(word.sentence_index);
      if (!record) return { ...word };
      return { ...word, utteranceStart: record.startSeconds + word.start, utteranceEnd: record.startSeconds + word.end };
    });
  }

  #acknowledge(inputsReceived) {
    while (this.#unacked.length && this.#unacked[0][0] <= inputsReceived) this.#unacked.shift();
  }

  #sendJson(message) {
    if (this.options.autoResume && message.type !== "ping" && !this.closed) {
      // Kept until acknowledged; if the socket is dying or being replaced, the resume sends it.
      const text = JSON.stringify(message);
      this.#unacked.push([++this.#inputsSent, text]);
      if (this.#outbox !== null || !this.socket || this.socket.readyState !== 1) return;
      this.socket.send(text);
      if (this.#inputsSent % ACK_EVERY === 0) this.socket.send(JSON.stringify({ type: "ping", id: ACK_PING }));
      return;
    }
    if (this.#outbox !== null) {
      this.#outbox.push(message);
      return;
    }
    if (!this.socket || this.socket.readyState !== 1) {
      throw new VoxgateError(`cannot send ${message.type}: the connection is not open`, { code: "internal" });
    }
    this.socket.send(JSON.stringify(message));
  }

  #withContext(message, contextId) {
    if (contextId !== undefined && contextId !== null) message.context_id = contextId;
    return message;
  }

  /** Append text (complete sentences are spoken at once; an unterminated tail waits). */
  sendText(text, { contextId = null } = {}) {
    if (contextId !== null) this.cancelledContexts.delete(contextId);
    this.#sendJson(this.#withContext({ type: "input.text", text }, contextId));
  }

  /** Speak whatever text is buffered now; the utterance stays open. */
  flush({ contextId = null } = {}) {
    this.#sendJson(this.#withContext({ type: "input.flush" }, contextId));
  }

  /** End this utterance's text. */
  done({ contextId = null } = {}) {
    this.#sendJson(this.#withContext({ type: "input.done" }, contextId));
  }

  /**
   * Barge-in: stop this context now. Audio of it still in flight is dropped by this client. `playedMs`:
   * how much of the context's audio the listener heard (StreamPlayer.bargeIn() measures it), so that
   * context.cancelled's spoken_text is what was heard rather than what the gateway had sent.
   */
  cancel({ contextId = null, playedMs = null } = {}) {
    this.cancelledContexts.add(contextId);
    const message = this.#withContext({ type: "input.cancel" }, contextId);
    if (playedMs !== null && playedMs !== undefined) message.played_ms = Math.max(0, Math.round(playedMs * 10) / 10);
    this.#sendJson(message);
  }

  /** Change the session's configuration between utterances (answered by session.started). */
  configure(options) {
    const message = configMessage(options);
    this.#askedGranularity = message.split_granularity ?? null;
    this.#sendJson(message);
    return this.#waitFor("session.started");
  }

  /** Ask the server to finish everything open, answer session.done and close. */
  async close({ timeoutMs = 30000 } = {}) {
    if (this.closed) return;
    this.#intentionalClose = true;
    const closed = new Promise((resolve) => this.once("close", resolve));
    this.#sendJson({ type: "session.close" });
    const timer = setTimeout(() => this.socket.close(1000), timeoutMs);
    await closed;
    clearTimeout(timer);
  }

  /** Drop the connection without a protocol goodbye (the session stays resumable on the server). */
  disconnect() {
    this.#intentionalClose = true;
    this.socket?.close(1000);
  }

  /** Round trip to the server; resolves with the measured milliseconds. */
  async ping() {
    const id = `ping-${++this.#pingCounter}`;
    const started = now();
    const answered = this.#waitFor("pong", (message) => message.id === id);
    this.#sendJson({ type: "ping", id });
    await answered;
    return now() - started;
  }

  /**
   * Stream text as it is produced (an async or sync iterable of strings, e.g. LLM tokens), then end the
   * utterance unless `done: false`. Resolves with the utterance's result (see `speak`).
   */
  async streamText(tokens, { contextId = null, done = true } = {}) {
    const finished = done ? this.#utteranceResult(contextId) : null;
    for await (const token of tokens) {
      if (token) this.sendText(token, { contextId });
    }
    if (!done) return null;
    this.done({ contextId });
    return finished;
  }

  /** Speak a whole text as one utterance; resolves when all its audio has arrived. */
  speak(text, { contextId = null } = {}) {
    return this.streamText([text], { contextId });
  }

  /** A handle bound to one context id: text / flush / done / cancel / stream / speak. */
  context(contextId) {
    return {
      id: contextId,
      text: (text) => this.sendText(text, { contextId }),
      flush: () => this.flush({ contextId }),
      done: () => this.done({ contextId }),
      cancel: ({ playedMs = null } = {}) => this.cancel({ contextId, playedMs }),
      stream: (tokens, options = {}) => this.streamText(tokens, { ...options, contextId }),
      speak: (text) => this.speak(text, { contextId }),
    };
  }

  // Resolves with {contextId, sentences: [{index, text, bytes, totalBytes, error, words}], bytes, words,
  // cancelled} when the utterance ends: utterance.done (contexts), session.done (no context) or
  // context.cancelled, which adds `spokenText` and `spokenWords` (what the listener heard, as the gateway
  // counts it) for sessions with word timestamps.
  #utteranceResult(contextId) {
    const sentences = [];
    const removers = [];
    return new Promise((resolve, reject) => {
      const finish = (outcome) => {
        removers.forEach((remove) => remove());
        const records = sentences.map((index) => this.sentences.get(index));
        resolve({
          contextId,
          sentences: records,
          bytes: records.reduce((sum, record) => sum + record.bytes, 0),
          words: records.flatMap((record) => record.words),
          ...outcome,
        });
      };
      const mine = (message) => (message.context_id ?? null) === contextId;
      removers.push(
        this.on("message", (message) => {
          if (message.type === "audio.start" && mine(message)) {
            // A resumed sentence starts again with its audio.start: count it once.
            if (!sentences.includes(message.sentence_index)) sentences.push(message.sentence_index);
          }
          else if (message.type === "utterance.done" && mine(message)) finish({ cancelled: false });
          else if (message.type === "session.done" && contextId === null) finish({ cancelled: false });
          else if (message.type === "context.cancelled" && mine(message)) {
            finish({ cancelled: true, spokenText: message.spoken_text ?? null, spokenWords: this.#inUtterance(message.spoken_words) });
          }
          else if (message.type === "error" && mine(message) && message.sentence_index == null && !message.retryable) {
            removers.forEach((remove) => remove());
            reject(VoxgateError.fromMessage(message));
          }
        }),
        this.on("close", ({ code, reason }) => {
          removers.forEach((remove) => remove());
          reject(new VoxgateError(`connection closed (code ${code}${reason ? `: ${reason}` : ""}) before the utterance finished`));
        }),
      );
    });
  }

  #waitFor(type, predicate = () => true) {
    return new Promise((resolve, reject) => {
      const removers = [
        this.on(type, (message) => {
          if (!predicate(message)) return;
          removers.forEach((remove) => remove());
          resolve(message);
        }),
        this.on("close", ({ code }) => {
          removers.forEach((remove) => remove());
          reject(new VoxgateError(`connection closed (code ${code}) while waiting for ${type}`));
        }),
      ];
    });
  }

  /** Wait for the next server message of a type (optionally matching a predicate). */
  waitFor(type, predicate) {
    return this.#waitFor(type, predicate);
  }
}

// Seconds of audio in a finished sentence: exact from its bytes for the raw formats, else the gateway's
// duration_ms; null when neither is known.
function sentenceSeconds(sentence, done) {
  const format = sentence?.format;
  if ((format === "pcm" || format === "mulaw" || format === "alaw") && sentence.sampleRate) {
    return done.total_bytes / (bytesPerSample(format) * sentence.sampleRate);
  }
  return done.duration_ms == null ? null : done.duration_ms / 1000;
}

function now() {
  return globalThis.performance ? performance.now() : Date.now();
}

/** One HTTP call to the gateway's API: the parsed JSON answer, or a VoxgateError with the server's code. */
async function apiCall(baseUrl, path, { apiKey = null, method = "GET", body = undefined } = {}) {
  const url = new URL(path, baseUrl.replace(/^ws/, "http"));
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    // The gateway answers errors in the OpenAI shape: {"error": {"message", "code", ...}}.
    const answer = await response.json().catch(() => null);
    const detail = answer?.error?.message ? `: ${answer.error.message}` : "";
    throw new VoxgateError(`${method} ${url} answered ${response.status}${detail}`, {
      code: answer?.error?.code || (response.status === 401 ? "unauthorized" : "internal"),
      retryable: response.status === 429 || response.status >= 500,
    });
  }
  return response.json();
}

/**
 * Voices the gateway offers (GET /v1/audio/voices), for a base URL such as "http://127.0.0.1:8000":
 * `voices` (names), `uploaded_voices` (the cloned voices this key may use), `voice_cloning` (whether the
 * backend can clone).
 */
export async function listVoices(baseUrl, { apiKey = null } = {}) {
  return apiCall(baseUrl, "/v1/audio/voices", { apiKey });
}

function toBase64(bytes) {
  if (typeof Buffer !== "undefined") return Buffer.from(bytes).toString("base64");
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

/**
 * Clone a voice from a reference clip and register it for this API key (POST /v1/audio/voices).
 * `audio`: the clip's bytes (Uint8Array, ArrayBuffer or Blob; wav, flac, mp3, ogg, any rate), `consent`:
 * the speaker's consent (e.g. a recording id), `refText`: what the clip says (needed unless `xVectorOnly`).
 * Resolves to the voice's metadata; then `voice: name` speaks with it.
 */
export async function addVoice(baseUrl, name, audio, { consent, refText = null, xVectorOnly = false, apiKey = null } = {}) {
  const bytes = audio instanceof Uint8Array ? audio
    : new Uint8Array(audio instanceof ArrayBuffer ? audio : await audio.arrayBuffer());
  const body = { name, consent, audio_sample: toBase64(bytes), x_vector_only_mode: xVectorOnly };
  if (refText) body.ref_text = refText;
  return (await apiCall(baseUrl, "/v1/audio/voices", { apiKey, method: "POST", body })).voice;
}

/** Delete a voice this API key registered (DELETE /v1/audio/voices/{name}); `voice_not_found` otherwise. */
export async function deleteVoice(baseUrl, name, { apiKey = null } = {}) {
  await apiCall(baseUrl, `/v1/audio/voices/${encodeURIComponent(name)}`, { apiKey, method: "DELETE" });
}

/**
 * Simulated LLM output: yields `text` in word-sized tokens at `tokensPerSecond` (0 = as fast as possible).
 * `signal` (an AbortSignal) stops it early.
 */
export async function* simulatedTokens(text, { tokensPerSecond = 20, signal = null } = {}) {
  const tokens = text.match(/\s*\S+/g) || [];
  const interval = tokensPerSecond > 0 ? 1000 / tokensPerSecond : 0;
  const start = now();
  for (let i = 0; i < tokens.length; i++) {
    if (signal?.aborted) return;
    const due = start + i * interval - now();
    if (due > 0) await new Promise((resolve) => setTimeout(resolve, due));
    if (signal?.aborted) return;
    yield tokens[i];
  }
}

export { StreamPlayer } from "./player.js";
