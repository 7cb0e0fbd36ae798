// Word timestamps in voxgate.js (issue 16): drives the client against a gateway that sends them and prints
// what it observed as JSON; tests/test_client_word_timestamps.py checks it. Usage:
//   node word_scenarios.mjs <gateway base url> <voice> <text> <long text> <words before the barge-in>

import { VoxgateClient } from "../voxgate.js";

const [baseUrl, voice, text, longText, wordsBeforeCut] = process.argv.slice(2);

// One utterance per transport strategy: every `words` event, with the bytes of its sentence received
// before it, and the words of the utterance's result.
async function utterance(strategy) {
  const client = await VoxgateClient.connect(baseUrl, { voice, timestampType: "word", timestampTransportStrategy: strategy });
  let received = 0;
  const events = [];
  client.on("audio", (chunk) => { received = chunk.offset + chunk.bytes.byteLength; });
  client.on("words", (event) => events.push({ ...event, receivedBefore: received }));
  const result = await client.context("reply-1").speak(text);
  await client.close();
  return { events, resultWords: result.words };
}

// A barge-in once some words were given out: those words, the bytes received of each sentence (also those
// dropped after the cancel), and the spoken text and words of the cancelled result.
async function bargeIn() {
  const client = await VoxgateClient.connect(baseUrl, { voice, timestampType: "word", timestampTransportStrategy: "async" });
  const given = [];
  const context = client.context("barge-in");
  const finished = context.stream([longText]);
  client.on("words", (event) => {
    given.push(...event.words);
    if (given.length >= Number(wordsBeforeCut) && !client.cancelledContexts.has("barge-in")) context.cancel();
  });
  const result = await finished;
  await client.close();
  const received = Object.fromEntries([...client.sentences.values()].map((record) => [record.index, record.bytes]));
  return { given, received, spokenText: result.spokenText, spokenWords: result.spokenWords };
}

// The socket dies once some words were given out; autoResume replays the missing audio with its words, and
// every word must still be given out once.
async function resumed() {
  const client = await VoxgateClient.connect(baseUrl, {
    voice, timestampType: "word", timestampTransportStrategy: "async", autoResume: true,
  });
  const given = [];
  client.on("words", (event) => {
    given.push(...event.words);
    if (given.length >= Number(wordsBeforeCut) && client.resumes === 0 && !client.resuming) client.socket.terminate();
  });
  await client.context("resumed").speak(longText);
  await client.close();
  return { given, resumes: client.resumes };
}

console.log(JSON.stringify({
  async: await utterance("async"),
  sync: await utterance("sync"),
  bargeIn: await bargeIn(),
  resumed: await resumed(),
}));
