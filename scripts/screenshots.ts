/// <reference lib="dom" />
/**
 * The browser half of `npm run screenshots` (scripts/screenshots.sh starts the stack and makes the
 * events): opens the Temporal Web UI in headless Chromium (puppeteer-core, the system's Chromium,
 * nothing downloaded) and saves what an operator sees. Each page is taken once the text that
 * matters is on it, not after a fixed time.
 *
 *   tsx scripts/screenshots.ts <chromium> <web ui url> <namespace> <dead letter key> <out dir>
 */
import path from 'node:path';
import puppeteer from 'puppeteer-core';
import { LIST_QUERIES } from '../src/temporal/web-ui.js';

const [executablePath, ui, namespace, deadKey, outDir] = process.argv.slice(2);
if (!executablePath || !ui || !namespace || !deadKey || !outDir) {
  console.error('usage: tsx scripts/screenshots.ts <chromium> <web ui url> <namespace> <dead letter key> <out dir>');
  process.exit(2);
}

const base = `${ui.replace(/\/+$/, '')}/namespaces/${encodeURIComponent(namespace)}/workflows`;
const browser = await puppeteer.launch({
  executablePath,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--hide-scrollbars'],
  defaultViewport: { width: 1600, height: 1000 },
});
try {
  const page = await browser.newPage();
  const shot = async (file: string, url: string, ...texts: string[]) => {
    await page.goto(url, { waitUntil: 'domcontentloaded', timeout: 30_000 });
    await page.waitForFunction((want: string[]) => want.every((t) => document.body.innerText.includes(t)), { timeout: 30_000 }, texts);
    // The text is there; the badges and icons around it render in the next frames.
    await new Promise((resolve) => setTimeout(resolve, 1_000));
    await page.screenshot({ path: path.join(outDir, file) });
    console.log(`screenshots: ${path.join(outDir, file)}`);
  };
  await shot('web-ui-list.png', `${base}?query=${encodeURIComponent('WorkflowType="usageWorkflow"')}`, deadKey);
  await shot('web-ui-dead-letters.png', `${base}?query=${encodeURIComponent(LIST_QUERIES.dead)}`, deadKey);
  // A workflow's page: its summary and current details are under the "User Metadata" tab.
  await page.goto(`${base}/${encodeURIComponent(deadKey)}`, { waitUntil: 'domcontentloaded', timeout: 30_000 });
  await page.waitForFunction((key: string) => document.body.innerText.includes(key), { timeout: 30_000 }, deadKey);
  const clicked = await page.evaluate(() => {
    const tab = Array.from(document.querySelectorAll('a, button, [role="tab"]')).find((e) => (e as HTMLElement).innerText.trim() === 'User Metadata');
    (tab as HTMLElement | undefined)?.click();
    return Boolean(tab);
  });
  if (!clicked) throw new Error('no "User Metadata" tab on the workflow page (another Web UI version?)');
  // The current details come from a query to the workflow, which the tab runs on R ("refresh").
  await new Promise((resolve) => setTimeout(resolve, 500));
  await page.keyboard.press('r');
  // The summary and details are rendered as Markdown in frames of their own.
  const until = Date.now() + 30_000;
  for (;;) {
    const texts = await Promise.all(page.frames().map((f) => f.evaluate(() => document.body?.innerText ?? '').catch(() => '')));
    if (texts.some((t) => t.includes('Dead letter'))) break;
    if (Date.now() > until) throw new Error("the dead letter's current details never appeared (is a worker running to answer the query?)");
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
  await new Promise((resolve) => setTimeout(resolve, 1_000));
  await page.screenshot({ path: path.join(outDir, 'web-ui-dead-letter.png') });
  console.log(`screenshots: ${path.join(outDir, 'web-ui-dead-letter.png')}`);
} finally {
  await browser.close();
}
