/** When a worker takes Stripe for down (src/stripe/outage.ts), on a clock of the test's own. */
import { describe, expect, it } from 'vitest';
import { outageWatch } from '../../src/stripe/outage.js';

function watch() {
  let now = 1_000_000;
  const w = outageWatch({ afterMs: 15_000, gapMs: 600_000, now: () => now });
  return { w, at: (ms: number) => (now = 1_000_000 + ms) };
}

describe('outageWatch', () => {
  it('down once two customers have failed, with no answer between, for afterMs: since the first failure', () => {
    const { w, at } = watch();
    expect(w.failed('cus_a')).toBeNull();
    at(5_000);
    expect(w.failed('cus_b')).toBeNull();
    at(15_000);
    expect(w.failed('cus_a')).toBe(1_000_000);
    at(20_000);
    expect(w.failed('cus_c')).toBe(1_000_000);
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

  it('an answer from Stripe ends it: the next failures start a new stretch', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    at(20_000);
    expect(w.failed('cus_b')).toBe(1_000_000);
    w.answered();
    at(21_000);
    expect(w.failed('cus_a')).toBeNull();
    at(30_000);
    expect(w.failed('cus_b')).toBeNull();
    at(36_000);
    expect(w.failed('cus_a')).toBe(1_021_000);
  });

  it('a failure more than gapMs after the one before starts a new stretch: two poison events an hour apart are not an outage', () => {
    const { w, at } = watch();
    w.failed('cus_a');
    at(3_600_000);
    expect(w.failed('cus_b')).toBeNull();
    // Within the gap, the stretch goes on across quiet minutes (deliveries held by it come back every few).
    at(3_900_000);
    expect(w.failed('cus_a')).toBe(1_000_000 + 3_600_000);
  });
});
