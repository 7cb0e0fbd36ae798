// The API key path a browser takes: no headers on a WebSocket, so the key travels as ?api_key=.
// Run with `node --experimental-websocket` so that the client uses the platform WebSocket (as in a
// browser) instead of `ws`. Usage: node --experimental-websocket auth_scenarios.mjs <gateway url> <key>

import { VoxgateClient, listVoices } from "../voxgate.js";
import { refusal } from "./refusal.mjs";

const [baseUrl, apiKey] = process.argv.slice(2);
const output = { platformWebSocket: typeof globalThis.WebSocket === "function" };

output.withoutKey = await refusal(() => VoxgateClient.connect(baseUrl, {}));
output.wrongKey = await refusal(() => VoxgateClient.connect(baseUrl, { apiKey: "not-the-key" }));
output.voicesWithoutKey = await refusal(() => listVoices(baseUrl));
output.voices = (await listVoices(baseUrl, { apiKey })).voices;
const client = await VoxgateClient.connect(baseUrl, { apiKey });
output.usedPlatformWebSocket = client.socket instanceof globalThis.WebSocket;
output.url = client.socket.url.replace(apiKey, "<key>");
const result = await client.speak("Authorized speech.");
output.spoken = { sentences: result.sentences.length, bytes: result.bytes };
await client.close();
process.stdout.write(JSON.stringify(output));
