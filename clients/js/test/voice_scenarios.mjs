// Cloned voices through the client's helpers: addVoice, listVoices, deleteVoice, with two API keys.
// Usage: node voice_scenarios.mjs <gateway url> <key A> <key B> <reference clip file>

import { readFile } from "node:fs/promises";
import { VoxgateClient, addVoice, deleteVoice, listVoices } from "../voxgate.js";
import { refusal } from "./refusal.mjs";

const [baseUrl, keyA, keyB, clipPath] = process.argv.slice(2);
const output = {};

const clip = new Uint8Array(await readFile(clipPath));
output.added = await addVoice(baseUrl, "js-voice", clip, { consent: "rec-7", refText: "Hello there.", apiKey: keyA });
output.listedA = (await listVoices(baseUrl, { apiKey: keyA })).uploaded_voices.map((v) => v.name);
output.listedB = (await listVoices(baseUrl, { apiKey: keyB })).uploaded_voices.map((v) => v.name);
output.badClip = await refusal(() => addVoice(baseUrl, "junk", new Uint8Array(4000), { consent: "c", refText: "x", apiKey: keyA }));
const client = await VoxgateClient.connect(baseUrl, { apiKey: keyA, config: { voice: "js-voice", response_format: "pcm" } });
const spoken = await client.speak("Spoken with the cloned voice.");
output.spokenBytes = spoken.bytes;
await client.close();
output.deleteByB = await refusal(() => deleteVoice(baseUrl, "js-voice", { apiKey: keyB }));
await deleteVoice(baseUrl, "js-voice", { apiKey: keyA });
output.afterDelete = (await listVoices(baseUrl, { apiKey: keyA })).uploaded_voices.length;
process.stdout.write(JSON.stringify(output));
