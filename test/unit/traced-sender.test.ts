/**
 * The span around each send to Stripe (tracedSender), for either API: its name says which, and it
 * carries the key, the identifier, the API and Stripe's answer; a refusal marks it ERROR. The
 * pipeline's traces (test/tracing.test.ts) run v1; this is the v2 stream's span too.
 */
import { SpanKind, SpanStatusCode } from '@opentelemetry/api';
import { beforeEach, describe, expect, it } from 'vitest';
import type { MeterEvent } from '../../src/stripe/meters.js';
import { tracedSender } from '../../src/stripe/sender.js';
import { IDEMPOTENCY_KEY_ATTRIBUTE } from '../../src/tracing.js';
import { useInMemoryTracing } from '../in-memory-tracing.js';

const { exporter } = useInMemoryTracing();
beforeEach(() => exporter.reset());

const event: MeterEvent = {
  eventName: 'api_requests',
  keys: { customerKey: 'stripe_customer_id', valueKey: 'value' },
  stripeCustomerId: 'cus_1',
  quantity: 3,
  identifier: 'u:acme:1',
  occurredAt: new Date('2026-12-03T12:00:00Z'),
};

describe('tracedSender', () => {
  for (const [api, name] of [
    ['v1', 'stripe POST /v1/billing/meter_events'],
    ['v2', 'stripe meter event stream'],
  ] as const) {
    it(`${api}: a client span named for the API, with the key, the identifier and Stripe's 200`, async () => {
      await tracedSender({ api, send: async () => undefined }, () => 'u:acme:1').send(event);
      const [span] = exporter.getFinishedSpans();
      expect(span).toMatchObject({ name, kind: SpanKind.CLIENT });
      expect(span!.attributes).toEqual({
        'billing_outbox.stripe_identifier': 'u:acme:1',
        'billing_outbox.meter_api': api,
        [IDEMPOTENCY_KEY_ATTRIBUTE]: 'u:acme:1',
        'http.response.status_code': 200,
      });
      expect(span!.status.code).not.toBe(SpanStatusCode.ERROR);
    });
  }

  it("v2: a refused request marks the span ERROR with Stripe's status and code, and the error goes on to the caller", async () => {
    const refused = Object.assign(new Error('Invalid customer'), { statusCode: 400, code: 'resource_missing' });
    const send = tracedSender({ api: 'v2', send: () => Promise.reject(refused) }, () => 'u:acme:2').send(event);
    await expect(send).rejects.toBe(refused);
    const [span] = exporter.getFinishedSpans();
    expect(span!.name).toBe('stripe meter event stream');
    expect(span!.attributes).toMatchObject({ 'http.response.status_code': 400, 'billing_outbox.stripe_error_code': 'resource_missing' });
    expect(span!.status).toMatchObject({ code: SpanStatusCode.ERROR, message: expect.stringContaining('Invalid customer') });
  });
});
