// The web demo's "Clone a voice" panel in headless Chromium (chromium.mjs), against a gateway whose
// backend clones: a clip file is chosen, named and consented to, Add voice registers it, the voice list
// selects it, and Speak opens a session with that voice; then a clip recorded from the microphone (Chromium's
// fake capture device: a tone) makes a second voice. Prints JSON for tests/test_web_demo.py.
// Usage: node web_demo_clone.mjs <page url> <clip file> <voice name>

import { runBrowserCheck } from "./chromium.mjs";

const [pageUrl, clipPath, name] = process.argv.slice(2);

await runBrowserCheck(async (browser, output) => {
  output.pageErrors = [];
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  const waitFor = (predicate, arg) => page.waitForFunction(predicate, arg, { timeout: 30000, polling: 50 });
  await page.goto(`${pageUrl}/`);
  await waitFor(() => window.voxgateDemo?.snapshot().clone.offered);
  await page.click("#clone-panel summary");
  await page.setInputFiles("#clone-file", clipPath);
  await page.fill("#clone-name", name);
  await page.fill("#clone-text", "Hello, this is my voice.");
  await page.click("#clone-add");
  output.withoutConsent = await page.evaluate(() => window.voxgateDemo.snapshot().clone.status);
  await page.check("#clone-consent");
  await page.click("#clone-add");
  await waitFor(() => window.voxgateDemo.snapshot().clone.status.includes("added"));
  output.status = await page.evaluate(() => window.voxgateDemo.snapshot().clone.status);
  output.selected = await page.$eval("#voice", (select) => select.value);
  await page.fill("#text", "Spoken in the cloned voice.");
  await page.click("#speak");
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.outcome === "played");
  output.log = await page.evaluate(() => window.voxgateDemo.snapshot().log);
  output.played = await page.evaluate(() => window.voxgateDemo.snapshot().utterance.samples);

  // Record 4 s from the microphone instead of choosing a file (no transcript: an x-vector-only voice).
  await page.setInputFiles("#clone-file", []);
  await page.click("#clone-record");
  await waitFor(() => window.voxgateDemo.snapshot().clone.status.startsWith("recording"));
  await page.waitForTimeout(4000); // the clip's length: the gateway refuses clips under 3 s
  await page.click("#clone-record");
  await waitFor(() => window.voxgateDemo.snapshot().clone.status.startsWith("recorded"));
  await page.fill("#clone-name", `${name}-recorded`);
  await page.fill("#clone-text", "");
  await page.click("#clone-add");
  await waitFor(() => /added|: /.test(window.voxgateDemo.snapshot().clone.status));
  output.recordedStatus = await page.evaluate(() => window.voxgateDemo.snapshot().clone.status);
  output.recordedSelected = await page.$eval("#voice", (select) => select.value);
}, {}, ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]);
