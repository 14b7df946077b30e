/**
 * For the tests of the local Stripe server itself (embedded-stripe*.test.ts): servers started in a
 * test are closed after it, with whatever else the test registered in `cleanups`, and a client is
 * built as the pipeline builds one (a custom host, which also replaces the meter-events host).
 */
import Stripe from 'stripe';
import { afterEach } from 'vitest';
import { LocalStripe, type LocalStripeOptions } from '../src/embedded/stripe/server.js';

export const MINUTE = 60 * 1000;
export const HOUR = 60 * MINUTE;
export const DAY = 24 * HOUR;
export const CUSTOMER = 'cus_test_1';
export const METER_EVENT = 'api_requests';
/** A fixed "now" on a minute boundary, so summaries are predictable. */
export const T0 = Date.parse('2026-03-10T12:00:00Z');

const started: LocalStripe[] = [];
/** Run after each test, after its servers are closed. */
export const cleanups: (() => Promise<void>)[] = [];

afterEach(async () => {
  await Promise.all(started.splice(0).map((server) => server.close()));
  for (const cleanup of cleanups.splice(0)) await cleanup();
});

export async function startStripe(opts: LocalStripeOptions = {}): Promise<LocalStripe> {
  const server = await LocalStripe.start({ customers: [CUSTOMER], ...opts });
  started.push(server);
  return server;
}

export function clientFor(server: LocalStripe, key = 'sk_test_local'): Stripe {
  return new Stripe(key, { host: '127.0.0.1', port: server.port, protocol: 'http', maxNetworkRetries: 0 });
}
