// The underrun counter must count: against a backend slower than real time, the demo's worklet runs
// dry inside sentences. Prints the page's snapshot as JSON. Usage: node underrun_check.mjs <url> <voice> <text>

import { runBrowserCheck } from "./chromium.mjs";

const [baseUrl, voice, text] = process.argv.slice(2);
await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage();
  page.on("pageerror", (error) => (output.pageError = String(error)));
  await page.goto(baseUrl + "/");
  await page.waitForFunction(() => document.querySelector("#voice").options.length > 0 && window.voxgateDemo);
  await page.selectOption("#voice", voice);
  await page.selectOption("#sample-rate", "24000");
  await page.selectOption("#preroll", "20");
  await page.fill("#text", text);
  await page.click("#speak");
  await page.waitForFunction(() => window.voxgateDemo.snapshot().utterance?.outcome === "played", null, {
    timeout: 30000,
    polling: 50,
  });
  await page.waitForTimeout(150);
  output.snapshot = await page.evaluate(() => window.voxgateDemo.snapshot());
}, {});
