// Loads graft serve's chat page in headless Chromium, types a message, waits for the
// streamed reply to finish, and takes a screenshot.
// Usage: node page_test.mjs URL SCREENSHOT.png   (prints {"reply": ...} as JSON)
import { chromium } from "playwright-core";

const [url, shot] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage({ viewport: { width: 900, height: 600 } });
  await page.goto(url);
  await page.fill("#input", "Hello, who are you?");
  await page.press("#input", "Enter");
  await page.waitForSelector('.msg[data-done="true"]', { timeout: 120000 });
  const reply = await page.textContent(".msg.assistant, .msg.error");
  const kind = await page.getAttribute('.msg[data-done="true"]', "class");
  await page.screenshot({ path: shot });
  console.log(JSON.stringify({ reply, kind }));
} finally {
  await browser.close();
}
