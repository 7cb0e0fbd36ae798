// Debian's Chromium (/usr/bin/chromium) through playwright-core: no browser download.

import { chromium } from "playwright-core";

export function launchChromium() {
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
    ],
  });
}
