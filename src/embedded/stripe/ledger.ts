/**
 * The meter events Stripe accepted, and the 24-hour identifier index that makes a resend fail.
 */
import type { RecordedMeterEvent } from './types.js';

export const DAY_MS = 24 * 60 * 60 * 1000;

export class MeterEventLedger {
  private recorded: RecordedMeterEvent[] = [];
  /** identifier -> receipt time (ms) of the latest accepted event with it. */
  private lastAcceptedAt = new Map<string, number>();

  record(event: RecordedMeterEvent): void {
    this.recorded.push(event);
    this.lastAcceptedAt.set(event.identifier, event.receivedAt);
  }

  /**
   * Stripe keeps identifiers unique "within a rolling period of at least 24 hours", counted from
   * receipt. The scope is undocumented, so the index is global (across meters): the strictest
   * reading, so a pipeline that reuses an identifier finds out here rather than in production.
   * Cancelled events and events that later failed validation still hold their identifier.
   */
  isDuplicate(identifier: string, nowMs: number): boolean {
    const at = this.lastAcceptedAt.get(identifier);
    return at !== undefined && nowMs - at < DAY_MS;
  }

  /** The latest accepted event with this identifier (the stored object, not a copy). */
  latest(identifier: string): RecordedMeterEvent | undefined {
    for (let i = this.recorded.length - 1; i >= 0; i--) {
      const event = this.recorded[i];
      if (event?.identifier === identifier) return event;
    }
    return undefined;
  }

  cancel(event: RecordedMeterEvent): void {
    event.cancelled = true;
  }

  get count(): number {
    return this.recorded.length;
  }

  /** Copies, in acceptance order. */
  all(): RecordedMeterEvent[] {
    return this.recorded.map((event) => ({ ...event, payload: { ...event.payload } }));
  }

  /** Events that count towards usage: neither cancelled nor rejected by the later validation. */
  billable(): readonly RecordedMeterEvent[] {
    return this.recorded.filter((event) => !event.cancelled && !event.asyncError);
  }

  /** Puts back events saved by `all()`, in their order (the identifier index is rebuilt). */
  restore(events: readonly RecordedMeterEvent[]): void {
    for (const event of events) this.record({ ...event, payload: { ...event.payload } });
  }

  reset(): void {
    this.recorded = [];
    this.lastAcceptedAt = new Map();
  }
}
