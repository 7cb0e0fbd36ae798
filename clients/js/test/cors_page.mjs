// A page of another origin than the gateway's, in headless Chromium: open it, wait for the result it puts
// in `window.corsResult`, and print that, the page's console and its failed requests, as JSON.
// tests/test_cors.py writes the pages and checks what they got.
// Usage: node cors_page.mjs <page url>

import { runBrowserCheck } from "./chromium.mjs";

const [pageUrl] = process.argv.slice(2);

await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage();
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  page.on("console", (message) => output.console.push(message.text()));
  page.on("requestfailed", (request) => output.failedRequests.push(request.url()));
  await page.goto(pageUrl, { waitUntil: "load" });
  await page.waitForFunction(() => window.corsResult !== undefined, null, { timeout: 60000 });
  output.result = await page.evaluate(() => window.corsResult);
}, { pageErrors: [], console: [], failedRequests: [] });
