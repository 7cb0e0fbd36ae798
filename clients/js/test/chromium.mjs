// Debian's Chromium (/usr/bin/chromium) through playwright-core: no browser download.

import { chromium } from "playwright-core";

function launchChromium(extraArgs = []) {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox", // CI runs as root
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      // Without these, Chromium keeps dialing Google's hosts, which this network refuses.
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      // Let the AudioContext start without a user gesture; headless Chromium plays into a fake output.
      "--autoplay-policy=no-user-gesture-required",
      ...extraArgs,
    ],
  });
}

/**
 * Run `check(browser, output)` in a fresh Chromium, then print `output` as JSON: with `failure` (and a
 * non-zero exit status) when the check threw, so the Python side sees what got done before it failed.
 */
export async function runBrowserCheck(check, output = {}, extraArgs = []) {
  const browser = await launchChromium(extraArgs);
  try {
    await check(browser, output);
  } catch (error) {
    output.failure = String(error.stack || error);
    process.exitCode = 1;
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(output));
}
