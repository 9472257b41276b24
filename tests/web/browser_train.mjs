// Open the web demo in headless Chromium (Debian's /usr/bin/chromium, driven by puppeteer-core)
// and wait until it has trained; prints the page's result (window.__gradbuilder) as JSON and
// writes a screenshot.
//
//   node tests/web/browser_train.mjs URL SCREENSHOT.png [TIMEOUT_S]
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import puppeteer from "puppeteer-core";

const [url, screenshot, timeout = "240"] = process.argv.slice(2);
const browser = await puppeteer.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  userDataDir: await mkdtemp(join(tmpdir(), "gradbuilder-chromium-")),
  // the machine's network is closed: no background connections, no component updates
  args: ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--enable-unsafe-webgpu", "--enable-unsafe-swiftshader"],
});
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 820, height: 640 });
  const console_ = [];
  page.on("console", (m) => console_.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => console_.push(`pageerror: ${e}`));
  await page.goto(url, { waitUntil: "load" });
  await page.waitForFunction(() => window.__gradbuilder && window.__gradbuilder.done,
                             { timeout: Number(timeout) * 1000, polling: 500 });
  const result = await page.evaluate(() => window.__gradbuilder);
  await page.screenshot({ path: screenshot });
  result.console = console_.slice(-20);
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
