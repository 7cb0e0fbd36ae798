// Drives voxgate.js in Node 20 against a running gateway and prints what it observed as JSON.
// tests/test_client_js.py starts the gateway (synthetic backend), runs this, and checks every number
// against the backend's own output. Usage: node client_scenarios.mjs <gateway base url> <voice>

import { createHash } from "node:crypto";
import { VoxgateClient, simulatedTokens, listVoices } from "../voxgate.js";

const [baseUrl, voice] = process.argv.slice(2);

function sha256(chunks) {
  const hash = createHash("sha256");
  for (const chunk of chunks) hash.update(chunk);
  return hash.digest("hex");
}

// Collects every audio event per sentence: the raw bytes, and the decoded samples' count.
function recordAudio(client) {
  const sentences = new Map();
  client.on("audio", (chunk) => {
    if (!sentences.has(chunk.sentenceIndex)) {
      sentences.set(chunk.sentenceIndex, { contextId: chunk.contextId, chunks: [], bytes: 0, samples: 0, offsets: [] });
    }
    const record = sentences.get(chunk.sentenceIndex);
    record.offsets.push(chunk.offset);
    record.chunks.push(Buffer.from(chunk.bytes));
    record.bytes += chunk.bytes.byteLength;
    record.samples += chunk.samples.length;
  });
  return sentences;
}

function summarize(result, audio) {
  return {
    contextId: result.contextId,
    cancelled: result.cancelled,
    bytes: result.bytes,
    sentences: result.sentences.map((record) => {
      const heard = audio.get(record.index) || { chunks: [], bytes: 0, samples: 0, offsets: [] };
      return {
        index: record.index,
        text: record.text,
        bytes: record.bytes,
        totalBytes: record.totalBytes ?? null,
        error: record.error,
        audioBytes: heard.bytes,
        audioSamples: heard.samples,
        offsetsContiguous: heard.offsets.every((offset, i) => i === 0 || offset > heard.offsets[i - 1]),
        sha256: sha256(heard.chunks),
      };
    }),
  };
}

async function fullUtterance() {
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7 });
  const audio = recordAudio(client);
  const events = [];
  for (const type of ["audio.start", "audio.done", "session.done"]) client.on(type, () => events.push(type));
  const text = "Hello from the JavaScript client. It streams audio sentence by sentence! Does it work? Yes.";
  const result = await client.speak(text);
  const out = {
    session: { id: client.sessionId, sampleRate: client.sampleRate, format: client.format, voice: client.voice },
    text,
    events,
    totalBytesReceived: client.totalBytesReceived,
    resumeState: client.resumeState(),
    ...summarize(result, audio),
  };
  out.pingMs = await client.ping();
  await client.close();
  out.closed = client.closed;
  return out;
}

async function streamedTokens() {
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7, sampleRate: 16000 });
  const audio = recordAudio(client);
  const text = "Tokens arrive one by one, like an LLM writing. The client sends each as it comes. Then it ends.";
  const result = await client.streamText(simulatedTokens(text, { tokensPerSecond: 200 }));
  await client.close();
  return { text, sampleRate: client.sampleRate, ...summarize(result, audio) };
}

async function contexts() {
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7 });
  const audio = recordAudio(client);
  const first = client.context("first");
  const second = client.context("second");
  const firstText = "The first context speaks two sentences. This is its second one.";
  const secondText = "The second context has its own words. It also says three sentences. Here is the third.";
  const firstDone = first.speak(firstText);
  const secondDone = second.speak(secondText);
  const utteranceDone = [];
  client.on("utterance.done", (message) => utteranceDone.push(message));
  const results = await Promise.all([firstDone, secondDone]);
  await client.close();
  return {
    texts: { first: firstText, second: secondText },
    utteranceDone,
    results: results.map((result) => summarize(result, audio)),
  };
}

// What split_granularity each way of configuring asks for, and what the gateway answered.
async function granularity() {
  const out = {};
  for (const [name, options] of [["default", {}], ["sentence", { splitGranularity: "sentence" }], ["none", { splitGranularity: null }]]) {
    const client = await VoxgateClient.connect(baseUrl, { voice, ...options });
    out[name] = { textStreaming: client.textStreaming, warnings: client.warnings.map((w) => w.field) };
    if (name === "sentence") {
      await client.configure({ voice });  // the default again, on the same session
      out.reconfigured = { textStreaming: client.textStreaming, warnings: client.warnings.map((w) => w.field) };
    }
    await client.close();
  }
  return out;
}

async function cancel() {
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7 });
  const audio = recordAudio(client);
  const sentence = "This sentence is long enough to take a while to speak at a natural rate.";
  const text = Array.from({ length: 12 }, () => sentence).join(" ");
  const talker = client.context("talker");
  const finished = talker.speak(text);
  // Barge in as soon as the first audio of the context arrives.
  await new Promise((resolve) => client.once("audio", resolve));
  const cancelledAt = client.totalBytesReceived;
  let audioEventsAfterCancel = 0;
  talker.cancel();
  client.on("audio", (chunk) => {
    if (chunk.contextId === "talker") audioEventsAfterCancel++;
  });
  const cancelledMessage = client.waitFor("context.cancelled");
  const result = await finished;
  const message = await cancelledMessage;
  // The session stays usable after a cancel: a new context speaks in full.
  const after = await client.context("after").speak("Still here after the barge-in.");
  await client.close();
  return {
    text,
    sentence,
    cancelled: result.cancelled,
    cancelledMessage: message,
    bytesWhenCancelled: cancelledAt,
    bytesOnWireTotal: client.totalBytesReceived,
    audioEventsAfterCancel,
    // Everything that reached the socket for the cancelled context, including frames dropped locally.
    wireBytes: [...client.sentences.values()].filter((r) => r.contextId === "talker").reduce((sum, r) => sum + r.bytes, 0),
    emittedBytes: [...audio.values()].filter((r) => r.contextId === "talker").reduce((sum, r) => sum + r.bytes, 0),
    after: summarize(after, audio),
  };
}

async function resumePosition() {
  // The position a client would resume from after losing its connection mid-sentence.
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7 });
  const text = Array.from({ length: 6 }, () => "A steady sentence that keeps the audio flowing for a while.").join(" ");
  client.sendText(text);
  client.done();
  let frames = 0;
  await new Promise((resolve) => {
    client.on("audio", () => {
      frames += 1;
      if (frames === 3) resolve();
    });
  });
  const state = client.resumeState();
  const index = state.sentence_index;
  const receivedForSentence = client.sentences.get(index).bytes;
  client.disconnect();
  await new Promise((resolve) => client.once("close", resolve));
  return { state, receivedForSentence, frames };
}

async function autoResume() {
  // The connection drops mid-sentence (the TCP socket is destroyed, no close frame): the client resumes
  // the session on a new socket and the audio continues exactly where it stopped.
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7, autoResume: true });
  const audio = recordAudio(client);
  const events = [];
  client.on("reconnecting", (event) => events.push({ type: "reconnecting", ...event }));
  client.on("resumed", (event) => events.push({ type: "resumed", ...event }));
  const text = "First comes a sentence that is long enough to be cut in the middle. Then a second one follows it. A third ends the test.";
  const finished = client.speak(text);
  let frames = 0;
  const dropped = new Promise((resolve) => {
    const remove = client.on("audio", () => {
      if (++frames === 3) {
        remove();
        const position = client.resumeState();
        client.socket.terminate();
        resolve(position);
      }
    });
  });
  const droppedAt = await dropped;
  const result = await finished;
  const out = { text, droppedAt, events, resumes: client.resumes, ...summarize(result, audio) };
  await client.close();
  return out;
}

async function autoResumeLostInput() {
  // Text written to a socket that silently loses it (as the kernel takes bytes for a replica that just
  // died) is sent again after the resume, past what the gateway acknowledges: all of it is spoken.
  const client = await VoxgateClient.connect(baseUrl, { voice, seed: 7, autoResume: true });
  const audio = recordAudio(client);
  const events = [];
  client.on("resumed", (event) => events.push(event));
  const first = "The first sentence arrives as usual. Then";
  const lost = [" comes text that the dying socket loses.", " It is spoken all the same."];
  const text = first + lost.join("");
  client.sendText(first);
  await new Promise((resolve) => {
    const remove = client.on("audio", () => {
      remove();
      resolve();
    });
  });
  const socket = client.socket;
  socket.send = () => {}; // the bytes go nowhere; the client cannot tell
  client.sendText(lost[0]);
  const finished = client.streamText(lost.slice(1)); // sent after the socket closed: kept for the resume
  socket.terminate();
  const result = await finished;
  const out = { text, events, endsReceived: client.endsReceived, resumes: client.resumes, ...summarize(result, audio) };
  await client.close();
  return out;
}

async function errors() {
  // An unknown voice is refused with its protocol code instead of a silent default.
  try {
    await VoxgateClient.connect(baseUrl, { voice: "no-such-voice" });
    return { unknownVoice: null };
  } catch (error) {
    return { unknownVoice: { code: error.code, message: error.message, retryable: error.retryable } };
  }
}

const scenarios = { fullUtterance, granularity, streamedTokens, contexts, cancel, resumePosition, autoResume, autoResumeLostInput, errors };
const output = { node: process.version, hasGlobalWebSocket: typeof globalThis.WebSocket !== "undefined" };
output.voices = await listVoices(baseUrl);
for (const [name, run] of Object.entries(scenarios)) {
  const started = performance.now();
  output[name] = await run();
  output[name].elapsedMs = Math.round(performance.now() - started);
}
process.stdout.write(JSON.stringify(output));
