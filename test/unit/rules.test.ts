/** Stripe's rules and windows, pure: each limit at its edge, with an injected clock. */
import { describe, expect, it } from 'vitest';
import * as rules from '../../src/stripe/rules.js';
import { AT_STRIPE, AWAITING_RELAY, DELIVERED, IN_FLIGHT, isOutboxStatus, OUTBOX_STATUSES, UNBILLED, UNSETTLED } from '../../src/outbox/statuses.js';

const NOW = Date.parse('2026-12-02T12:00:00Z');
const HOUR = 3_600_000;
const DAY = 24 * HOUR;

describe("Stripe's limits", () => {
  it('are the documented figures', () => {
    expect(rules.MAX_IDENTIFIER_LENGTH).toBe(100);
    expect(rules.MAX_EVENT_NAME_LENGTH).toBe(100);
    expect(rules.MAX_VALUE).toBe(999_999_999_999_999);
    expect(rules.MAX_EVENT_AGE_MS).toBe(35 * DAY);
    expect(rules.MAX_EVENT_FUTURE_MS).toBe(5 * 60_000);
    expect(rules.IDENTIFIER_WINDOW_MS).toBe(DAY);
    expect(rules.SAFE_RESEND_WINDOW_MS).toBe(23 * HOUR);
    expect(rules.CANCEL_WINDOW_MS).toBe(DAY);
    expect([rules.LIVE_CALLS_PER_SECOND, rules.TEST_CALLS_PER_SECOND, rules.DEFAULT_LIVE_RATE, rules.DEFAULT_TEST_RATE]).toEqual([1000, 25, 900, 20]);
    expect(rules.DEFAULT_LIVE_RATE).toBeLessThan(rules.LIVE_CALLS_PER_SECOND);
    expect(rules.DEFAULT_TEST_RATE).toBeLessThan(rules.TEST_CALLS_PER_SECOND);
    expect(rules.CONCURRENT_CALLS_PER_CUSTOMER_METER).toBe(1);
    expect([rules.MAX_STREAM_BATCH, rules.STREAM_SESSION_TTL_MS, rules.STREAM_DEDUP_WINDOW_MS, rules.MAX_IDEMPOTENCY_KEY_LENGTH]).toEqual([100, 15 * 60_000, DAY, 255]);
    expect(rules.WINDOW_MARGIN_MS).toBe(HOUR);
    expect(rules.inHours(rules.SAFE_RESEND_WINDOW_MS)).toBe(23);
  });

  it('timestampProblem: 35 days back and 5 minutes ahead, inclusive', () => {
    const at = (ms: number) => rules.timestampProblem(new Date(NOW + ms), NOW);
    expect(at(0)).toBeUndefined();
    expect(at(-35 * DAY)).toBeUndefined();
    expect(at(-35 * DAY - 1)).toEqual({
      code: 'timestamp_too_far_in_past',
      message: "usage from 2026-10-28T11:59:59.999Z is older than Stripe's 35-day window and cannot be reported",
    });
    expect(at(5 * 60_000)).toBeUndefined();
    expect(at(5 * 60_000 + 1)).toEqual({ code: 'timestamp_in_future', message: expect.stringMatching(/^usage stamped 2026-12-02T12:05:00.001Z is more than 5 minutes ahead of this worker's clock .*a clock is wrong .*fix it, then retry once the usage is within the hour$/) });
  });

  it('tooOldToSend: an hour short of the 35 days, so a call begun now still lands inside them', () => {
    expect(rules.tooOldToSend(new Date(NOW - (35 * DAY - HOUR)), NOW)).toBe(false);
    expect(rules.tooOldToSend(new Date(NOW - (35 * DAY - HOUR) - 1), NOW)).toBe(true);
    expect(rules.tooOldToSend(new Date(NOW), NOW)).toBe(false);
  });
});

describe('the statuses', () => {
  it('each group is made of known statuses, and the groups say what they mean', () => {
    for (const group of [AWAITING_RELAY, IN_FLIGHT, DELIVERED, AT_STRIPE, UNSETTLED, UNBILLED]) {
      for (const s of group) expect(isOutboxStatus(s), s).toBe(true);
    }
    expect(OUTBOX_STATUSES).toEqual(['pending', 'claimed', 'dispatched', 'sent', 'accepted', 'dead', 'rejected_async', 'cancelled']);
    expect([...AWAITING_RELAY]).toEqual(['pending', 'claimed']);
    expect([...IN_FLIGHT]).toEqual(['claimed', 'dispatched']);
    expect([...DELIVERED]).toEqual(['sent', 'accepted']);
    expect([...AT_STRIPE]).toEqual(['sent', 'accepted', 'rejected_async', 'cancelled']);
    expect([...UNSETTLED]).toEqual(['pending', 'claimed', 'dispatched', 'dead']);
    expect([...UNBILLED]).toEqual(['rejected_async', 'cancelled']);
    // Settled or not: every status is exactly one of delivered, unbilled, unsettled.
    for (const s of OUTBOX_STATUSES) {
      const groups = [DELIVERED, UNBILLED, UNSETTLED].filter((g) => (g as readonly string[]).includes(s));
      expect(groups, s).toHaveLength(1);
    }
  });
  it('isOutboxStatus refuses anything else', () => {
    for (const s of ['', 'SENT', 'sent ', 'failed', 'retrying']) expect(isOutboxStatus(s), s).toBe(false);
  });
});
