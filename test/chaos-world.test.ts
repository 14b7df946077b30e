/**
 * The chaos runner counts a product process that ends by itself as a violation (a crash the other
 * processes may have covered for), and only that: the exits its own faults cause (SIGKILL, SIGTERM)
 * are not. Real processes of the product, no services needed: a worker (`src/bin/worker.ts`) given
 * a configuration it refuses exits at once with code 2; the local Stripe (`src/bin/stripe-local.ts`),
 * which needs nothing, is killed and stopped by the runner.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterEach, beforeEach, expect, it } from 'vitest';
import { ProductProcess, sleep } from '../chaos/world.js';

let dir: string;
beforeEach(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), 'chaos-world-'));
});
afterEach(async () => {
  await rm(dir, { recursive: true, force: true });
});

async function until(check: () => boolean, ms = 30_000): Promise<void> {
  await untilAsync(async () => check(), ms);
}

async function untilAsync(check: () => Promise<boolean>, ms = 30_000): Promise<void> {
  for (const end = Date.now() + ms; !(await check()); ) {
    if (Date.now() > end) throw new Error('timed out');
    await sleep(50);
  }
}

it('an exit no fault caused is recorded, with the process and its code', async () => {
  // No DATABASE_URL and a malformed one: the worker's configuration check fails and it exits 2 (a usage error).
  const worker = new ProductProcess('worker-0', 'worker.ts', () => ({ DATABASE_URL: 'not a url', TEMPORAL_ADDRESS: '' }), dir);
  worker.start();
  await until(() => !worker.running);
  await worker.close();
  expect(worker.exitsOnItsOwn).toHaveLength(1);
  expect(worker.exitsOnItsOwn[0]).toMatch(/^worker-0 exited on its own at .* \(code 2, signal null\)/);
  expect(await readFile(path.join(dir, 'worker-0.log'), 'utf8')).toMatch(/DATABASE_URL/);
});

it('the exits the runner causes (kill, stop) are not', async () => {
  // A process that stays up without any service: the local Stripe, on a port of its own.
  const stripe = new ProductProcess('stripe', 'stripe-local.ts', () => ({ LOCAL_STRIPE_PORT: '0' }), dir);
  const listening = async (times: number) => (await readFile(path.join(dir, 'stripe.log'), 'utf8').catch(() => '')).split('localStripe').length > times;
  stripe.start();
  await untilAsync(() => listening(1));
  expect(stripe.running).toBe(true);
  await stripe.kill();
  stripe.start();
  await untilAsync(() => listening(2));
  await stripe.stop();
  await stripe.close();
  expect(stripe.starts).toBe(2);
  expect(stripe.exitsOnItsOwn).toEqual([]);
});
