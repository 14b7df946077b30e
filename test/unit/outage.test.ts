/** When a worker takes Stripe for down (src/stripe/outage.ts), on a clock of the test's own. */
import { describe, expect, it } from 'vitest';
import { outageWatch } from '../../src/stripe/outage.js';

const T = 1_000_000;

function watch() {
  let now = T;
  const w = outageWatch({ afterMs: 15_000, quietMs: 3_600_000, now: () => now });
  return { w, at: (ms: number) => (now = T + ms) };
}

describe('outageWatch', () => {
  it('down once two customers have kept failing (each twice and more, within windowMs), with no answer between, for afterMs: since the second of them began', () => {
    const { w, at } = watch();
    expect(w.failed('cus_a')).toBeNull();
    at(2_000);
    expect(w.failed('cus_b')).toBeNull();
    at(6_000);
    expect(w.failed('cus_a')).toBeNull();
    at(8_000);
    expect(w.failed('cus_b')).toBeNull();
    // Both have kept failing, for 14 s (since cus_b's first).
    at(16_000);
    expect(w.failed('cus_a')).toBeNull();
    at(17_000);
    expect(w.failed('cus_b')).toBe(T + 2_000);
    at(20_000);
    expect(w.failed('cus_c')).toBe(T + 2_000);
  });

  it('no answer at all (calls timing out, the lease held after each): one failure per customer every minute is enough', () => {
    const { w, at } = watch();
    at(20_000);
    expect(w.failed('cus_a')).toBeNull();
    expect(w.failed('cus_b')).toBeNull();
    at(71_000);
    expect(w.failed('cus_a')).toBeNull();
    expect(w.failed('cus_b')).toBe(T + 20_000);
  });

  it("one customer's failures are its own, however long they last", () => {
    const { w, at } = watch();
    for (let ms = 0; ms <= 120_000; ms += 10_000) {
      at(ms);
      expect(w.failed('cus_a')).toBeNull();
    }
    // Nor are failures whose customer is not known.
    expect(w.failed(null)).toBeNull();
    expect(w.failed(null)).toBeNull();
  });

  it("a poison customer failing for an hour beside another's stray failures (one, or two more than windowMs apart) is not an outage", () => {
    const { w, at } = watch();
    w.failed('cus_b');
    for (let ms = 60_000; ms <= 3_000_000; ms += 60_000) {
      at(ms);
      expect(w.failed('cus_poison')).toBeNull();
      // Another customer's single failure deep into the poison's stretch, and one 3 minutes later.
      if (ms === 840_000 || ms === 1_020_000) expect(w.failed('cus_c')).toBeNull();
    }
    // Two of another's 5 s apart: the two have kept failing for 5 s, not the poison's hour.
    expect(w.failed('cus_d')).toBeNull();
    at(3_005_000);
    expect(w.failed('cus_d')).toBeNull();
  });

  it('an answer from Stripe ends it: the next failures are judged afresh', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    w.failed('cus_b');
    at(15_000);
    w.failed('cus_a');
    expect(w.failed('cus_b')).toBe(T);
    w.answered();
    expect(w.downSince()).toBeNull();
    at(21_000);
    expect(w.failed('cus_a')).toBeNull();
    expect(w.failed('cus_b')).toBeNull();
    at(30_000);
    expect(w.failed('cus_a')).toBeNull();
    at(36_000);
    expect(w.failed('cus_b')).toBe(T + 21_000);
  });

  it('once down, stays down through failures minutes apart (held deliveries coming back on other workers), until quietMs without one', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    w.failed('cus_b');
    at(15_000);
    w.failed('cus_a');
    expect(w.downSince()).toBeNull();
    expect(w.failed('cus_b')).toBe(T);
    expect(w.downSince()).toBe(T);
    // One customer's failure 50 minutes later, then 40 more: still the same outage.
    at(15_000 + 50 * 60_000);
    expect(w.failed('cus_a')).toBe(T);
    at(15_000 + 90 * 60_000);
    expect(w.failed('cus_a')).toBe(T);
    // Over an hour with no failure: over, as read (a worker whose calls stopped) and when judged again.
    at(15_000 + 150 * 60_000);
    expect(w.downSince()).toBe(T);
    at(15_000 + 155 * 60_000);
    expect(w.downSince()).toBeNull();
    expect(w.failed('cus_a')).toBeNull();
    expect(w.failed('cus_b')).toBeNull();
  });
});
