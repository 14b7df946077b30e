/**
 * The lane window: how many events each lane (tenant, meter) may have in flight in the next claim,
 * between a tenth of LANE_MAX_IN_FLIGHT (its floor) and all of it.
 *
 * A busy lane (one tenant's flood) draining at full speed saturates the cores every tenant shares;
 * the others' new events then wait for a core at every step, not behind the flood's events: on two
 * cores their p99 rose 2.5–4.3× at the default lanes (bench fairness, docs/performance.md). The
 * window holds busy lanes back exactly then, and only then:
 * - while claims take quiet lanes' rows (a lane with nothing in flight: another tenant's new event)
 *   and Temporal is slow to start workflows (congested), it halves, down to its floor; at the
 *   floor, a busy lane then waits a pause after each claim of its rows (50 ms, doubling to 1 s);
 * - while quiet lanes are served and starts are quick, the pause halves away, then the window grows
 *   by its floor, each at most once a GROW_EVERY_MS, so that a busy lane's added load has time to
 *   show before more is added;
 * - with no quiet lane served for QUIET_LANE_SEEN_MS (a big customer alone, or every lane busy, as
 *   in a backlog after an outage) it is the whole lane at once: nobody is waiting to be protected.
 * A deployment with cores to spare starts workflows quickly under any flood, and keeps its whole
 * lanes. Quiet lanes never reach the window (they have nothing in flight); a busy lane keeps moving
 * however congested the machine: its floor's worth at least once a MAX_PAUSE_MS.
 *
 * One per process, shared by its relays. Each process keeps its own: a lane's room is still
 * counted in the claim over what every process has in flight, but a pause is each process's own
 * (with N worker processes a paused lane may be claimed up to N times a pause).
 */

/**
 * Congested: a batch whose starts took longer than this, and longer than CONGESTED_VS_FASTEST
 * times the quickest batch started in the last few minutes (FASTEST_KEPT_MS: its round trip to Temporal when nothing
 * queues: a far Temporal is not congested for being far). Here (two cores, Temporal on the same
 * machine), a v1 relay's batch of one start takes 8.6 ms at the median and 15.5 ms at p99 with 99
 * tenants at 20/s alone, 13 and 24 ms with one tenant's flood beside them, when the others' p99
 * commit → acknowledged is already twice as long; a v2 flood's batches take 50–700 ms. So the bar
 * is the first sign of queueing, not a deep queue: at 50 ms, v1's flood never crossed it.
 */
export const CONGESTED_START_MS = 15;
export const CONGESTED_VS_FASTEST = 4;
/**
 * The quickest batch is the quickest of the last FASTEST_KEPT_MS to 2 × FASTEST_KEPT_MS, not of the
 * process's life: one idle night's 3 ms batch, or a Temporal that moved further away (a failover to
 * another region), would otherwise make every ordinary batch after it look congested for good, and
 * hold every busy lane at its floor until the worker restarts.
 */
export const FASTEST_KEPT_MS = 5 * 60_000;
/** A quiet lane's row counts as waiting for this long after a claim took it. */
export const QUIET_LANE_SEEN_MS = 1_000;
/** The window grows at most this often, and not within this long of a congested batch. */
export const GROW_EVERY_MS = 1_000;
/** A busy lane's pause below the floor: its first step, and at most (a busy lane still moves). */
export const PAUSE_STEP_MS = 50;
export const MAX_PAUSE_MS = 1_000;

export function laneWindowFloor(laneMax: number): number {
  return Math.max(1, Math.ceil(laneMax / 10));
}

/** A lane: one tenant's events for one meter. */
export interface Lane {
  tenantId: string;
  eventName: string;
}

export class LaneWindow {
  /** Events each lane may have in flight in the next claim. */
  size: number;
  /**
   * Below the floor: how long a busy lane waits after one of this process's claims took its rows
   * before the next may. 0 unless the window is at its floor and starts are still slow: with v1's
   * floor of one event, a busy lane sends one call after another, and only a pause slows it more.
   */
  pauseMs = 0;
  private readonly laneMax: number;
  private readonly floor: number;
  private readonly congestedStartMs: number;
  private quietSeenAt = -Infinity;
  private changedAt = -Infinity;
  /** The quickest batch since `fastestSince`, and the quickest of the period before it. */
  private fastestMs = Infinity;
  private fastestBeforeMs = Infinity;
  private fastestSince = -Infinity;
  /** Busy lanes paused, by `[tenant, event]` as JSON, until when. */
  private readonly pausedUntil = new Map<string, { lane: Lane; until: number }>();

  /** `congestedStartMs`: CONGESTED_START_MS unless a test needs a bar its machine's noise cannot reach. */
  constructor(laneMax: number, { congestedStartMs = CONGESTED_START_MS }: { congestedStartMs?: number } = {}) {
    this.congestedStartMs = congestedStartMs;
    this.laneMax = laneMax;
    this.size = laneMax;
    this.floor = laneWindowFloor(laneMax);
  }

  /** The lanes the next claim leaves alone: busy lanes within their pause. */
  paused(now: number): Lane[] {
    const lanes: Lane[] = [];
    for (const [key, { lane, until }] of this.pausedUntil) {
      if (until <= now) this.pausedUntil.delete(key);
      else lanes.push(lane);
    }
    return lanes;
  }

  /**
   * After a batch: whether it took a quiet lane's row (its lane had nothing in flight and nothing
   * more waiting), the lanes it held back (they had more than their room; a lane may come once a
   * row), and how long the batch's workflow starts took. `now` is a monotonic time in milliseconds.
   */
  afterBatch(batch: { quiet: boolean; held: Lane[]; startMs: number }, now: number): number {
    if (now - this.fastestSince >= FASTEST_KEPT_MS) {
      this.fastestBeforeMs = this.fastestMs;
      this.fastestMs = Infinity;
      this.fastestSince = now;
    }
    this.fastestMs = Math.min(this.fastestMs, batch.startMs);
    const fastestMs = Math.min(this.fastestMs, this.fastestBeforeMs);
    if (batch.quiet) {
      // Quiet lanes being served again after a while: busy lanes start from the floor and earn the
      // rest, rather than keep a whole lane's room they may fill at once (a flood's first claim).
      if (now - this.quietSeenAt >= QUIET_LANE_SEEN_MS) this.resize(this.floor, 0, now);
      this.quietSeenAt = now;
    }
    if (now - this.quietSeenAt >= QUIET_LANE_SEEN_MS) {
      this.size = this.laneMax;
      this.pauseMs = 0;
      this.pausedUntil.clear();
    } else if (batch.startMs > Math.max(this.congestedStartMs, CONGESTED_VS_FASTEST * fastestMs)) {
      if (this.size > this.floor) this.resize(Math.floor(this.size / 2), 0, now);
      else this.resize(this.floor, Math.min(MAX_PAUSE_MS, Math.max(PAUSE_STEP_MS, 2 * this.pauseMs)), now);
    } else if (batch.held.length > 0 && now - this.changedAt >= GROW_EVERY_MS) {
      if (this.pauseMs > 0) this.resize(this.floor, this.pauseMs / 2 < PAUSE_STEP_MS ? 0 : this.pauseMs / 2, now);
      else this.resize(this.size + this.floor, 0, now);
    }
    if (this.pauseMs > 0) for (const lane of batch.held) this.pausedUntil.set(JSON.stringify([lane.tenantId, lane.eventName]), { lane, until: now + this.pauseMs });
    return this.size;
  }

  private resize(size: number, pauseMs: number, now: number): void {
    this.size = Math.max(this.floor, Math.min(this.laneMax, size));
    this.pauseMs = pauseMs;
    if (pauseMs === 0) this.pausedUntil.clear();
    this.changedAt = now;
  }
}
