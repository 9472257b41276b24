// Open a page that trains (the web demo, a tutorial's page) in headless Chromium (Debian's
// /usr/bin/chromium, driven by puppeteer-core) and wait until it has trained: until the global
// RESULT (default __gradbuilder, the demo's) is set and not marked done: false. Prints it as
// JSON, with the page's last console lines, and writes a screenshot.
//
//   node tests/web/browser_train.mjs URL SCREENSHOT.png [TIMEOUT_S] [RESULT]
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import puppeteer from "puppeteer-core";

const [url, screenshot, timeout = "240", global = "__gradbuilder"] = process.argv.slice(2);
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
  await page.waitForFunction((name) => window[name] && window[name].done !== false,
                             { timeout: Number(timeout) * 1000, polling: 500 }, global);
  const result = await page.evaluate((name) => window[name], global);
  await page.screenshot({ path: screenshot });
  result.console = console_.slice(-20);
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
