// The JavaScript README's browser example as pasted, in headless Chromium on a page of another origin than
// the gateway's (a second loopback server): click Speak, and print what the example logged, the
// input.cancel it sent and the page's failed requests, as JSON. tests/test_client_readmes.py checks them.
// Usage: node readme_browser_example.mjs <page url>

import { runBrowserCheck } from "./chromium.mjs";

const [pageUrl] = process.argv.slice(2);

await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage();
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  page.on("console", (message) => output.console.push(message.text()));
  page.on("requestfailed", (request) => output.failedRequests.push(`${request.url()}: ${request.failure()?.errorText}`));
  page.on("websocket", (socket) => socket.on("framesent", ({ payload }) => {
    if (typeof payload === "string" && payload.includes('"input.cancel"')) output.cancels.push(JSON.parse(payload));
  }));
  await page.goto(pageUrl, { waitUntil: "load" });
  await page.click("#speak");
  const done = () => ["heard:", "wav:"].every((start) => output.console.some((line) => line.startsWith(start)));
  for (let i = 0; i < 300 && !done(); i++) await page.waitForTimeout(100);
  await page.waitForTimeout(200);
}, { pageErrors: [], console: [], cancels: [], failedRequests: [] });
