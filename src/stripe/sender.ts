/**
 * One meter event on its way to Stripe, and the one interface both meter APIs sit behind:
 * v1 (`POST /v1/billing/meter_events`, one call per event, validated at once; src/stripe/client.ts)
 * and v2 (the meter event stream, batched, validated later; src/stripe/stream.ts).
 */
import { SpanKind } from '@opentelemetry/api';
import type Stripe from 'stripe';
import { endSpan, IDEMPOTENCY_KEY_ATTRIBUTE, tracer } from '../tracing.js';
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
  /**
   * Stripe's clock minus this worker's (ms), where the sender measures it (v2: by each session's
   * created time, the first session opened to measure it; rejects as a send would when none can
   * be opened). Stripe judges an event's timestamp by its own clock, and the v2 stream drops one
   * outside its window without a word: the send check reads the time as Stripe will.
   */
  clockSkewMs?(): Promise<number>;
}

/** v1: one call per event. */
export function meterEventsV1(client: Pick<Stripe, 'billing'>): MeterEventSender {
  return { api: 'v1', send: (event) => sendMeterEvent(client, event) };
}

/**
 * `sender` with each send in a client span of the event's trace (the delivery activity's span is
 * its parent): which API, the identifier, the idempotency key (`keyOf`, from the caller's context)
 * and Stripe's HTTP status, ERROR when Stripe refused or did not answer. Only when tracing is on.
 */
export function tracedSender(sender: MeterEventSender, keyOf: () => string | undefined): MeterEventSender {
  const name = sender.api === 'v1' ? 'stripe POST /v1/billing/meter_events' : 'stripe meter event stream';
  return {
    api: sender.api,
    // Read through: the stream measures it anew at each session.
    ...(sender.clockSkewMs ? { clockSkewMs: () => sender.clockSkewMs!() } : {}),
    send(event) {
      const key = keyOf();
      return tracer().startActiveSpan(
        name,
        {
          kind: SpanKind.CLIENT,
          attributes: { 'billing_outbox.stripe_identifier': event.identifier, 'billing_outbox.meter_api': sender.api, ...(key ? { [IDEMPOTENCY_KEY_ATTRIBUTE]: key } : {}) },
        },
        (span) =>
          endSpan(
            span,
            sender.send(event).then(
              // Stripe answers 200 when it takes a meter event (v1) or a stream batch (v2).
              () => void span.setAttribute('http.response.status_code', 200),
              (err: unknown) => {
                const status = (err as { statusCode?: unknown } | null)?.statusCode;
                if (typeof status === 'number') span.setAttribute('http.response.status_code', status);
                const code = (err as { code?: unknown } | null)?.code;
                if (typeof code === 'string') span.setAttribute('billing_outbox.stripe_error_code', code);
                throw err;
              },
            ),
          ),
      );
    },
  };
}
