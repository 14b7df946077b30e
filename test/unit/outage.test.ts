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
  it('down once three customers have failed within windowMs, with no answer between, for afterMs beside the one failing most: since then', () => {
    const { w, at } = watch();
    expect(w.failed('cus_a')).toBeNull();
    at(2_000);
    expect(w.failed('cus_b')).toBeNull();
    // Three customers, but for 5 s only.
    at(5_000);
    expect(w.failed('cus_c')).toBeNull();
    // cus_a fails most; the others began failing 13 s ago.
    at(15_000);
    expect(w.failed('cus_a')).toBeNull();
    at(17_000);
    expect(w.failed('cus_d')).toBe(T + 2_000);
    expect(w.downSince()).toBe(T + 2_000);
    at(20_000);
    expect(w.failed('cus_e')).toBe(T + 2_000);
  });

  it("many customers in turn, each failing once (as each of several workers sees them, or the v2 batcher's turns): down after afterMs", () => {
    const { w, at } = watch();
    let down: number | null = null;
    let ms = 0;
    for (let i = 0; down === null && ms < 60_000; i++, ms += 150) {
      at(ms);
      down = w.failed(`cus_${i % 200}`);
    }
    expect(down).toBeLessThanOrEqual(T + 300);
    expect(ms).toBeLessThan(16_000);
  });

  it('two customers only, no answer at all (calls timing out, the lease held after each): down once each has failed twice', () => {
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

  it("a poison customer failing for an hour beside another's stray failures (one, or two more than windowMs apart, or two in one failed request) is not an outage", () => {
    const { w, at } = watch();
    w.failed('cus_b');
    for (let ms = 60_000; ms <= 3_000_000; ms += 60_000) {
      at(ms);
      expect(w.failed('cus_poison')).toBeNull();
      // Another customer's single failure deep into the poison's stretch, and one 3 minutes later.
      if (ms === 840_000 || ms === 1_020_000) expect(w.failed('cus_c')).toBeNull();
    }
    // Two events of another customer in one failed request: one failure.
    expect(w.failed('cus_d')).toBeNull();
    at(3_000_200);
    expect(w.failed('cus_d')).toBeNull();
    // That customer failing again seconds later (a blip): not for afterMs yet.
    at(3_010_000);
    expect(w.failed('cus_d')).toBeNull();
    // Failing on past afterMs beside the poison: down, since it began.
    at(3_016_000);
    expect(w.failed('cus_d')).toBe(T + 3_000_000);
  });

  it('two events of one customer in one failed v2 request are one failure, not a customer failing twice', () => {
    const { w, at } = watch();
    for (const ms of [0, 60_000, 120_000]) {
      at(ms);
      expect(w.failed('cus_poison')).toBeNull();
    }
    expect(w.failed('cus_d')).toBeNull();
    at(120_200);
    expect(w.failed('cus_d')).toBeNull();
    at(180_000);
    expect(w.failed('cus_poison')).toBeNull();
  });

  it('an answer from Stripe ends it: the next failures are judged afresh', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    w.failed('cus_b');
    w.failed('cus_c');
    at(15_000);
    expect(w.failed('cus_a')).toBe(T);
    w.answered();
    expect(w.downSince()).toBeNull();
    at(21_000);
    expect(w.failed('cus_a')).toBeNull();
    expect(w.failed('cus_b')).toBeNull();
    expect(w.failed('cus_c')).toBeNull();
    at(36_000);
    expect(w.failed('cus_b')).toBe(T + 21_000);
  });

  it('once down, stays down through failures minutes apart (held deliveries coming back on other workers), until quietMs without one', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    w.failed('cus_b');
    at(15_000);
    expect(w.downSince()).toBeNull();
    expect(w.failed('cus_c')).toBe(T);
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
