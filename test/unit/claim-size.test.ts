/**
 * How big the relay's next claim is: what its last batch's start rate starts in about
 * BATCH_TARGET_MS (or twice Temporal's round trip, when that is longer), never below one row nor
 * above the configured batch.
 */
import { describe, expect, it } from 'vitest';
import { BATCH_TARGET_MS, nextClaimLimit } from '../../activities/relay.js';

describe('nextClaimLimit', () => {
  it('keeps the whole batch while Temporal answers quickly', () => {
    // 200 starts answered in 15 ms: the next 200 would take far less than the target.
    expect(nextClaimLimit(200, 15, 200)).toBe(200);
    expect(nextClaimLimit(1, 8, 200)).toBe(25);
  });

  it('shrinks to what starts in about the target once starts slow down, and grows back', () => {
    // 25 starts took a second (a saturated server): 5 take about 200 ms.
    expect(nextClaimLimit(25, 1_000, 200)).toBe(Math.ceil((25 * BATCH_TARGET_MS) / 1_000));
    expect(nextClaimLimit(25, 1_000, 200)).toBe(5);
    // The next 5 took 100 ms: twice as many fit.
    expect(nextClaimLimit(5, 100, 200)).toBe(10);
  });

  it('keeps the whole batch for a far Temporal, whose every start takes its round trip', () => {
    // 250 ms a round trip: 200 starts answered in 260 ms are not slow starts, a smaller claim would
    // take as long. Without the round trip it would shrink to one row per round trip.
    expect(nextClaimLimit(200, 260, 200, 250)).toBe(200);
    expect(nextClaimLimit(200, 260, 200)).toBe(154);
    // Queued behind a saturated server there too: 200 starts in 2.6 s shrink to about 2 round trips' worth.
    expect(nextClaimLimit(200, 2_600, 200, 250)).toBe(39);
  });

  it('never claims nothing, however slow the last batch', () => {
    expect(nextClaimLimit(1, 60_000, 200)).toBe(1);
    expect(nextClaimLimit(3, 0, 200)).toBe(200);
  });
});
