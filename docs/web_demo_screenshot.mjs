// README's picture of the web demo (docs/web_demo_screenshot.py runs this against a gateway it starts):
// the page's own text at desktop width, 1280 x 900, spoken by the default gateway, taken 1.5 s into its
// second sentence. Prints JSON: what the page reported (gaps, underruns, each sentence's timing).
// Usage: node docs/web_demo_screenshot.mjs <gateway base url> <png path>

import { runBrowserCheck } from "../clients/js/test/chromium.mjs";

const [baseUrl, output] = process.argv.slice(2);

await runBrowserCheck(async (browser, report) => {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 }, deviceScaleFactor: 1 });
  page.on("pageerror", (error) => report.pageErrors.push(String(error)));
  const waitFor = (predicate, timeout = 60000) => page.waitForFunction(predicate, null, { timeout, polling: 20 });
  await page.goto(baseUrl + "/", { waitUntil: "load" });
  await waitFor(() => window.voxgateDemo?.snapshot().pill === "ready" && document.querySelector("#voice").options.length > 0);
  await page.click("#speak");
  await waitFor(() => {
    const utterance = window.voxgateDemo.snapshot().utterance;
    return utterance?.sentences.length >= 2 && utterance.sentences[1].playAt !== null;
  });
  await page.waitForTimeout(1500);
  await page.screenshot({ path: output });
  const snapshot = await page.evaluate(() => window.voxgateDemo.snapshot());
  report.player = snapshot.player;
  report.sentences = snapshot.utterance.sentences;
}, { pageErrors: [] });
