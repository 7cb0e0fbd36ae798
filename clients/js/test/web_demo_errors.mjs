// The web demo's errors, as a user on a phone (390 px) meets them, in headless Chromium (chromium.mjs):
//   unreachable  the page talks to a gateway where nothing listens (?gateway=), on load and on Speak;
//   auth         the gateway wants an API key: the page asks for it, Speak is refused too, a wrong key is
//                refused, the right one (typed, then Enter) loads the voices and speaks what was refused;
//   empty        Speak with no text.
// Each step records the page's snapshot and a layout report (layout.mjs: is the notice in view?) and saves
// a screenshot. Prints JSON for tests/test_web_demo.py.
// Usage: node web_demo_errors.mjs <page url> <dead gateway url> <screenshot dir> <api key>

import { runBrowserCheck } from "./chromium.mjs";
import { checkView } from "./layout.mjs";

const [pageUrl, deadGateway, screenshotDir, apiKey] = process.argv.slice(2);
const PHONE = { width: 390, height: 844 };

await runBrowserCheck(async (browser, output) => {
  const open = async () => {
    const page = await browser.newPage({ viewport: PHONE, deviceScaleFactor: 1 });
    page.on("pageerror", (error) => output.pageErrors.push(String(error)));
    return page;
  };
  const snapshot = (page) => page.evaluate(() => window.voxgateDemo.snapshot());
  const waitFor = (page, predicate, arg) => page.waitForFunction(predicate, arg, { timeout: 20000, polling: 50 });
  const noticeIs = (kind) => window.voxgateDemo?.snapshot().notice?.kind === kind;
  const step = async (page, name) => ({
    snapshot: await snapshot(page),
    layout: await checkView(page, { screenshot: `${screenshotDir}/web-demo-${name}-390.png` }),
  });

  // 1. Nothing listens at the gateway the page is pointed at.
  const dead = await open();
  await dead.goto(`${pageUrl}/?gateway=${encodeURIComponent(deadGateway)}`);
  await waitFor(dead, noticeIs, "unreachable");
  output.unreachableOnLoad = await step(dead, "unreachable");
  await dead.click("#speak");
  await waitFor(dead, () => window.voxgateDemo.snapshot().log.some((line) => line.includes("speak:")));
  output.unreachableOnSpeak = await step(dead, "unreachable-speak");
  await dead.close();

  // 2. The gateway wants a key; the page has none.
  const page = await open();
  await page.goto(`${pageUrl}/`);
  await waitFor(page, noticeIs, "auth");
  output.authOnLoad = await step(page, "auth");
  // Speak anyway: the WebSocket is refused (unauthorized) and the page keeps asking.
  await page.fill("#text", "Spoken once the key is given.");
  await page.click("#speak");
  await waitFor(page, () => window.voxgateDemo.snapshot().log.some((line) => line.includes("speak:")));
  output.authOnSpeak = await step(page, "auth-speak");
  // A wrong key, then Enter: refused, and said so.
  await page.fill("#api-key", "not-the-key");
  await page.press("#api-key", "Enter");
  await waitFor(page, () => window.voxgateDemo.snapshot().notice?.text.includes("refused this API key"));
  output.wrongKey = await step(page, "wrong-key");
  // The right key, then Enter: the voices load and the refused Speak goes ahead by itself.
  await page.fill("#api-key", apiKey);
  await page.press("#api-key", "Enter");
  await waitFor(page, () => window.voxgateDemo.snapshot().utterance?.outcome === "played");
  output.rightKey = await step(page, "right-key");
  output.voiceOptions = await page.$$eval("#voice option", (options) => options.map((o) => o.value));

  // 3. Speak with no text.
  await page.fill("#text", "   ");
  await page.click("#speak");
  await waitFor(page, noticeIs, "empty");
  output.empty = await step(page, "empty");
  output.empty.textInvalid = await page.getAttribute("#text", "aria-invalid");
  // Typing clears it.
  await page.fill("#text", "Some text.");
  await waitFor(page, () => window.voxgateDemo.snapshot().notice === null);
  output.afterTyping = await snapshot(page);
}, { pageErrors: [] });
