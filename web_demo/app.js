// The Voxgate demo page: speak typed or LLM-streamed text through the gateway, hear it as it arrives,
// interrupt it, and watch each sentence's timing. Everything protocol- and audio-related lives in the
// client library (clients/js); this file is the page's wiring.
//
// `window.voxgateDemo.snapshot()` returns the page's state as plain data (used by the browser tests).

import { VoxgateClient, StreamPlayer, addVoice, listVoices, simulatedTokens, bytesPerSample } from "../clients/js/voxgate.js";
import { BufferSparkline, TimelineChart } from "./chart.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const gatewayUrl = params.get("gateway") || location.origin;

const ui = {
  status: $("status"),
  backendInfo: $("backend-info"),
  text: $("text"),
  tokensPerSecond: $("tokens-per-second"),
  tokensPerSecondValue: $("tokens-per-second-value"),
  llmRow: $("llm-speed-row"),
  voice: $("voice"),
  clonePanel: $("clone-panel"),
  cloneFields: $("clone-fields"),
  cloneUnavailable: $("clone-unavailable"),
  cloneFile: $("clone-file"),
  cloneName: $("clone-name"),
  cloneText: $("clone-text"),
  cloneConsent: $("clone-consent"),
  cloneRecord: $("clone-record"),
  cloneAdd: $("clone-add"),
  cloneStatus: $("clone-status"),
  format: $("format"),
  sampleRate: $("sample-rate"),
  preroll: $("preroll"),
  apiKey: $("api-key"),
  apiKeyField: $("api-key-field"),
  warnings: $("warnings"),
  warningList: $("warning-list"),
  notice: $("notice"),
  noticeText: $("notice-text"),
  noticeAction: $("notice-action"),
  speak: $("speak"),
  interrupt: $("interrupt"),
  playerState: $("player-state"),
  ttfa: $("m-ttfa"),
  firstByte: $("m-first-byte"),
  buffered: $("m-buffered"),
  underruns: $("m-underruns"),
  received: $("m-received"),
  played: $("m-played"),
  sentencesInfo: $("m-sentences"),
  wordsInfo: $("m-words"),
  spokenWords: $("spoken-words"),
  rates: $("rates"),
  rows: $("sentence-rows"),
  events: $("events"),
};

const state = {
  recorder: null, // the MediaRecorder while a reference clip is being recorded
  recording: null, // the recorded clip (a Blob), until a file is chosen instead
  recordingStarted: 0,
  client: null,
  clientKey: null, // the settings the open session was configured with
  player: null,
  utterance: null, // the utterance being spoken (see newUtterance)
  utteranceCount: 0,
  notice: null, // the kind of error on show (see showNotice)
  noticeAction: null,
  retrySpeak: false, // Speak failed for want of a key or a gateway: retried once that is fixed
  keyTried: null, // the API key the last gateway check used
  interrupting: null, // the last interrupt's report, then its cancel (Speak waits for it)
  readiness: null, // what the gateway's /ready last said: "ready", "starting", "failed", "draining", "unreachable"
  pillFromReadiness: false, // the status pill shows readiness (not a session's state or an error)
  sessionWarnings: [], // session.started's warnings that concern the user's choices
  drawErrors: new Set(), // errors of the animation frame's parts, each reported once
};

const chart = new TimelineChart($("chart"));
const sparkline = new BufferSparkline($("buffer-chart"));

if (params.get("api_key")) ui.apiKey.value = params.get("api_key");

// ------------------------------------------------------------------------------------------ helpers

function setStatus(kind, text, { readiness = false } = {}) {
  state.pillFromReadiness = readiness;
  ui.status.dataset.state = kind;
  ui.status.className = `pill pill-${kind}`;
  ui.status.textContent = text;
}

function logEvent(text, kind = "") {
  const item = document.createElement("li");
  const time = state.utterance ? `${Math.round(performance.now() - state.utterance.t0)} ms` : "";
  item.innerHTML = `<time></time><span></span>`;
  item.querySelector("time").textContent = time;
  item.querySelector("span").textContent = text;
  if (kind) item.classList.add(kind);
  ui.events.prepend(item);
  while (ui.events.children.length > 60) ui.events.lastChild.remove();
}

function logSeparator(text) {
  const item = document.createElement("li");
  item.className = "separator";
  item.textContent = text;
  ui.events.prepend(item);
}

// ------------------------------------------------------------------------------------------ errors
// One error at a time, shown beside the controls that fix it (below the API key field, above Speak) and
// scrolled into view; the status pill and the event log only repeat it. Kinds: "empty" (no text),
// "auth" (401: the key field asks for a key), "unreachable", "error" (anything else the gateway said).

function showNotice(kind, text, action = null) {
  state.notice = kind;
  state.noticeAction = action?.run ?? null;
  ui.noticeText.textContent = text;
  ui.noticeAction.hidden = !action;
  ui.noticeAction.textContent = action?.label ?? "";
  ui.notice.hidden = false;
  ui.notice.scrollIntoView({ block: "nearest" });
}

function clearNotice(...kinds) {
  if (state.notice === null || (kinds.length && !kinds.includes(state.notice))) return;
  state.notice = null;
  ui.notice.hidden = true;
  ui.apiKeyField.classList.remove("needs-key");
}

// fetch() rejects with a TypeError when nothing answers; the client's own connection failures carry the
// code "connection_failed". Errors the gateway sent carry its codes.
function unreachable(error) {
  return error instanceof TypeError || error?.code === "connection_failed";
}

function reportFailure(error, what) {
  logEvent(`${what}: ${error.message}`, "error");
  if (error?.code === "unauthorized") {
    setStatus("error", "API key needed");
    showNotice(
      "auth",
      ui.apiKey.value
        ? "The gateway refused this API key (401). Enter a valid key in the API key field and press Enter: the page retries with it."
        : "This gateway needs an API key (401). Enter it in the API key field and press Enter: the page retries with it.",
    );
    ui.apiKeyField.classList.add("needs-key");
    ui.apiKey.focus({ preventScroll: true });
  } else if (unreachable(error)) {
    setStatus("error", "gateway unreachable");
    showNotice("unreachable", `Cannot reach the gateway at ${gatewayUrl}. Is voxgate serve running there?`, {
      label: "Retry",
      run: retryGateway,
    });
  } else {
    setStatus("error", "error");
    showNotice("error", `${what} failed: ${error.message}`);
  }
}

const ms = (value) => (value === null || value === undefined ? "–" : `${Math.round(value)} ms`);
const count = (value) => (value ?? 0).toLocaleString("en-US");
const seconds = (frames, rate) => `${(rate ? frames / rate : 0).toFixed(2)} s`;

function selectedMode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function settings() {
  return {
    voice: ui.voice.value || undefined,
    responseFormat: ui.format.value,
    sampleRate: ui.sampleRate.value ? Number(ui.sampleRate.value) : undefined,
    apiKey: ui.apiKey.value || undefined,
    // Words as soon as their audio is sent, to highlight each one while it plays. A backend without
    // timestamps sends none, and the page then highlights nothing.
    timestampType: "word",
    timestampTransportStrategy: "async",
    // "Simulate LLM" sends tokens as they come: each sentence's synthesis starts at its first words where
    // the backend can take text while it speaks; elsewhere the gateway splits at sentences and warns.
    splitGranularity: "token",
  };
}

// ------------------------------------------------------------------------------------------ warnings
// What the gateway could not do as asked goes ahead without it, and says so: session.started's warnings
// (an unknown voice spoken by the default one, an option the backend ignores) and a sentence's audio.start
// warnings (its text is not in the voice's language). Every one is logged; those about the user's choices
// are shown beside the controls until the next session (session's) or the next Speak (sentences'). The
// page's own preferences (token splitting, word timestamps) are best effort: the log says what it got.

const PAGE_PREFERENCES = new Set(["split_granularity", "timestamp_type"]);

function describeWarning({ code, message }) {
  return `${message} (${code})`;
}

function renderWarnings() {
  const shown = state.sessionWarnings.map(describeWarning);
  const bySentence = new Map(); // warning text -> sentence numbers
  for (const { sentence, ...warning } of state.utterance?.warnings ?? []) {
    const text = describeWarning(warning);
    if (!bySentence.has(text)) bySentence.set(text, []);
    bySentence.get(text).push(sentence);
  }
  for (const [text, numbers] of bySentence) shown.push(`Sentence${numbers.length > 1 ? "s" : ""} ${numbers.join(", ")}: ${text}`);
  ui.warningList.replaceChildren(...shown.map((text) => Object.assign(document.createElement("li"), { textContent: text })));
  ui.warnings.hidden = shown.length === 0;
}

// ------------------------------------------------------------------------------------------ session

// Load the gateway's voices (and its backend's name): the page's first contact, repeated when the user
// gives a key or asks to retry. Returns whether the gateway answered.
async function loadGateway(select = null) {
  const apiKey = ui.apiKey.value || null;
  state.keyTried = ui.apiKey.value;
  try {
    const voices = await listVoices(gatewayUrl, { apiKey });
    ui.voice.replaceChildren(
      ...voices.data.map((voice) => {
        const option = new Option(voice.name, voice.id);
        option.title = voice.description || voice.language || "";
        option.selected = voice.id === (select ?? voices.default);
        return option;
      }),
    );
    // Shown either way: a backend that cannot clone gets the panel disabled, with what cloning needs.
    ui.clonePanel.classList.toggle("unavailable", !voices.voice_cloning);
    ui.cloneFields.disabled = !voices.voice_cloning;
    ui.cloneUnavailable.hidden = Boolean(voices.voice_cloning);
    if (!state.client) state.pillFromReadiness = true; // the gateway answered: its readiness says the rest
    clearNotice("auth", "unreachable");
    checkReadiness();
    loadBackendInfo(apiKey);
    return true;
  } catch (error) {
    reportFailure(error, "voices");
    return false;
  }
}

function loadBackendInfo(apiKey) {
  fetch(new URL("/v1/models", gatewayUrl), { headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {} })
    .then((response) => (response.ok ? response.json() : null))
    .then((models) => {
      const model = models?.data?.[0];
      if (model) ui.backendInfo.textContent = `${model.id} · ${model.backend} backend`;
    })
    .catch(() => {});
}

// ------------------------------------------------------------------------------------------ readiness
// The pill follows the gateway's /ready for the page's life: "starting" while it answers 503 (its backend
// still loading or warming up, its store unreachable), "ready" once it answers 200, checked again every few
// seconds (a gateway drains, restarts, loses its store). /ready needs no key. Where the page cannot read
// it (another origin without CORS) but the gateway answers, the pill says "connected".

const READINESS_POLL_MS = { ready: 5000, other: 1000 };
let readinessTimer = null;

async function readGatewayReadiness() {
  const url = new URL("/ready", gatewayUrl);
  try {
    const response = await fetch(url, { cache: "no-store" });
    const body = await response.json().catch(() => ({}));
    if (response.ok) return { readiness: "ready" };
    if (body.status === "failed") return { readiness: "failed", detail: body.error };
    if (body.draining) return { readiness: "draining" };
    return { readiness: "starting", detail: body.store ? `store: ${body.store}` : null };
  } catch (error) {
    // Unreachable, or reachable but unreadable here: an opaque answer tells the two apart.
    const answered = await fetch(url, { mode: "no-cors", cache: "no-store" }).then(() => true, () => false);
    return { readiness: answered ? "unknown" : "unreachable" };
  }
}

async function checkReadiness() {
  clearTimeout(readinessTimer);
  const { readiness, detail } = await readGatewayReadiness();
  const previous = state.readiness;
  const changed = readiness !== previous;
  state.readiness = readiness;
  if (changed && readiness !== "ready") logEvent(`gateway ${readiness}${detail ? `: ${detail}` : ""}`, "warn");
  // An error the user must act on (a key), or a session's own state, keeps the pill; readiness takes it
  // back when it was readiness that set it, or whenever the gateway cannot serve.
  const mayShow = state.pillFromReadiness || ui.status.dataset.state === "idle";
  if (readiness === "ready" || readiness === "unknown") {
    if (mayShow) setStatus("idle", readiness === "ready" ? "ready" : "connected", { readiness: true });
    // The gateway could not answer before (unreachable, or its backend loading and its voices unknown):
    // load the voices again now that it can.
    if (state.notice === "unreachable" || (changed && previous !== null)) loadGateway(ui.voice.value || null);
  } else if (readiness === "unreachable") {
    if (mayShow || state.client === null) setStatus("error", "gateway unreachable", { readiness: true });
  } else if (mayShow || state.client === null || readiness === "failed") {
    const text = { starting: "starting…", draining: "draining", failed: "backend failed" }[readiness];
    setStatus(readiness === "failed" ? "error" : "busy", text, { readiness: true });
  }
  clearTimeout(readinessTimer); // one loop, however many checks were in flight
  readinessTimer = setTimeout(checkReadiness, readiness === "ready" ? READINESS_POLL_MS.ready : READINESS_POLL_MS.other);
}

// After a new key or a Retry: check the gateway again, then speak if Speak was what failed.
async function retryGateway() {
  if (!(await loadGateway()) || !state.retrySpeak) return;
  state.retrySpeak = false;
  await speak();
}

async function ensurePlayer() {
  if (!state.player) {
    state.player = new StreamPlayer({ prerollMs: Number(ui.preroll.value) });
    await state.player.start();
    state.player.on("stats", (stats) => {
      sparkline.push(performance.now(), stats);
      renderStats(stats);
    });
    state.player.on("segmentstart", ({ tag, at, contextTime }) => {
      const sentence = state.utterance?.byTag.get(tag);
      if (sentence && sentence.playAt === null) {
        sentence.playAt = at - state.utterance.t0;
        sentence.playContextTime = contextTime;
        renderSentenceRow(sentence);
      }
    });
    state.player.on("underrun", ({ tag }) => {
      const sentence = state.utterance?.byTag.get(tag);
      logEvent(sentence ? `underrun in sentence ${sentence.number}` : "underrun", "warn");
    });
    state.player.on("gap", ({ tag, ms: gapMs }) => {
      const sentence = state.utterance?.byTag.get(tag);
      if (sentence) sentence.gapBeforeMs = gapMs;
      logEvent(`${Math.round(gapMs)} ms of silence before ${sentence ? `sentence ${sentence.number}` : "a sentence"}: its audio came late`, "warn");
    });
  }
  state.player.setPrerollMs(Number(ui.preroll.value));
  if (state.player.context.state !== "running") await state.player.context.resume();
  return state.player;
}

async function ensureClient() {
  const wanted = settings();
  const key = JSON.stringify(wanted);
  if (state.client && !state.client.closed && state.clientKey === key) return state.client;
  if (state.client && !state.client.closed) await state.client.close().catch(() => {});
  setStatus("busy", "connecting");
  // autoResume: a dropped connection is resumed where it stopped; the audio continues without a gap
  // beyond the reconnect time.
  const client = await VoxgateClient.connect(gatewayUrl, { ...wanted, autoResume: true });
  state.client = client;
  state.clientKey = key;
  clearNotice("auth", "unreachable", "error");
  setStatus("live", `session ${client.sessionId.slice(0, 8)}`);
  ui.rates.textContent = `stream ${client.format} @ ${client.sampleRate} Hz → audio context @ ${state.player.sampleRate} Hz (resampled in the worklet)`;
  logEvent(`session.started: voice ${client.voice}, ${client.format} ${client.sampleRate} Hz, ` +
    (client.textStreaming ? "synthesis from each sentence's first words" : "synthesis sentence by sentence"));
  for (const warning of client.warnings) logEvent(`warning ${warning.code}: ${warning.message}`, "warn");
  state.sessionWarnings = client.warnings.filter((warning) => !PAGE_PREFERENCES.has(warning.field));
  renderWarnings();
  wireClient(client);
  return client;
}

function wireClient(client) {
  const player = state.player;
  const tag = (index) => `${client.sessionId}:${index}`;
  client.on("audio.start", (message) => {
    const utterance = state.utterance;
    if (!utterance || message.context_id !== utterance.contextId) return;
    const sentence = {
      index: message.sentence_index, // the session's count
      number: utterance.sentences.length + 1, // this utterance's count, as the page shows it
      tag: tag(message.sentence_index),
      text: message.sentence_text,
      textReadyAt: utterance.textReadyAt(message.sentence_text),
      firstAudioAt: null,
      playAt: null,
      bytes: 0,
      samples: 0,
      sampleRate: message.sample_rate,
      done: false,
      cut: false,
      playContextTime: null, // the audio context's time at which its first sample plays
      words: [], // {word, start, end, element}: seconds from the start of the sentence's audio
    };
    utterance.sentences.push(sentence);
    utterance.byTag.set(sentence.tag, sentence);
    renderSentenceRow(sentence);
    if (message.voice) logEvent(`sentence ${sentence.number} is spoken by voice ${message.voice}`);
    for (const warning of message.warnings ?? []) {
      logEvent(`sentence ${sentence.number}: warning ${warning.code}: ${warning.message}`, "warn");
      utterance.warnings.push({ ...warning, sentence: sentence.number });
    }
    if (message.warnings?.length) renderWarnings();
  });
  client.on("audio", (chunk) => {
    const utterance = state.utterance;
    if (!utterance || utterance.outcome === "interrupted" || chunk.contextId !== utterance.contextId) return;
    const sentence = utterance.byTag.get(tag(chunk.sentenceIndex));
    const now = performance.now() - utterance.t0;
    if (utterance.firstByteAt === null) utterance.firstByteAt = now;
    if (sentence.firstAudioAt === null) sentence.firstAudioAt = now;
    sentence.bytes += chunk.bytes.byteLength;
    sentence.samples += chunk.samples.length;
    utterance.bytes += chunk.bytes.byteLength;
    utterance.samples += chunk.samples.length;
    player.write(chunk.samples, chunk.sampleRate, sentence.tag);
  });
  client.on("words", ({ sentenceIndex, contextId, words }) => {
    const utterance = state.utterance;
    if (!utterance || utterance.outcome === "interrupted" || contextId !== utterance.contextId) return;
    const sentence = utterance.byTag.get(tag(sentenceIndex));
    if (!sentence) return;
    for (const { word, start, end } of words) {
      const element = document.createElement("span");
      element.className = "word";
      element.textContent = word;
      ui.spokenWords.append(element, " ");
      sentence.words.push({ word, start, end, element });
      utterance.wordCount += 1;
    }
  });
  client.on("audio.done", (message) => {
    player.endSegment(tag(message.sentence_index));
    const sentence = state.utterance?.byTag.get(tag(message.sentence_index));
    if (sentence) {
      sentence.done = true;
      sentence.totalBytes = message.total_bytes;
      // Token splitting: audio.start had the first words only; the whole sentence comes with audio.done.
      if (message.sentence_text !== undefined) {
        sentence.text = message.sentence_text;
        sentence.textReadyAt = state.utterance.textReadyAt(message.sentence_text);
      }
      renderSentenceRow(sentence);
    }
  });
  client.on("utterance.done", (message) => {
    const utterance = state.utterance;
    if (!utterance || message.context_id !== utterance.contextId) return;
    utterance.finished = true;
    utterance.serverSentences = message.total_sentences;
    logEvent(`utterance.done: ${message.total_sentences} sentences, ${count(utterance.bytes)} bytes`);
    // Every sample of it has reached the player: finished once the worklet says all of that has played
    // (its stats, posted every few quanta, may not have seen the last sentence yet).
    player.whenDrained().then(({ interrupted }) => {
      if (!interrupted && state.utterance === utterance) finishUtterance("played");
    });
  });
  client.on("context.cancelled", (message) => {
    const heard = message.spoken_text === undefined || message.spoken_text === null ? "" : `: heard "${message.spoken_text}"`;
    logEvent(`context.cancelled (${message.context_id})${heard}`, "warn");
    const utterance = state.utterance;
    if (utterance && message.context_id === utterance.contextId) {
      utterance.cancelAcknowledged = true;
      utterance.heardText = message.spoken_text ?? null;
    }
  });
  client.on("error", (message) => {
    logEvent(`error ${message.code}: ${message.message}`, "error");
    if (!message.retryable) showNotice("error", `The gateway answered ${message.code}: ${message.message}`);
  });
  client.on("reconnecting", ({ code, sentence_index, bytes_received }) => {
    setStatus("busy", "reconnecting");
    logEvent(`connection lost (${code}); resuming at sentence ${sentence_index}, byte ${bytes_received}`, "warn");
  });
  client.on("resumed", () => {
    setStatus("live", `session ${client.sessionId.slice(0, 8)}`);
    logEvent("session resumed");
  });
  client.on("close", ({ code }) => {
    if (state.client === client) {
      setStatus(code === 1000 ? "idle" : "error", code === 1000 ? "session closed" : `closed (${code})`);
      state.client = null;
      if (code !== 1000) showNotice("error", `The connection to the gateway closed (code ${code}). Speak opens a new session.`);
    }
  });
}

// ------------------------------------------------------------------------------------------ speaking

function newUtterance(contextId, text) {
  const t0 = performance.now();
  const sent = []; // [{end: cumulative characters, at}]
  let cumulative = "";
  let searchFrom = 0;
  return {
    contextId,
    text,
    t0,
    sentences: [],
    byTag: new Map(),
    warnings: [], // audio.start's warnings: {code, message, field, sentence (its number)}
    bytes: 0,
    samples: 0,
    firstByteAt: null,
    wordCount: 0,
    current: null, // the word being played: {sentence, word}
    cursor: { sentence: 0, word: 0 }, // the first word not highlighted yet
    highlights: [], // every word highlighted, in order: {number, index, word, at (ms)}
    counterBase: null, // the player's counters when it began: the cards show this utterance's audio
    playedMs: null, // sent with input.cancel: how much of its audio was heard
    heardText: null, // context.cancelled's spoken_text
    finished: false,
    cancelAcknowledged: false,
    outcome: null,
    abort: new AbortController(),
    recordSent(token) {
      cumulative += token;
      sent.push({ end: cumulative.length, at: performance.now() - t0 });
    },
    // When the text of a sentence was complete on the wire: the time its last character was sent.
    textReadyAt(sentenceText) {
      const found = cumulative.indexOf(sentenceText.trim(), searchFrom);
      if (found < 0) return null;
      const end = found + sentenceText.trim().length;
      searchFrom = end;
      return sent.find((entry) => entry.end >= end)?.at ?? null;
    },
  };
}

async function speak() {
  const text = ui.text.value.trim();
  if (!text) {
    ui.text.setAttribute("aria-invalid", "true");
    showNotice("empty", "There is nothing to speak: type some text in the Text box first.");
    ui.text.focus({ preventScroll: true });
    return;
  }
  ui.text.removeAttribute("aria-invalid");
  clearNotice("empty");
  if (state.utterance && !state.utterance.outcome) await interrupt();
  await state.interrupting; // its report has landed: the counters below are current
  ui.speak.disabled = true;
  try {
    const player = await ensurePlayer();
    const client = await ensureClient();
    const contextId = `utt-${++state.utteranceCount}`;
    const utterance = newUtterance(contextId, text);
    if (state.utterance) player.forget(state.utterance.sentences.map((sentence) => sentence.tag));
    utterance.counterBase = { queued: player.stats.framesQueued, played: player.stats.framesPlayed };
    state.utterance = utterance;
    renderWarnings();
    chart.reset(utterance);
    ui.rows.replaceChildren();
    ui.spokenWords.replaceChildren();
    logSeparator(`utterance ${state.utteranceCount} (${contextId})`);
    player.markRequest(performance.now());
    ui.interrupt.disabled = false;
    setStatus("live", "speaking");
    const mode = selectedMode();
    logEvent(mode === "llm" ? `streaming tokens at ${ui.tokensPerSecond.value}/s` : "text sent");
    const tokens = mode === "llm" ? simulatedTokens(text, { tokensPerSecond: Number(ui.tokensPerSecond.value), signal: utterance.abort.signal }) : [text];
    for await (const token of tokens) {
      if (utterance.abort.signal.aborted) break;
      utterance.recordSent(token);
      client.sendText(token, { contextId });
    }
    if (!utterance.abort.signal.aborted) client.done({ contextId });
  } catch (error) {
    state.retrySpeak = error?.code === "unauthorized" || unreachable(error);
    reportFailure(error, "speak");
    ui.interrupt.disabled = true;
  } finally {
    ui.speak.disabled = false;
  }
}

async function interrupt() {
  const utterance = state.utterance;
  if (!utterance || utterance.outcome) return;
  utterance.abort.abort();
  utterance.interruptedAt = performance.now() - utterance.t0;
  // The worklet empties its queue now, and from here on the page writes none of this utterance's audio;
  // its report (within one render quantum) says how much of each sentence was dropped unplayed, so the
  // cancel can tell the gateway how much was heard: context.cancelled's spoken_text is then what the
  // listener heard, not what the gateway had sent (it sends faster than real time).
  const report = state.player ? state.player.interrupt() : Promise.resolve({ droppedFrames: 0 });
  for (const sentence of utterance.sentences) if (sentence.playAt !== null) sentence.cut = true;
  finishUtterance("interrupted");
  state.interrupting = report.then(({ droppedFrames }) => {
    utterance.playedMs = state.player ? state.player.heardMs(utterance.sentences.map((sentence) => sentence.tag)) : 0;
    if (state.client && !state.client.closed) state.client.cancel({ contextId: utterance.contextId, playedMs: utterance.playedMs });
    logEvent(`interrupted after ${Math.round(utterance.playedMs)} ms heard: ${Math.round((droppedFrames / (state.player?.sampleRate || 48000)) * 1000)} ms of queued audio dropped`, "warn");
  });
  await state.interrupting;
}

function finishUtterance(outcome) {
  const utterance = state.utterance;
  if (!utterance || utterance.outcome) return;
  utterance.outcome = outcome;
  utterance.endedAt = performance.now() - utterance.t0;
  utterance.endStats = state.player ? { ...state.player.stats } : null; // what the player had done by then
  ui.interrupt.disabled = true;
  if (state.client) setStatus("live", outcome === "played" ? "done" : "interrupted");
  if (outcome === "played") logEvent("playback finished");
  utterance.sentences.forEach(renderSentenceRow);
}

// ------------------------------------------------------------------------------------------ rendering

function renderStats(stats) {
  ui.playerState.textContent = stats.state;
  ui.playerState.dataset.state = stats.state;
  ui.ttfa.textContent = ms(stats.ttfaMs);
  ui.firstByte.textContent = ms(state.utterance?.firstByteAt ?? null);
  ui.buffered.textContent = `${Math.round(stats.bufferedMs)} ms`;
  // What a listener hears as a break: audio that ran out inside a sentence (underruns), and silences between
  // sentences because the next one came late (gaps; the natural pause at a sentence's end is in its audio).
  const heard = stats.underruns + stats.gaps;
  ui.underruns.textContent = count(heard);
  ui.underruns.title = `${count(stats.underruns)} inside sentences, ${count(stats.gaps)} between sentences ` +
    `(${(stats.gapFrames / (stats.contextRate || 1)).toFixed(1)} s of silence in all)`;
  ui.underruns.parentElement.classList.toggle("alert", heard > 0);
  // Both in seconds of the utterance's audio at the audio context's rate: what reached the worklet
  // (after resampling) and what it played, so the two agree once everything has played; after an
  // interrupt, received counts what was dropped unplayed too, and the next utterance starts both at 0.
  const base = state.utterance?.counterBase ?? { queued: stats.framesQueued, played: stats.framesPlayed };
  ui.received.textContent = seconds(stats.framesQueued - base.queued, stats.contextRate);
  ui.played.textContent = seconds(stats.framesPlayed - base.played, stats.contextRate);
  ui.received.title = `${count(stats.framesQueued)} frames at ${stats.contextRate} Hz (${count(stats.samplesReceived)} samples at the stream's rate)`;
  ui.played.title = `${count(stats.framesPlayed)} frames at ${stats.contextRate} Hz`;
  const utterance = state.utterance;
  if (utterance) {
    const played = utterance.sentences.filter((s) => s.playAt !== null).length;
    ui.sentencesInfo.textContent = `${played}/${utterance.sentences.length} sentences playing or played`;
  }
}

function renderSentenceRow(sentence) {
  let row = document.getElementById(`sentence-${sentence.number}`);
  if (!row) {
    row = document.createElement("tr");
    row.id = `sentence-${sentence.number}`;
    for (let i = 0; i < 6; i++) row.append(document.createElement("td"));
    ui.rows.append(row);
  }
  const cells = row.children;
  const durationMs = (sentence.samples / sentence.sampleRate) * 1000;
  cells[0].textContent = sentence.number;
  cells[1].textContent = sentence.text;
  cells[1].title = sentence.text;
  cells[2].textContent = ms(sentence.textReadyAt);
  cells[3].textContent = ms(sentence.firstAudioAt);
  const dropped = sentence.playAt === null && state.utterance?.outcome === "interrupted";
  cells[4].textContent = dropped ? "dropped" : ms(sentence.playAt);
  row.classList.toggle("dropped", dropped);
  cells[5].textContent = `${(durationMs / 1000).toFixed(2)} s${sentence.done ? "" : " …"}`;
}

// Highlight the word being played, by the audio clock: the sentence playing is the last one whose first
// sample has played, and every word whose start the time played since then has reached is highlighted in
// turn, the latest one as the current word. Words are visited in order from a cursor, so a word the clock
// passed between two frames (a zero-length word of Piper's, or any word on a slow machine) is still
// highlighted, once.
function highlightWord(utterance) {
  const context = state.player?.context;
  if (!context || utterance.outcome === "interrupted") return;
  const time = context.currentTime;
  let playing = null;
  for (const sentence of utterance.sentences) {
    if (sentence.playContextTime !== null && sentence.playContextTime <= time) playing = sentence;
  }
  if (!playing) return;
  const elapsed = time - playing.playContextTime;
  const cursor = utterance.cursor;
  let latest = null;
  while (cursor.sentence < utterance.sentences.length) {
    const sentence = utterance.sentences[cursor.sentence];
    if (sentence.number > playing.number) break;
    const word = sentence.words[cursor.word];
    if (word === undefined) {
      if (sentence === playing) break; // its next words have not arrived yet
      cursor.sentence += 1;
      cursor.word = 0;
      continue;
    }
    if (sentence === playing && word.start > elapsed) break;
    word.element.classList.add("played");
    utterance.highlights.push({ number: sentence.number, index: cursor.word, word: word.word, at: Math.round(performance.now() - utterance.t0) });
    latest = { sentence, word };
    cursor.word += 1;
  }
  if (!latest) return;
  utterance.current?.word.element.classList.remove("current");
  latest.word.element.classList.add("current");
  // Keep the word in view inside its box (never scrolling the page under the user).
  const box = ui.spokenWords;
  const top = latest.word.element.offsetTop;
  if (top < box.scrollTop || top + latest.word.element.offsetHeight > box.scrollTop + box.clientHeight) box.scrollTop = top;
  utterance.current = latest;
  ui.wordsInfo.textContent = `${utterance.highlights.length}/${utterance.wordCount} words`;
}

// Each frame draws the timeline, moves the word highlight and draws the jitter-buffer chart. Whatever one
// of them throws (a canvas call refusing its arguments, say), the others still run and the next frame
// still comes: the loop is scheduled first, each part is guarded, and each distinct error is reported
// once (in the console and the event log), not sixty times a second.
function animate() {
  requestAnimationFrame(animate);
  const now = performance.now();
  const utterance = state.utterance;
  if (utterance) {
    guarded("timeline", () => chart.draw(utterance, now - utterance.t0));
    guarded("word highlight", () => highlightWord(utterance));
  }
  guarded("jitter buffer chart", () => sparkline.draw(now, Number(ui.preroll.value)));
}

function guarded(part, run) {
  try {
    run();
  } catch (error) {
    const key = `${part}: ${error}`;
    if (state.drawErrors.has(key)) return;
    state.drawErrors.add(key);
    console.error(`web demo: the ${part} failed to draw`, error);
    logEvent(`the ${part} failed to draw: ${error.message}`, "error");
  }
}

// ------------------------------------------------------------------------------------------ wiring

// ------------------------------------------------------------------------------------------ cloning

// A clip recorded with the microphone (MediaRecorder: webm/opus or ogg, which the gateway decodes), or the
// chosen file, becomes a voice of this page's API key; the voice list then selects it.
async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const chunks = [];
    const recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (event) => chunks.push(event.data);
    recorder.onstop = () => {
      stream.getTracks().forEach((track) => track.stop());
      state.recorder = null;
      state.recording = new Blob(chunks, { type: recorder.mimeType });
      ui.cloneRecord.textContent = "Record again";
      ui.cloneStatus.value = `recorded ${((Date.now() - state.recordingStarted) / 1000).toFixed(1)} s`;
    };
    state.recorder = recorder;
    state.recordingStarted = Date.now();
    recorder.start();
    ui.cloneRecord.textContent = "Stop";
    ui.cloneStatus.value = "recording… read a sentence or two aloud";
  } catch (error) {
    ui.cloneStatus.value = `the microphone is not available: ${error.message}`;
  }
}

async function addClonedVoice() {
  const clip = ui.cloneFile.files[0] || state.recording;
  const name = ui.cloneName.value.trim();
  if (!clip || !name || !ui.cloneConsent.checked) {
    ui.cloneStatus.value = "choose or record a clip, name the voice and confirm the speaker's consent";
    return;
  }
  ui.cloneAdd.disabled = true;
  ui.cloneStatus.value = "cloning…";
  try {
    const refText = ui.cloneText.value.trim() || null;
    await addVoice(gatewayUrl, name, clip, {
      consent: "web demo: the speaker agreed", refText, xVectorOnly: !refText, apiKey: ui.apiKey.value || null,
    });
    await loadGateway(name);
    ui.cloneStatus.value = `voice ${name} added and selected`;
  } catch (error) {
    ui.cloneStatus.value = `${error.code ? `${error.code}: ` : ""}${error.message}`;
  } finally {
    ui.cloneAdd.disabled = false;
  }
}

ui.cloneRecord.addEventListener("click", toggleRecording);
ui.cloneAdd.addEventListener("click", addClonedVoice);
ui.cloneFile.addEventListener("change", () => {
  state.recording = null;
});
ui.speak.addEventListener("click", speak);
ui.interrupt.addEventListener("click", interrupt);
ui.tokensPerSecond.addEventListener("input", () => {
  ui.tokensPerSecondValue.textContent = `${ui.tokensPerSecond.value} tokens/s`;
});
for (const radio of document.querySelectorAll('input[name="mode"]')) {
  radio.addEventListener("change", () => ui.llmRow.classList.toggle("disabled", selectedMode() !== "llm"));
}
ui.llmRow.classList.toggle("disabled", selectedMode() !== "llm");
ui.format.addEventListener("change", () => {
  // G.711 is a telephony format: the gateway sends it at 8 kHz unless told otherwise.
  if (ui.format.value !== "pcm" && !ui.sampleRate.value) ui.sampleRate.value = "8000";
});
ui.text.addEventListener("input", () => {
  ui.text.removeAttribute("aria-invalid");
  clearNotice("empty");
});
ui.noticeAction.addEventListener("click", () => state.noticeAction?.());
// A new key is tried when the field is left or Enter is pressed (Enter tries the same key again).
ui.apiKey.addEventListener("change", () => {
  if (ui.apiKey.value !== state.keyTried) retryGateway();
});
ui.apiKey.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.ctrlKey && !event.metaKey) {
    event.preventDefault();
    retryGateway();
  }
});
window.addEventListener("keydown", (event) => {
  if (event.key === "Escape") interrupt();
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) speak();
});

loadGateway();
checkReadiness();
requestAnimationFrame(animate);

// A read-only view of the page's state for automated checks.
window.voxgateDemo = {
  speak,
  interrupt,
  snapshot() {
    const utterance = state.utterance;
    return {
      status: ui.status.dataset.state,
      pill: ui.status.textContent,
      readiness: state.readiness,
      shownWarnings: ui.warnings.hidden ? [] : [...ui.warningList.children].map((item) => item.textContent),
      underrunsTile: ui.underruns.textContent,
      clone: {
        shown: !ui.clonePanel.hidden,
        offered: !ui.clonePanel.hidden && !ui.cloneFields.disabled,
        unavailable: ui.cloneUnavailable.hidden ? null : ui.cloneUnavailable.textContent,
        status: ui.cloneStatus.value,
      },
      notice: ui.notice.hidden ? null : { kind: state.notice, text: ui.noticeText.textContent },
      sessionId: state.client?.sessionId ?? null,
      streamRate: state.client?.sampleRate ?? null,
      format: state.client?.format ?? null,
      textStreaming: state.client?.textStreaming ?? null,
      warnings: state.client ? state.client.warnings.map((warning) => warning.field) : null,
      bytesPerSample: state.client ? bytesPerSample(state.client.format) : null,
      contextRate: state.player?.sampleRate ?? null,
      player: state.player ? { ...state.player.stats } : null,
      log: [...ui.events.children].map((item) => item.textContent).reverse(),
      utterance: utterance && {
        contextId: utterance.contextId,
        bytes: utterance.bytes,
        samples: utterance.samples,
        finished: utterance.finished,
        outcome: utterance.outcome,
        endedAt: utterance.endedAt ?? null,
        counterBase: utterance.counterBase,
        endStats: utterance.endStats ?? null,
        playedMs: utterance.playedMs,
        heardText: utterance.heardText,
        cancelAcknowledged: utterance.cancelAcknowledged,
        serverSentences: utterance.serverSentences ?? null,
        words: utterance.sentences.flatMap((s) => s.words.map(({ word, start, end }) => ({ number: s.number, word, start, end }))),
        highlights: utterance.highlights,
        highlighted: ui.spokenWords.querySelector(".word.current")?.textContent ?? null,
        sentences: utterance.sentences.map(({ index, number, text, bytes, samples, totalBytes, done, firstAudioAt, playAt, textReadyAt, gapBeforeMs }) => ({
          index, number, text, bytes, samples, totalBytes: totalBytes ?? null, done, firstAudioAt, playAt, textReadyAt,
          gapBeforeMs: gapBeforeMs ?? null,
        })),
      },
    };
  },
};
