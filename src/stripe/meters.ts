/**
 * Stripe's meters: which meter an event name is recorded on, and the payload keys that meter reads.
 */
import type Stripe from 'stripe';

/**
 * Every meter of each event name, active or not: a meter replaced (to change its payload keys)
 * keeps what it counted before, and reconciliation reads both.
 */
export async function everyMeterByEventName(client: Pick<Stripe, 'billing'>): Promise<Map<string, Stripe.Billing.Meter[]>> {
  const byName = new Map<string, Stripe.Billing.Meter[]>();
  for await (const meter of client.billing.meters.list({ limit: 100 })) {
    const same = byName.get(meter.event_name);
    if (same) same.push(meter);
    else byName.set(meter.event_name, [meter]);
  }
  return byName;
}

/** The meter each event name is recorded on, of every meter of each name. */
export function currentMeters(every: Map<string, Stripe.Billing.Meter[]>): Map<string, Stripe.Billing.Meter> {
  const byName = new Map<string, Stripe.Billing.Meter>();
  for (const [name, meters] of every) byName.set(name, meters.find((m) => m.status === 'active') ?? meters[0]!);
  return byName;
}

/** Stripe's default payload keys, for a meter created without naming its own. */
export const DEFAULT_METER_KEYS = { customerKey: 'stripe_customer_id', valueKey: 'value' } as const;

/** Where a meter reads an event's customer and value from. */
export interface MeterKeys {
  meterId: string;
  /** `customer_mapping.event_payload_key` (Stripe's default: stripe_customer_id). */
  customerKey: string;
  /** `value_settings.event_payload_key` (Stripe's default: value). */
  valueKey: string;
}

/** One meter event, as both meter APIs take it (src/stripe/sender.ts). */
export interface MeterEvent {
  eventName: string;
  /** Where this event's meter reads the customer and the value. */
  keys: Pick<MeterKeys, 'customerKey' | 'valueKey'>;
  stripeCustomerId: string;
  quantity: number;
  /** The outbox row's idempotency key: Stripe deduplicates on it for 24 h. */
  identifier: string;
  occurredAt: Date;
}

/** The event's payload, under its meter's keys: built here once for v1 and v2 alike. */
export function meterEventPayload(event: MeterEvent): Record<string, string> {
  return { [event.keys.customerKey]: event.stripeCustomerId, [event.keys.valueKey]: String(event.quantity) };
}

/**
 * How long after its meter was deactivated, with no active one since, an event name counts as a
 * meter being replaced (MeterCatalog.swapLeftMs): usage for it is let in and its delivery waits,
 * rather than refused or dead as a meter Stripe does not have.
 */
export const METER_SWAP_MS = 15 * 60_000;

/** How long after a failed read of the meter list a name not read yet is let in without asking again (`known`). */
const FAILED_READ_KEPT_MS = 5_000;

/**
 * The payload keys of each meter, read from Stripe's meter list and cached for `maxAgeMs` (a
 * minute). A meter's own keys never change, but the meter an event name goes to does: a meter
 * deactivated and replaced by one with other payload keys would otherwise get events under the old
 * keys, which Stripe takes and rejects later. After `maxAgeMs` the next event asks again: one list
 * call a minute per worker.
 *
 * An event name not in the cache is answered from a list read *after* it was asked about, so a
 * meter created a moment ago is found and "no meter" always means Stripe said so. Reads are
 * shared and paced (at most one per `minReloadIntervalMs`): a backlog naming a meter that does not
 * exist costs one list call per interval, not one per event.
 */
export class MeterCatalog {
  private byName = new Map<string, MeterKeys>();
  private inFlight: { startedAt: number; done: Promise<void> } | undefined;
  private lastStartedAt = Number.NEGATIVE_INFINITY;
  /** When the read behind the current cache started. */
  private loadedFrom = Number.NEGATIVE_INFINITY;
  /** When the last read that failed did. */
  private failedAt = Number.NEGATIVE_INFINITY;
  /** Event names whose meter is being replaced (swapLeftMs): the deactivation's time (Stripe's), until when (ours). */
  private swaps = new Map<string, { deactivatedAt: number; until: number }>();

  private readonly stripe: Pick<Stripe, 'billing'>;
  private readonly opts: { minReloadIntervalMs?: number; maxAgeMs?: number; now?: () => number };
  constructor(
    stripe: Pick<Stripe, 'billing'>,
    opts: { minReloadIntervalMs?: number; maxAgeMs?: number; now?: () => number } = {},
  ) {
    this.stripe = stripe;
    this.opts = opts;
  }

  /** A monotonic clock (ms): ages and "read after" are differences of it, never moved by a wall clock stepped back. */
  private now(): number {
    return this.opts.now ? this.opts.now() : performance.now();
  }

  /** The keys of the active meter for `eventName`; undefined when Stripe has no active meter for it. */
  async keysFor(eventName: string): Promise<MeterKeys | undefined> {
    const cached = this.byName.get(eventName);
    const now = this.now();
    if (cached && now - this.loadedFrom < (this.opts.maxAgeMs ?? 60_000)) return cached;
    await this.readStartedAfter(now);
    return this.byName.get(eventName);
  }

  /**
   * What the meter list says of `eventName` without waiting for Stripe (the ingestion door's
   * question): `active` when the last read found an active meter for it, however old that read is
   * (one is started behind the answer once it is past `maxAgeMs`); `replacing` when its meter is
   * being replaced (swapLeftMs); `missing` when a read started
   * within the last `missWithinMs` found none; `unanswered` when the last read failed, under
   * FAILED_READ_KEPT_MS ago; else `ask` (keysFor reads the list again).
   */
  known(eventName: string, missWithinMs: number): 'active' | 'replacing' | 'missing' | 'unanswered' | 'ask' {
    const now = this.now();
    if (this.byName.has(eventName)) {
      if (now - this.loadedFrom >= (this.opts.maxAgeMs ?? 60_000)) void this.readStartedAfter(now).catch(() => undefined);
      return 'active';
    }
    if (this.swapLeftMs(eventName) > 0) return 'replacing';
    if (this.loadedFrom >= now - missWithinMs) return 'missing';
    if (this.failedAt > this.loadedFrom && now - this.failedAt < FAILED_READ_KEPT_MS) return 'unanswered';
    return 'ask';
  }

  /** Waits for a read of the meter list that started at or after `askedAt` (starting one if needed). */
  private async readStartedAfter(askedAt: number): Promise<void> {
    for (;;) {
      if (this.inFlight && this.inFlight.startedAt >= askedAt) return this.inFlight.done;
      if (!this.inFlight && this.loadedFrom >= askedAt) return;
      if (this.inFlight) {
        // Began before we asked: it may miss a meter created since. Wait for it, then read again.
        await this.inFlight.done.catch(() => undefined);
        continue;
      }
      const pause = this.lastStartedAt + (this.opts.minReloadIntervalMs ?? 1_000) - this.now();
      if (pause > 0) {
        await new Promise((resolve) => setTimeout(resolve, pause));
        continue;
      }
      const startedAt = this.now();
      this.lastStartedAt = startedAt;
      const done = this.read(startedAt)
        .catch((err: unknown) => {
          this.failedAt = this.now();
          throw err;
        })
        .finally(() => {
          if (this.inFlight?.done === done) this.inFlight = undefined;
        });
      this.inFlight = { startedAt, done };
      return done;
    }
  }

  /** Reads the meter list again now (shared with any read started since), whatever the cache's age. */
  async refresh(): Promise<void> {
    await this.readStartedAfter(this.now());
  }

  /** The keys the last read of the meter list found for `eventName`, without reading it again. */
  lastRead(eventName: string): MeterKeys | undefined {
    return this.byName.get(eventName);
  }

  /**
   * How much longer (ms) `eventName` counts as a meter being replaced: the last read found no active
   * meter for it, and one deactivated less than METER_SWAP_MS before (an operator replacing it,
   * which Stripe only allows as a deactivation and a new meter). 0 otherwise.
   */
  swapLeftMs(eventName: string): number {
    return Math.max(0, (this.swaps.get(eventName)?.until ?? 0) - this.now());
  }

  private async read(startedAt: number): Promise<void> {
    const every = await everyMeterByEventName(this.stripe);
    const swaps = new Map<string, { deactivatedAt: number; until: number }>();
    for (const [name, same] of every) {
      if (same.some((m) => m.status === 'active')) continue;
      const deactivatedAt = Math.max(...same.map((m) => m.status_transitions?.deactivated_at ?? 0)) * 1000;
      // Timed from when this catalog first saw that deactivation, METER_SWAP_MS at most: a clock far
      // behind Stripe's does not stretch the wait, each read does not start it again.
      const seen = this.swaps.get(name);
      const until = seen?.deactivatedAt === deactivatedAt ? seen.until : startedAt + Math.min(METER_SWAP_MS, deactivatedAt + METER_SWAP_MS - Date.now());
      // Kept once over too: seen again, it stays over.
      swaps.set(name, { deactivatedAt, until });
    }
    const next = new Map<string, MeterKeys>();
    for (const [name, meter] of currentMeters(every)) {
      if (meter.status !== 'active') continue;
      next.set(name, {
        meterId: meter.id,
        customerKey: meter.customer_mapping?.event_payload_key ?? 'stripe_customer_id',
        valueKey: meter.value_settings?.event_payload_key ?? 'value',
      });
    }
    this.byName = next;
    this.swaps = swaps;
    this.loadedFrom = startedAt;
  }
}
