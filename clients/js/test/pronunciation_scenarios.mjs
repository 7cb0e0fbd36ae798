// Pronunciation in voxgate.js (issue 34): a session configured with `pronunciations` and `textMarkup`
// speaks a text; prints the result's words and each sentence's text as JSON for
// tests/test_client_pronunciation.py. Usage:
//   node pronunciation_scenarios.mjs <gateway base url> <voice> <text> <pronunciations as JSON>

import { VoxgateClient } from "../voxgate.js";

const [baseUrl, voice, text, pronunciations] = process.argv.slice(2);
const client = await VoxgateClient.connect(baseUrl, {
  voice, timestampType: "word", pronunciations: JSON.parse(pronunciations), textMarkup: "ssml",
});
const sentenceTexts = [];
client.on("audio.start", (message) => sentenceTexts.push(message.sentence_text));
const result = await client.context("reply").speak(text);
await client.close();
console.log(JSON.stringify({ words: result.words.map((w) => w.word), sentenceTexts }));
