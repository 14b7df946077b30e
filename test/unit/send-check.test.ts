/** "May this event be sent now?" at every edge: pure, no database, no Stripe. */
import { describe, expect, it } from 'vitest';
import { AT_STRIPE, OUTBOX_STATUSES, type OutboxStatus } from '../../src/outbox/statuses.js';
import { MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_MS } from '../../src/stripe/rules.js';
import { MAX_AHEAD_WAIT_MS, maySendNow, noMeterRefusal, PAST_SEND_MARGIN_MS, SEND_MARGIN_MS, type AttemptFound } from '../../src/stripe/send-check.js';

const NOW = Date.parse('2026-12-03T10:00:00Z');
const begun = (over: Partial<Extract<AttemptFound, { begun: true }>> = {}): AttemptFound => ({
  begun: true,
  status: 'dispatched',
  stripeCustomerId: 'cus_a',
  occurredAt: new Date(NOW - 60_000),
  ...over,
});

describe('maySendNow', () => {
  it('sends a begun, mapped, in-window event, to its customer', () => {
    expect(maySendNow(begun(), NOW)).toEqual({ verdict: 'send', stripeCustomerId: 'cus_a' });
  });

  it('a missing row: refused as missing, nothing to record it on, not counted', () => {
    expect(maySendNow({ begun: false, exists: false, key: 'u:t:1' }, NOW)).toEqual({
      verdict: 'refuse',
      refusal: { errorType: 'missing', code: 'outbox_row_missing', message: 'no outbox row with key u:t:1', record: false },
    });
  });

  it('a row not begun because its first attempt is past the safe resend window: unsafe, recorded, counted', () => {
    const first = new Date(NOW - 25 * 3_600_000);
    const v = maySendNow({ begun: false, exists: true, firstAttemptedAt: first }, NOW);
    expect(v).toMatchObject({ verdict: 'refuse', refusal: { errorType: 'unsafeToSend', code: 'identifier_window_expired', record: true, metricClass: 'unsafe' } });
    expect(v.verdict === 'refuse' && v.refusal.message).toMatch(new RegExp(`^first attempted ${first.toISOString()}, more than 23 h ago`));
    // Still failing when the window ran out: the error that kept it failing stays on the row (not the window's own, again).
    const failing = maySendNow({ begun: false, exists: true, firstAttemptedAt: first, lastError: 'http_503: Service Unavailable' }, NOW);
    expect(failing.verdict === 'refuse' && failing.refusal.message).toMatch(/retry with force\. Its last error: http_503: Service Unavailable$/);
    const again = maySendNow({ begun: false, exists: true, firstAttemptedAt: first, lastError: (v.verdict === 'refuse' && `identifier_window_expired: ${v.refusal.message}`) || '' }, NOW);
    expect(again.verdict === 'refuse' && again.refusal.message).toBe(v.verdict === 'refuse' && v.refusal.message);
  });

  it('every status at Stripe is never sent again; every other status may be', () => {
    for (const status of OUTBOX_STATUSES) {
      const atStripe = (AT_STRIPE as readonly OutboxStatus[]).includes(status);
      expect(maySendNow(begun({ status }), NOW).verdict, status).toBe(atStripe ? 'already_at_stripe' : 'send');
    }
  });

  it('being at Stripe comes before any other check (no customer, out of window)', () => {
    expect(maySendNow(begun({ status: 'sent', stripeCustomerId: null, occurredAt: new Date(0) }), NOW)).toEqual({ verdict: 'already_at_stripe' });
  });

  it('no customer mapping (null or empty): missing, recorded, not counted as a Stripe error', () => {
    for (const stripeCustomerId of [null, '']) {
      expect(maySendNow(begun({ stripeCustomerId }), NOW)).toEqual({
        verdict: 'refuse',
        refusal: { errorType: 'missing', code: 'customer_mapping_missing', message: 'the tenant has no Stripe customer mapping', record: true },
      });
    }
  });

  it("Stripe's 35-day window, as of a minute on (SEND_MARGIN_MS: when Stripe may receive it; v2 five, PAST_SEND_MARGIN_MS, a request held past its attempt included): that old is sent, a millisecond more is refused", () => {
    expect(maySendNow(begun({ occurredAt: new Date(NOW - MAX_EVENT_AGE_MS + SEND_MARGIN_MS) }), NOW).verdict).toBe('send');
    expect(maySendNow(begun({ occurredAt: new Date(NOW - MAX_EVENT_AGE_MS + PAST_SEND_MARGIN_MS) }), NOW, PAST_SEND_MARGIN_MS).verdict).toBe('send');
    expect(maySendNow(begun({ occurredAt: new Date(NOW - MAX_EVENT_AGE_MS + PAST_SEND_MARGIN_MS - 1) }), NOW, PAST_SEND_MARGIN_MS)).toMatchObject({
      verdict: 'refuse',
      refusal: { errorType: 'unsafeToSend', code: 'timestamp_too_far_in_past', record: true, metricClass: 'unsafe' },
    });
    expect(maySendNow(begun({ occurredAt: new Date(NOW - MAX_EVENT_AGE_MS + SEND_MARGIN_MS - 1) }), NOW)).toMatchObject({
      verdict: 'refuse',
      refusal: { errorType: 'unsafeToSend', code: 'timestamp_too_far_in_past', record: true, metricClass: 'unsafe' },
    });
  });

  it('5 minutes in the future less the margin is sent; beyond, by clock skew of up to an hour, waited for until it is in; beyond that refused', () => {
    const edge = NOW + MAX_EVENT_FUTURE_MS - SEND_MARGIN_MS;
    expect(maySendNow(begun({ occurredAt: new Date(edge) }), NOW).verdict).toBe('send');
    expect(maySendNow(begun({ occurredAt: new Date(edge + 1) }), NOW)).toEqual({ verdict: 'wait', waitMs: 1 });
    expect(maySendNow(begun({ occurredAt: new Date(edge + MAX_AHEAD_WAIT_MS) }), NOW)).toEqual({ verdict: 'wait', waitMs: MAX_AHEAD_WAIT_MS });
    expect(maySendNow(begun({ occurredAt: new Date(edge + MAX_AHEAD_WAIT_MS + 1) }), NOW)).toMatchObject({
      verdict: 'refuse',
      refusal: { errorType: 'unsafeToSend', code: 'timestamp_in_future', record: true, metricClass: 'unsafe' },
    });
    // Waiting never comes before the customer check.
    expect(maySendNow(begun({ stripeCustomerId: null, occurredAt: new Date(NOW + MAX_EVENT_FUTURE_MS + 1) }), NOW)).toMatchObject({ verdict: 'refuse' });
  });

  it('the customer check comes before the timestamp check', () => {
    expect(maySendNow(begun({ stripeCustomerId: null, occurredAt: new Date(0) }), NOW)).toMatchObject({ refusal: { code: 'customer_mapping_missing' } });
  });
});

describe('noMeterRefusal', () => {
  it('an event name Stripe has no active meter for: rejected, recorded, counted as rejected', () => {
    expect(noMeterRefusal('tokens')).toEqual({
      errorType: 'rejected',
      code: 'no_meter',
      message: 'Stripe has no active meter for event name "tokens": create the meter, then retry',
      record: true,
      metricClass: 'rejected',
    });
  });
});
