// The JavaScript README's browser example as pasted, in headless Chromium on a page of the gateway's origin
// (the page at `/`, its body replaced by the example's HTML): click Speak, and print what the example
// logged and the input.cancel it sent, as JSON. tests/test_client_readmes.py checks them.
// Usage: node readme_browser_example.mjs <gateway base url> <example html file>

import { readFileSync } from "node:fs";
import { runBrowserCheck } from "./chromium.mjs";

const [baseUrl, htmlFile] = process.argv.slice(2);

await runBrowserCheck(async (browser, output) => {
  const page = await browser.newPage();
  page.on("pageerror", (error) => output.pageErrors.push(String(error)));
  page.on("console", (message) => output.console.push(message.text()));
  page.on("websocket", (socket) => socket.on("framesent", ({ payload }) => {
    if (typeof payload === "string" && payload.includes('"input.cancel"')) output.cancels.push(JSON.parse(payload));
  }));
  await page.goto(baseUrl + "/", { waitUntil: "load" });
  await page.setContent(readFileSync(htmlFile, "utf8"), { waitUntil: "load" });
  await page.click("#speak");
  for (let i = 0; i < 300 && !output.console.some((line) => line.startsWith("heard:")); i++) await page.waitForTimeout(100);
  await page.waitForTimeout(200);
}, { pageErrors: [], console: [], cancels: [] });
