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
  it('down once two customers have failed within afterMs, with no answer between, for afterMs: since the first failure', () => {
    const { w, at } = watch();
    expect(w.failed('cus_a')).toBeNull();
    at(5_000);
    expect(w.failed('cus_b')).toBeNull();
    at(15_000);
    expect(w.failed('cus_a')).toBe(T);
    at(20_000);
    expect(w.failed('cus_c')).toBe(T);
  });

  it("one customer's failures are its own, however long they last", () => {
    const { w, at } = watch();
    for (let ms = 0; ms <= 120_000; ms += 10_000) {
      at(ms);
      expect(w.failed('cus_a')).toBeNull();
    }
    // Nor are failures whose customer is not known.
    expect(w.failed(null)).toBeNull();
  });

  it("a poison customer failing for an hour beside another's failure minutes ago is not an outage", () => {
    const { w, at } = watch();
    w.failed('cus_b');
    for (let ms = 60_000; ms <= 3_000_000; ms += 240_000) {
      at(ms);
      expect(w.failed('cus_poison')).toBeNull();
    }
  });

  it('an answer from Stripe ends it: the next failures start a new stretch', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    at(15_000);
    expect(w.failed('cus_b')).toBe(T);
    w.answered();
    at(21_000);
    expect(w.failed('cus_a')).toBeNull();
    at(30_000);
    expect(w.failed('cus_b')).toBeNull();
    at(36_000);
    expect(w.failed('cus_a')).toBe(T + 21_000);
  });

  it('once down, stays down through failures minutes apart (held deliveries coming back on other workers), until quietMs without one', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    at(15_000);
    expect(w.failed('cus_b')).toBe(T);
    // One customer's failure 50 minutes later, then 40 more: still the same outage.
    at(15_000 + 50 * 60_000);
    expect(w.failed('cus_a')).toBe(T);
    at(15_000 + 90 * 60_000);
    expect(w.failed('cus_a')).toBe(T);
    // Over an hour with no failure: a new stretch, judged again.
    at(15_000 + 155 * 60_000);
    expect(w.failed('cus_a')).toBeNull();
  });
});
