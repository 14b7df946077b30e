/**
 * The lane window: how many events each lane (tenant, meter) may have in flight in the next claim,
 * between a tenth of LANE_MAX_IN_FLIGHT (its floor) and all of it.
 *
 * A busy lane (one tenant's flood) draining at full speed saturates the cores every tenant shares;
 * the others' new events then wait for a core at every step, not behind the flood's events: on two
 * cores their p99 rose 2.5–4.3× at the default lanes (bench fairness, docs/performance.md). The
 * window holds busy lanes back exactly then, and only then:
 * - while claims take quiet lanes' rows (a lane with nothing in flight: another tenant's new event)
 *   and Temporal is slow to start workflows (congested), it halves, down to its floor;
 * - while quiet lanes are served and starts are quick, it grows by its floor at most once a
 *   GROW_EVERY_MS, so that a busy lane's added load has time to show before more is added;
 * - with no quiet lane served for QUIET_LANE_SEEN_MS (a big customer alone, or every lane busy, as
 *   in a backlog after an outage) it is the whole lane at once: nobody is waiting to be protected.
 * A deployment with cores to spare starts workflows quickly under any flood, and keeps its whole
 * lanes. Quiet lanes never reach the window (they have nothing in flight); the floor keeps a busy
 * lane moving however congested the machine.
 *
 * One per process, shared by its relays. Each process keeps its own: a lane's room is still
 * counted in the claim over what every process has in flight.
 */

/**
 * Congested: a batch whose starts took longer than this, and longer than CONGESTED_VS_FASTEST
 * times the quickest batch the process has seen started (its round trip to Temporal when nothing
 * queues: a far Temporal is not congested for being far). Here, unloaded, Temporal answers a batch
 * in 4–10 ms; under a flood on two cores, in 50–700 ms.
 */
export const CONGESTED_START_MS = 50;
export const CONGESTED_VS_FASTEST = 4;
/** A quiet lane's row counts as waiting for this long after a claim took it. */
export const QUIET_LANE_SEEN_MS = 1_000;
/** The window grows at most this often, and not within this long of a congested batch. */
export const GROW_EVERY_MS = 1_000;

export function laneWindowFloor(laneMax: number): number {
  return Math.max(1, Math.ceil(laneMax / 10));
}

export class LaneWindow {
  /** Events each lane may have in flight in the next claim. */
  size: number;
  private readonly laneMax: number;
  private readonly floor: number;
  private quietSeenAt = -Infinity;
  private changedAt = -Infinity;
  private fastestMs = Infinity;

  constructor(laneMax: number) {
    this.laneMax = laneMax;
    this.size = laneMax;
    this.floor = laneWindowFloor(laneMax);
  }

  /**
   * After a batch: whether it took a quiet lane's row (its lane had nothing in flight and nothing
   * more waiting), whether a lane was held back by the window, and how long the batch's workflow
   * starts took. `now` is a monotonic time in milliseconds.
   */
  afterBatch(batch: { quiet: boolean; held: boolean; startMs: number }, now: number): number {
    this.fastestMs = Math.min(this.fastestMs, batch.startMs);
    if (batch.quiet) {
      // Quiet lanes being served again after a while: busy lanes start from the floor and earn the
      // rest, rather than keep a whole lane's room they may fill at once (a flood's first claim).
      if (now - this.quietSeenAt >= QUIET_LANE_SEEN_MS) this.resize(this.floor, now);
      this.quietSeenAt = now;
    }
    if (now - this.quietSeenAt >= QUIET_LANE_SEEN_MS) {
      this.size = this.laneMax;
    } else if (batch.startMs > Math.max(CONGESTED_START_MS, CONGESTED_VS_FASTEST * this.fastestMs)) {
      this.resize(Math.floor(this.size / 2), now);
    } else if (batch.held && now - this.changedAt >= GROW_EVERY_MS) {
      this.resize(this.size + this.floor, now);
    }
    return this.size;
  }

  private resize(size: number, now: number): void {
    this.size = Math.max(this.floor, Math.min(this.laneMax, size));
    this.changedAt = now;
  }
}
