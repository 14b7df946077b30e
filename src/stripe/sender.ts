/**
 * One meter event on its way to Stripe, and the one interface both meter APIs sit behind:
 * v1 (`POST /v1/billing/meter_events`, one call per event, validated at once; src/stripe/client.ts)
 * and v2 (the meter event stream, batched, validated later; src/stripe/stream.ts).
 */
import type Stripe from 'stripe';
import { sendMeterEvent } from './client.js';
import type { MeterEvent } from './meters.js';

export type { MeterEvent } from './meters.js';

export interface MeterEventSender {
  /**
   * `v1`: Stripe's answer is final (the row becomes `sent`), and one call at a time per customer and
   * meter (the lease). `v2`: Stripe accepted it for later validation (the row becomes `accepted`),
   * no such rule.
   */
  readonly api: 'v1' | 'v2';
  /** Resolves when Stripe took the event; rejects with Stripe's error, for the caller to classify. */
  send(event: MeterEvent): Promise<void>;
}

/** v1: one call per event. */
export function meterEventsV1(client: Pick<Stripe, 'billing'>): MeterEventSender {
  return { api: 'v1', send: (event) => sendMeterEvent(client, event) };
}
