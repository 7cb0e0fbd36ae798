// What the web demo tells its user, in headless Chromium (chromium.mjs): whether the gateway is ready, what
// the gateway warned about, the silences a listener hears, and that its animation keeps going whatever a
// draw throws. One scenario per run; prints JSON for tests/test_web_demo_feedback.py.
// Usage: node web_demo_feedback.mjs <scenario> <gateway base url> [args]
//   readiness <url> <file>   the gateway is still loading: record the pill, create <file> (the test's backend
//                            finishes loading when it appears), wait for the pill to say ready
//   warnings <url>           speak Chinese with the English default voice, then with a voice the list no
//                            longer has: what the page shows
//   gap <url> <text>         speak a text whose second sentence's audio comes late: the Underruns tile
//   draw <url> <text>        speak with the timeline's canvas laid out with no width, then with every
//                            roundRect call throwing: the words are highlighted to the end all the same

import { writeFileSync } from "node:fs";
import { runBrowserCheck } from "./chromium.mjs";

const [scenario, baseUrl, ...args] = process.argv.slice(2);

async function open(browser, output, { initScript = null } = {}) {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1000 }, deviceScaleFactor: 1 });
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  page.on("console", (message) => {
    if (message.type() === "error") output.consoleErrors.push(message.text());
  });
  if (initScript) await page.addInitScript(initScript);
  await page.goto(baseUrl + "/", { waitUntil: "load" });
  return page;
}

const snapshot = (page) => page.evaluate(() => window.voxgateDemo.snapshot());
const waitFor = (page, predicate, arg = null, timeout = 30000) => page.waitForFunction(predicate, arg, { timeout, polling: 50 });
const voicesLoaded = () => document.querySelector("#voice").options.length > 0 && window.voxgateDemo;

async function speakToTheEnd(page, text, contextId) {
  await page.fill("#text", text);
  await page.click("#speak");
  await waitFor(page, (id) => {
    const utterance = window.voxgateDemo.snapshot().utterance;
    return utterance?.contextId === id && utterance.outcome === "played";
  }, contextId, 60000);
  await page.waitForTimeout(150); // the worklet's last stats message
  return snapshot(page);
}

const scenarios = {
  async readiness(browser, output) {
    const [loadedFile] = args;
    const page = await open(browser, output);
    await waitFor(page, () => window.voxgateDemo?.snapshot().readiness === "starting");
    await waitFor(page, voicesLoaded);
    await page.waitForTimeout(300); // the voices' answer has landed: nothing else may claim "ready"
    output.whileLoading = await snapshot(page);
    writeFileSync(loadedFile, "");
    await waitFor(page, () => window.voxgateDemo.snapshot().pill === "ready", null, 20000);
    output.afterLoading = await snapshot(page);
  },

  async warnings(browser, output) {
    const page = await open(browser, output);
    await waitFor(page, voicesLoaded);
    output.chinese = await speakToTheEnd(page, "你好。今天天气很好。", "utt-1");
    // A voice the page's list no longer has (deleted in another tab, say): the gateway falls back.
    await page.evaluate(() => {
      const select = document.querySelector("#voice");
      select.append(new Option("gone-voice", "gone-voice"));
      select.value = "gone-voice";
    });
    output.fallback = await speakToTheEnd(page, "Hello there.", "utt-2");
    output.warningsBox = await page.$eval("#warnings", (box) => ({ hidden: box.hidden, text: box.textContent }));
  },

  async gap(browser, output) {
    const [text] = args;
    const page = await open(browser, output);
    await waitFor(page, voicesLoaded);
    await page.selectOption("#sample-rate", "24000");
    output.played = await speakToTheEnd(page, text, "utt-1");
  },

  async draw(browser, output) {
    const [text] = args;
    // 1. The timeline's canvas laid out without width: its plot is narrower than its margins.
    const narrow = await open(browser, output);
    await narrow.addStyleTag({ content: "#chart { width: 0 !important; }" });
    await waitFor(narrow, voicesLoaded);
    output.zeroWidth = await speakToTheEnd(narrow, text, "utt-1");
    output.zeroWidthErrors = { pageErrors: [...output.pageErrors], consoleErrors: [...output.consoleErrors] };
    await narrow.close();

    // 2. Any draw error: here every roundRect call throws.
    output.pageErrors.length = 0;
    output.consoleErrors.length = 0;
    const broken = await open(browser, output, {
      initScript: () => {
        CanvasRenderingContext2D.prototype.roundRect = function () {
          throw new RangeError("roundRect refused (injected by the test)");
        };
      },
    });
    await waitFor(broken, voicesLoaded);
    await broken.fill("#text", text);
    await broken.click("#speak");
    const sparkline = () => broken.$eval("#buffer-chart", (canvas) => canvas.toDataURL());
    await waitFor(broken, () => window.voxgateDemo.snapshot().player?.state === "playing");
    const first = await sparkline();
    await broken.waitForTimeout(400);
    output.sparklineMoved = (await sparkline()) !== first;
    await waitFor(broken, () => window.voxgateDemo.snapshot().utterance?.outcome === "played", null, 60000);
    await broken.waitForTimeout(150);
    output.throwing = await snapshot(broken);
  },
};

await runBrowserCheck((browser, output) => scenarios[scenario](browser, output), { pageErrors: [], consoleErrors: [] });
