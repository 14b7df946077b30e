/**
 * The lane window (src/outbox/lane-window.ts): busy lanes are held back only while quiet lanes are
 * being served and Temporal is slow to start workflows; otherwise each lane keeps LANE_MAX_IN_FLIGHT.
 */
import { describe, expect, it } from 'vitest';
import { CONGESTED_START_MS, FASTEST_KEPT_MS, GROW_EVERY_MS, LaneWindow, MAX_PAUSE_MS, PAUSE_STEP_MS, QUIET_LANE_SEEN_MS, laneWindowFloor } from '../../src/outbox/lane-window.js';

const quick = 5;
const slow = 300;

/** A flood beside quiet tenants: every batch takes a quiet lane's row and holds the busy lane back. */
const flood = { tenantId: 'flood', eventName: 'api_requests' };
const mixed = (startMs: number) => ({ quiet: true, held: [flood], startMs });

describe('LaneWindow', () => {
  it('keeps the whole lane for a big customer alone, however slow the starts', () => {
    const w = new LaneWindow(100);
    for (let t = 0; t < 10_000; t += 100) expect(w.afterBatch({ quiet: false, held: [flood], startMs: slow }, t)).toBe(100);
  });

  it('keeps the whole lane while only quiet tenants are served', () => {
    const w = new LaneWindow(100);
    w.afterBatch({ quiet: false, held: [], startMs: quick }, 0);
    // Quiet lanes being served start the window from its floor: nothing busy has earned more.
    expect(w.afterBatch({ quiet: true, held: [], startMs: quick }, 10)).toBe(10);
    // Nobody fills it, so it does not grow…
    for (let t = 20; t < 5_000; t += 100) expect(w.afterBatch({ quiet: true, held: [], startMs: quick }, t)).toBe(10);
    // …and once no quiet lane has been served for a while, the lanes are whole again.
    expect(w.afterBatch({ quiet: false, held: [flood], startMs: slow }, 4_920 + QUIET_LANE_SEEN_MS)).toBe(100);
  });

  it('halves to its floor while a flood slows Temporal beside quiet tenants', () => {
    const w = new LaneWindow(100);
    w.afterBatch({ quiet: false, held: [flood], startMs: quick }, 0);
    expect(w.size).toBe(100);
    // The others' new events: quiet lanes are served, starts are slow.
    expect(w.afterBatch({ quiet: false, held: [flood], startMs: slow }, 100)).toBe(100);
    expect(w.afterBatch({ quiet: true, held: [flood], startMs: slow }, 200)).toBe(10);
  });

  it('halves while congested and grows by its floor at most once a GROW_EVERY_MS while quick', () => {
    const w = new LaneWindow(100);
    expect(w.afterBatch(mixed(quick), 0)).toBe(10);
    // Quick starts with a busy lane held back, a batch every 100 ms: one step of growth a period.
    const sizes = [];
    for (let t = 100; t <= 3 * GROW_EVERY_MS; t += 100) sizes.push(w.afterBatch(mixed(quick), t));
    expect(sizes.slice(0, 9)).toEqual(Array(9).fill(10));
    expect(sizes.slice(9, 19)).toEqual(Array(10).fill(20));
    expect(sizes.at(-1)).toBe(40);
    // Congested: halves at once, on every slow batch, never below the floor.
    expect(w.afterBatch(mixed(slow), 3_010)).toBe(20);
    expect(w.afterBatch(mixed(slow), 3_020)).toBe(10);
    expect(w.pauseMs).toBe(0);
    // Still slow at the floor: the busy lane pauses after each claim, the pause doubling to its cap.
    expect(w.afterBatch(mixed(slow), 3_030)).toBe(10);
    expect(w.pauseMs).toBe(PAUSE_STEP_MS);
    expect(w.paused(3_030 + PAUSE_STEP_MS - 1)).toEqual([flood]);
    expect(w.paused(3_030 + PAUSE_STEP_MS)).toEqual([]);
    for (let i = 0; i < 10; i++) w.afterBatch(mixed(slow), 3_040 + i);
    expect(w.pauseMs).toBe(MAX_PAUSE_MS);
    expect(w.paused(3_049 + MAX_PAUSE_MS - 1)).toEqual([flood]);
    // Quick again: no change within a period of the last slow batch, then the pause halves away a
    // step a period, then the window grows.
    for (let t = 3_100; t < 4_049; t += 100) w.afterBatch(mixed(quick), t);
    expect(w.pauseMs).toBe(MAX_PAUSE_MS);
    const steps: [number, number, number][] = [];
    for (let t = 4_049; t <= 10_049; t += 100) {
      w.afterBatch(mixed(quick), t);
      if (steps.at(-1)?.[1] !== w.pauseMs || steps.at(-1)?.[2] !== w.size) steps.push([t, w.pauseMs, w.size]);
    }
    expect(steps).toEqual([
      [4_049, 500, 10],
      [5_049, 250, 10],
      [6_049, 125, 10],
      [7_049, 62.5, 10],
      [8_049, 0, 10],
      [9_049, 0, 20],
      [10_049, 0, 30],
    ]);
    expect(w.paused(10_049)).toEqual([]);
  });

  it('pauses only the lanes it held back, and none once no quiet lane is served', () => {
    const w = new LaneWindow(4);
    const other = { tenantId: 'other', eventName: 'api_requests' };
    w.afterBatch(mixed(quick), 0);
    w.afterBatch(mixed(slow), 10);
    expect(w.pauseMs).toBe(PAUSE_STEP_MS);
    w.afterBatch({ quiet: true, held: [other], startMs: slow }, 20);
    expect(w.paused(21).map((l) => l.tenantId).sort()).toEqual(['flood', 'other']);
    expect(w.paused(61)).toEqual([other]);
    // A second with no quiet lane: the whole lane, no pause.
    expect(w.afterBatch({ quiet: false, held: [flood], startMs: slow }, 20 + QUIET_LANE_SEEN_MS)).toBe(4);
    expect(w.pauseMs).toBe(0);
    expect(w.paused(20 + QUIET_LANE_SEEN_MS)).toEqual([]);
  });

  it('judges congestion against its quickest batch: a far Temporal is not congested for being far', () => {
    const w = new LaneWindow(100);
    // 150 ms a round trip when nothing queues.
    w.afterBatch({ quiet: false, held: [flood], startMs: 150 }, 0);
    expect(w.afterBatch(mixed(200), 10)).toBe(10);
    expect(w.afterBatch(mixed(400), 500)).toBe(10);
    expect(w.afterBatch(mixed(599), GROW_EVERY_MS + 10)).toBe(20);
    // Four round trips' worth is queueing.
    expect(w.afterBatch(mixed(601), GROW_EVERY_MS + 20)).toBe(10);
    // Near Temporal, a batch under CONGESTED_START_MS is never congested.
    const near = new LaneWindow(100);
    near.afterBatch({ quiet: false, held: [flood], startMs: 1 }, 0);
    near.afterBatch(mixed(CONGESTED_START_MS), 10);
    near.afterBatch(mixed(CONGESTED_START_MS), 500);
    expect(near.afterBatch(mixed(CONGESTED_START_MS), GROW_EVERY_MS + 10)).toBe(20);
    expect(near.afterBatch(mixed(CONGESTED_START_MS + 1), GROW_EVERY_MS + 20)).toBe(10);
  });

  it('forgets its quickest batch after a few minutes: one quick batch long ago (an idle night, a Temporal since moved further away) does not make every later one congested', () => {
    const w = new LaneWindow(100);
    w.afterBatch({ quiet: false, held: [flood], startMs: 5 }, 0);
    // Temporal is now 150 ms away: congested against the 5 ms batch, while that one is remembered.
    let t = 10;
    expect(w.afterBatch(mixed(150), t)).toBe(10);
    // A batch every half second (quiet tenants keep coming).
    for (; t < 2 * FASTEST_KEPT_MS; t += 500) w.afterBatch(mixed(150), t);
    expect(w.pauseMs).toBe(MAX_PAUSE_MS);
    // Once it is forgotten, 150 ms is the round trip, not queueing: the pause eases away and the window grows back.
    for (const end = t + 60 * GROW_EVERY_MS; t < end; t += 500) w.afterBatch(mixed(150), t);
    expect(w.pauseMs).toBe(0);
    expect(w.size).toBeGreaterThan(laneWindowFloor(100));
  });

  it('has a floor of a tenth of the lane, at least one event', () => {
    expect(laneWindowFloor(100)).toBe(10);
    expect(laneWindowFloor(4)).toBe(1);
    expect(laneWindowFloor(1)).toBe(1);
    const one = new LaneWindow(1);
    expect(one.afterBatch(mixed(slow), 0)).toBe(1);
  });
});
