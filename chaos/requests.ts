import type { RequestRecord, StreamRequestRecord } from '../src/embedded/stripe/types.js';

/**
 * What the run cost Stripe in requests: v1 meter-event calls, or v2 stream requests (every one
 * that reached it, refused ones included), per event Stripe recorded. The v2 figure is the
 * batcher's under faults (the aim: ≤ 0.2 per event).
 */
export interface StripeRequestCount {
  api: 'v1' | 'v2';
  requests: number;
  /** Of them, answered with anything but a 200 (or never answered). */
  failed: number;
  recorded: number;
  perEvent: number;
}

export function countStripeRequests(stripe: { requests(): RequestRecord[]; streamRequests(): StreamRequestRecord[] }, api: 'v1' | 'v2', recorded: number): StripeRequestCount {
  const log = api === 'v2' ? stripe.streamRequests() : stripe.requests();
  const failed = log.filter((r) => r.status !== 200 || r.dropped).length;
  return { api, requests: log.length, failed, recorded, perEvent: recorded > 0 ? Math.round((log.length / recorded) * 1000) / 1000 : 0 };
}
