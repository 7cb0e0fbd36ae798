// The web demo on the default gateway (Piper, `voxgate serve`), as a new user first sees it, in headless
// Chromium: at phone width (390 px) the page is measured with Piper's long voice name in the voice select
// and its sentences in the timing table; short replies are spoken one after another, each snapshot taken
// the moment the page says "playback finished"; a sentence with words espeak runs together ("For an") is
// spoken to the end (every word must be highlighted); and the page is drawn at desktop size as README's
// picture shows it (into a file the test names; docs/web_demo_screenshot.py takes the committed one).
// tests/test_web_demo.py checks the numbers.
// Usage: node web_demo_piper.mjs <gateway base url> <screenshot dir> <README view path> <short text> <runs> <text>

import { runBrowserCheck } from "./chromium.mjs";
import { checkLayout } from "./layout.mjs";

const [baseUrl, screenshotDir, readmeView, shortText, runs, text] = process.argv.slice(2);

await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 1 });
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  const snapshot = () => page.evaluate(() => window.voxgateDemo.snapshot());
  const waitFor = (predicate, arg = null, timeout = 30000) => page.waitForFunction(predicate, arg, { timeout, polling: 10 });

  await page.goto(baseUrl + "/", { waitUntil: "load" });
  await waitFor(() => document.querySelector("#voice").options.length > 0 && window.voxgateDemo);
  output.voice = await page.$eval("#voice", (select) => select.selectedOptions[0].textContent);
  output.clone = (await snapshot()).clone;

  // Short replies: the moment the page finishes one, what had the player played of it?
  output.short = [];
  await page.fill("#text", shortText);
  for (let run = 1; run <= Number(runs); run++) {
    await page.click("#speak");
    await waitFor((id) => window.voxgateDemo.snapshot().utterance?.contextId === id && window.voxgateDemo.snapshot().utterance.outcome === "played", `utt-${run}`);
    const at = await page.evaluate(() => ({ now: performance.now(), interruptDisabled: document.querySelector("#interrupt").disabled }));
    output.short.push({ ...(await snapshot()).utterance, ...at });
  }

  // A sentence with words run together, to the end, then the page at phone width with its row.
  await page.fill("#text", text);
  await page.click("#speak");
  await waitFor((id) => window.voxgateDemo.snapshot().utterance?.contextId === id && window.voxgateDemo.snapshot().utterance.outcome === "played", `utt-${Number(runs) + 1}`);
  await page.waitForTimeout(100);
  output.words = (await snapshot()).utterance;
  output.layout = await checkLayout(page, { width: 390, height: 844, screenshot: `${screenshotDir}/web-demo-piper-390.png` });

  // The README's picture: the page's own text at desktop width, its second sentence playing; then a
  // barge-in, which tells the gateway how much was heard (Piper sends faster than real time).
  await page.setViewportSize({ width: 1280, height: 900 });
  await page.fill("#text", await page.$eval("#text", (area) => area.defaultValue.trim()));
  await page.click("#speak");
  await waitFor(() => {
    const utterance = window.voxgateDemo.snapshot().utterance;
    return utterance?.sentences.length >= 2 && utterance.sentences[1].playAt !== null;
  }, null, 60000);
  await page.waitForTimeout(1500);
  output.desktopLayout = await checkLayout(page, { width: 1280, height: 900, screenshot: `${screenshotDir}/web-demo-piper-1280.png` });
  await page.screenshot({ path: readmeView });  // README's view of the page; the test checks its size
  await page.click("#interrupt");
  await waitFor(() => window.voxgateDemo.snapshot().utterance?.heardText !== null, null, 10000);
  output.interrupted = (await snapshot()).utterance;
}, { pageErrors: [] });
