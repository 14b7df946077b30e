/**
 * The application under chaos: usage arriving over HTTP (`POST /v1/usage`, retried by the client
 * until it is acknowledged, as a real client would) and written directly by `recordUsage` in the
 * application's own transactions, some of which roll back; the same usage submitted from several
 * connections at once; and one burst committed in a single transaction. `npm run demo` drives the
 * same load over HTTP only, with some acknowledged usage sent again (`resendShare`).
 *
 * What it remembers is only what a client can know: which usages were acknowledged, which
 * transactions it rolled back, what the API answered. What was committed is read from the
 * database at the end.
 */
import { isDatabaseUnavailable, withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import type { UsageInput } from '../src/outbox/validate.js';
import type { Rng } from './rng.js';
import { METERS, sleep, type World } from './world.js';

/** Where the load goes: the API (with a token allowed for every tenant) and the application's pool. */
export type LoadTarget = Pick<World, 'apiUrl' | 'apiToken' | 'pool'> & { tenants: readonly { tenantId: string }[] };

export interface Usage {
  tenantId: string;
  usageId: string;
  quantity: number;
  eventName: string;
  occurredAt: Date;
}

export interface LoadOptions {
  /** Usages to commit in all (the burst included). */
  events: number;
  /** Spread over this long. */
  windowMs: number;
  /** Usages in the one big transaction. */
  burst: number;
  /** Concurrent clients. */
  clients: number;
  /**
   * How usage arrives, as shares that add up to 1: over HTTP, in the application's own
   * transactions (one in ten rolled back), the same usage from three connections at once.
   * Default: 0.7, 0.25, 0.05.
   */
  mix?: { http: number; transaction: number; concurrentDuplicate: number };
  /** This share of HTTP submissions sends an earlier acknowledged usage again, which must answer 200 (default 0). */
  resendShare?: number;
  /** Stops the clients (each finishes the request it is in). */
  signal?: AbortSignal;
}

const CHAOS_MIX = { http: 0.7, transaction: 0.25, concurrentDuplicate: 0.05 };

export interface LoadCounts {
  overHttp: number;
  /** New usage over HTTP whose answer was 201 Created (200 is right only after a retry whose first try committed). */
  httpCreated: number;
  httpRetries: number;
  /** Acknowledged usage sent again, and how many of those the API answered 200, already recorded. */
  resent: number;
  resentAnsweredRecorded: number;
  direct: number;
  burst: number;
  concurrentDuplicates: number;
  rolledBack: number;
  commitOutcomeUnknown: number;
}

export const usageKey = (tenantId: string, usageId: string) => `${tenantId}\u001f${usageId}`;

export class Load {
  /** Usages a client was told are recorded (201/200 or a COMMIT that returned). */
  readonly acknowledged = new Map<string, Usage>();
  /** Usages written in transactions that never committed. */
  readonly uncommitted = new Map<string, Usage>();
  readonly counts: LoadCounts = {
    overHttp: 0,
    httpCreated: 0,
    httpRetries: 0,
    resent: 0,
    resentAnsweredRecorded: 0,
    direct: 0,
    burst: 0,
    concurrentDuplicates: 0,
    rolledBack: 0,
    commitOutcomeUnknown: 0,
  };
  /** Answers no client should get (a re-sent usage answered other than 200), for whoever checks. */
  readonly unexpected: string[] = [];
  private readonly sentOverHttp: Usage[] = [];
  private issued = 0;
  private serial = 0;
  private burstDone = false;

  private readonly world: LoadTarget;
  private readonly rng: Rng;
  private readonly opts: LoadOptions;
  private readonly say: (line: string) => void;
  constructor(
    world: LoadTarget,
    rng: Rng,
    opts: LoadOptions,
    say: (line: string) => void,
  ) {
    this.world = world;
    this.rng = rng;
    this.opts = opts;
    this.say = say;
  }

  /** Runs until `events` usages have been issued and every client has its answer. */
  async run(): Promise<void> {
    const started = Date.now();
    await Promise.all(Array.from({ length: this.opts.clients }, (_, i) => this.client(i, started, this.rng.fork())));
  }

  private async client(index: number, started: number, rng: Rng): Promise<void> {
    const perEvent = this.opts.windowMs / this.opts.events;
    const mix = this.opts.mix ?? CHAOS_MIX;
    const resendShare = this.opts.resendShare ?? 0;
    for (;;) {
      if (this.issued >= this.opts.events || this.opts.signal?.aborted) return;
      // Pace: the n-th usage is due n/events of the way through the window.
      const due = started + this.issued * perEvent;
      if (Date.now() < due) await sleep(due - Date.now());
      // Others may have issued the last usages meanwhile.
      if (this.issued >= this.opts.events || this.opts.signal?.aborted) return;
      if (!this.burstDone && index === 0 && Date.now() - started > this.opts.windowMs / 3) {
        this.burstDone = true;
        await this.burst(rng);
        continue;
      }
      const roll = rng.next();
      if (roll < mix.http) {
        // (No draw without resends: a seed gives the chaos runner the same load as before they existed.)
        if (resendShare > 0 && this.sentOverHttp.length > 0 && rng.chance(resendShare)) await this.resend(rng.pick(this.sentOverHttp));
        else await this.overHttp(this.newUsage(rng));
      } else if (roll < mix.http + mix.transaction) await this.transaction(rng);
      else await this.concurrentDuplicate(this.newUsage(rng));
    }
  }

  private newUsage(rng: Rng): Usage {
    // One hot tenant takes 40 % of the traffic; the others share the rest.
    const tenants = this.world.tenants;
    const tenant = rng.chance(0.4) ? tenants[0]! : rng.pick(tenants);
    this.issued++;
    return {
      tenantId: tenant.tenantId,
      usageId: `u-${++this.serial}-${rng.int(0, 1e9).toString(36)}`,
      quantity: rng.int(1, 1000),
      eventName: rng.pick(METERS),
      occurredAt: new Date(Date.now() - rng.int(0, 3_600_000)),
    };
  }

  /** A client that retries until it hears back: connection errors and 5xx are retried with the same body. */
  private async overHttp(usage: Usage): Promise<void> {
    this.counts.overHttp++;
    const status = await this.post(usage);
    if (status === undefined) return;
    if (status === 201) this.counts.httpCreated++;
    this.sentOverHttp.push(usage);
  }

  /** The same usage, same body, sent again: recorded once, so the API answers 200 (not 201). */
  private async resend(usage: Usage): Promise<void> {
    this.counts.resent++;
    const status = await this.post(usage);
    if (status === 200) this.counts.resentAnsweredRecorded++;
    else if (status !== undefined) this.unexpected.push(`${usage.tenantId}/${usage.usageId} sent again: HTTP ${status} (expected 200, already recorded)`);
  }

  /** POSTs until the API answers 200 or 201 (then acknowledged); undefined when stopped first. */
  private async post(usage: Usage): Promise<200 | 201 | undefined> {
    const body = JSON.stringify({
      tenant_id: usage.tenantId,
      usage_id: usage.usageId,
      quantity: usage.quantity,
      event_name: usage.eventName,
      occurred_at: usage.occurredAt.toISOString(),
    });
    for (let attempt = 0; ; attempt++) {
      if (this.opts.signal?.aborted) return undefined;
      if (attempt > 0) {
        this.counts.httpRetries++;
        await sleep(Math.min(2_000, 100 * attempt));
      }
      let status: number;
      let text: string;
      try {
        const res = await fetch(`${this.world.apiUrl}/v1/usage`, {
          method: 'POST',
          headers: { 'content-type': 'application/json', authorization: `Bearer ${this.world.apiToken}` },
          body,
          signal: AbortSignal.timeout(15_000),
        });
        status = res.status;
        text = await res.text();
      } catch {
        continue; // connection refused or cut: the API process may be restarting
      }
      if (status === 200 || status === 201) {
        this.acknowledged.set(usageKey(usage.tenantId, usage.usageId), usage);
        return status;
      }
      if (status >= 500) continue;
      // Every usage here is valid: any other answer is the product refusing good usage.
      throw new Error(`POST /v1/usage answered ${status} to valid usage: ${text}`);
    }
  }

  /** The application's own transaction: 1–10 usages, and one time in ten a rollback at the end. */
  private async transaction(rng: Rng): Promise<void> {
    const usages = Array.from({ length: Math.min(rng.int(1, 10), Math.max(1, this.opts.events - this.issued)) }, () => this.newUsage(rng));
    const rollBack = rng.chance(0.1);
    if (rollBack) this.issued -= usages.length; // rolled-back usage does not count towards the total
    await this.writeDirect(usages, rollBack);
  }

  private async concurrentDuplicate(usage: Usage): Promise<void> {
    this.counts.concurrentDuplicates++;
    await Promise.all([0, 1, 2].map(() => this.writeDirect([usage], false)));
  }

  private async burst(rng: Rng): Promise<void> {
    const n = Math.min(this.opts.burst, Math.max(0, this.opts.events - this.issued));
    if (n === 0) return;
    const usages = Array.from({ length: n }, () => this.newUsage(rng));
    this.say(`load: a burst of ${n} usages in one transaction`);
    this.counts.burst += n;
    await this.writeDirect(usages, false);
  }

  /**
   * Writes the usages in one transaction and commits it (or rolls it back). Retried while the
   * database is away, as long as COMMIT was never sent: after a COMMIT that failed, whether it
   * committed is unknown to the client (the check reads the truth from the database).
   */
  private async writeDirect(usages: Usage[], rollBack: boolean): Promise<void> {
    for (let attempt = 0; ; attempt++) {
      if (attempt > 0) await sleep(Math.min(2_000, 200 * attempt));
      let committing = false;
      try {
        await withTransaction(this.world.pool, async (c) => {
          for (const u of usages) await recordUsage(c, toInput(u));
          if (rollBack) throw new RolledBack();
          committing = true;
        });
        this.counts.direct += usages.length;
        for (const u of usages) this.acknowledged.set(usageKey(u.tenantId, u.usageId), u);
        return;
      } catch (err) {
        if (err instanceof RolledBack) {
          this.counts.rolledBack += usages.length;
          for (const u of usages) this.uncommitted.set(usageKey(u.tenantId, u.usageId), u);
          return;
        }
        if (committing) {
          this.counts.commitOutcomeUnknown += usages.length;
          return;
        }
        // Failed before COMMIT: nothing was written. Try again if the database is restarting.
        if (!isDatabaseUnavailable(err)) throw err;
      }
    }
  }
}

class RolledBack extends Error {}

function toInput(u: Usage): UsageInput {
  return { tenantId: u.tenantId, usageId: u.usageId, quantity: u.quantity, eventName: u.eventName, occurredAt: u.occurredAt };
}
