// Loads the web demo from a running gateway in headless Chromium (Debian's /usr/bin/chromium driven by
// playwright-core, no browser download), speaks a text, measures and screenshots the page at desktop and
// phone widths (layout.mjs), barges in on a second text and speaks a third at phone width, and prints
// what the page and its AudioWorklet reported as JSON. tests/test_web_demo.py checks the numbers.
// Usage: node web_demo_check.mjs <gateway base url> <screenshot dir> <voice> <text> <long text>

import { runBrowserCheck } from "./chromium.mjs";
import { checkLayout } from "./layout.mjs";

const [baseUrl, screenshotDir, voice, text, longText] = process.argv.slice(2);
// Desktop, a small laptop (the two-column layout at its narrowest), a phone.
const WIDTHS = [
  { width: 1280, height: 1000 },
  { width: 960, height: 800 },
  { width: 390, height: 844 },
];

await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1000 }, deviceScaleFactor: 1 });
  page.on("console", (message) => {
    if (message.type() === "error") output.consoleErrors.push(message.text());
  });
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));

  // The page's own snapshot, plus what it shows: the counter cards and the sentence table.
  const snapshot = () =>
    page.evaluate(() => ({
      ...window.voxgateDemo.snapshot(),
      counters: { received: document.querySelector("#m-received").textContent, played: document.querySelector("#m-played").textContent },
      rows: [...document.querySelectorAll("#sentence-rows tr")].map((row) => [...row.cells].map((cell) => cell.textContent)),
    }));
  const waitFor = (predicate, timeout = 30000) =>
    page.waitForFunction(predicate, null, { timeout, polling: 50 });

  const response = await page.goto(baseUrl + "/", { waitUntil: "load" });
  output.pageStatus = response.status();
  await waitFor(() => document.querySelector("#voice").options.length > 0 && window.voxgateDemo);
  output.voiceOptions = await page.$$eval("#voice option", (options) => options.map((o) => o.value));
  output.cloneOffered = await page.evaluate(() => window.voxgateDemo.snapshot().clone.offered);

  // 1. Speak a text to the end: every sample must reach the worklet and play without an underrun.
  await page.selectOption("#voice", voice);
  await page.selectOption("#format", "pcm");
  await page.selectOption("#sample-rate", "24000");
  // 100 ms of pre-roll: margin for a loaded 2-core CI machine, where the first frames of a stream can
  // be held up (the page's default is 60 ms).
  await page.selectOption("#preroll", "100");
  await page.fill("#text", text);
  await page.click("#speak");
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.outcome === "played");
  // The last stats message is posted on drain; give it a moment to land.
  await page.waitForTimeout(150);
  output.played = await snapshot();
  output.layout = {};
  for (const size of WIDTHS) {
    output.layout[size.width] = await checkLayout(page, { ...size, screenshot: `${screenshotDir}/web-demo-${size.width}.png` });
  }

  // The rest runs at phone width (the viewport is left at the last size): every click below must find
  // its control visible and unobstructed there.

  // 2. Barge in: simulate an LLM streaming a long text, interrupt once audio is playing.
  await page.click('label:has(input[name="mode"][value="llm"])');
  await page.fill("#tokens-per-second", "60");
  await page.dispatchEvent("#tokens-per-second", "input");
  await page.fill("#text", longText);
  await page.click("#speak");
  await waitFor(() => {
    const s = window.voxgateDemo.snapshot();
    return s.utterance?.contextId === "utt-2" && s.player.state === "playing" && s.utterance.sentences.length >= 2;
  });
  await page.waitForTimeout(400);
  output.beforeInterrupt = await snapshot();
  await page.click("#interrupt");
  // After the click: the worklet has dropped its queue (the page awaits its report before logging).
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.outcome === "interrupted", 5000);
  await page.waitForTimeout(100);
  output.afterInterrupt = await snapshot();
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.cancelAcknowledged, 5000);
  await page.waitForTimeout(600);
  output.later = await snapshot();
  output.layoutInterrupted = await checkLayout(page, { width: 390, height: 844, screenshot: `${screenshotDir}/web-demo-interrupted-390.png` });

  // 3. The session stays usable after the barge-in: a short utterance plays to the end.
  await page.click('label:has(input[name="mode"][value="text"])');
  await page.fill("#text", "And we are back.");
  await page.click("#speak");
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.outcome === "played");
  await page.waitForTimeout(150);
  output.afterBargeIn = await snapshot();

  // 4. Telephony format: mu-law at 8 kHz (a new session), decoded and resampled in the browser.
  await page.selectOption("#format", "mulaw");
  await page.selectOption("#sample-rate", "8000");
  await page.fill("#text", "Now in mu-law, at eight kilohertz.");
  await page.click("#speak");
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.contextId === "utt-4" && window.voxgateDemo.snapshot().utterance.outcome === "played");
  await page.waitForTimeout(150);
  output.mulaw = await snapshot();
}, { consoleErrors: [], pageErrors: [] });
