/**
 * One LISTEN connection per process, shared by everything in it that waits for PostgreSQL:
 *
 * - relays wait on the schema's outbox channel: new outbox rows committed, or a lane with room
 *   again (a delivery finished);
 * - deliveries waiting for a (customer, meter) lease wait on its lease channel, each for its own
 *   lease's hand-off (src/stripe/meter-lease.ts): the payload names the lease and its new holder.
 *
 * Both channels are the schema's own (src/outbox/sql/schema.ts), so deployments in other schemas
 * of the database neither wake nor hand leases to this one. Waiters wait on a *topic*:
 * OUTBOX_TOPIC, or a lease id. Losing the connection only costs latency:
 * every waiter also wakes on a timeout, and the listener reconnects with backoff.
 */
import pg from 'pg';
import { CLOSE_WAIT_MS, closeWithin, connectingWithin } from '../db.js';
import { schemaFor, type Schema } from './sql/schema.js';

/** The topic of the outbox channel's notifications (lease ids are the topics of the lease channel's). */
export const OUTBOX_TOPIC = '';

/**
 * How often the LISTEN connection is asked a trivial question, and how long it has to answer. A
 * connection that goes silent (the server failed over, the network path dropped) neither errors
 * nor ends, and an idle one is never timed out by TCP: without asking, every wake-up would be lost
 * (the waiters falling back to their polls) until the process restarted.
 */
export const LISTEN_PROBE_EVERY_MS = 15_000;
const LISTEN_PROBE_ANSWER_MS = 5_000;

export class OutboxNotifier {
  private client: pg.Client | undefined;
  private probe: NodeJS.Timeout | undefined;
  private readonly probeEveryMs: number;
  private waiters = new Map<string, Set<() => void>>();
  /**
   * When each topic was last woken (a process-wide counter), so a waiter can tell it missed a wake
   * that came between its mark and its wait. Topics nobody waits on are dropped now and then;
   * `floor` (the counter at the last drop) stands in for them, which can only wake a waiter early.
   */
  private seq = new Map<string, number>();
  private counter = 0;
  private floor = 0;
  private readonly handedTo_ = new Map<string, { holder: string; at: number }>();
  private closed = false;
  private reconnectDelayMs = 100;
  private connecting: Promise<void> | undefined;

  private readonly schema: Schema;
  /**
   * `database`: a URL, or the connection settings of an application's pool (`pool.options`), from
   * which the LISTEN connection is opened apart: a listening client cannot be returned to a pool.
   */
  private readonly database: string | pg.ClientConfig;

  /** `schema`: the name of the PostgreSQL schema whose channels it listens on (default billing_outbox). */
  constructor(database: string | pg.ClientConfig, schema?: string, opts: { probeEveryMs?: number } = {}) {
    this.database = database;
    this.schema = schemaFor(schema);
    this.probeEveryMs = opts.probeEveryMs ?? LISTEN_PROBE_EVERY_MS;
  }

  /**
   * Starts listening (idempotent) and returns at once: connecting, and reconnecting with backoff
   * while PostgreSQL is away, happen in the background. A relay must keep claiming (or failing
   * and being retried) and heartbeating meanwhile; its polling covers what it does not hear.
   */
  start(): void {
    this.connecting ??= this.connect();
  }

  /** Whether the LISTEN connection is up now (tests, health). */
  get listening(): boolean {
    return this.client !== undefined;
  }

  private async connect(): Promise<void> {
    while (!this.closed) {
      const settings = typeof this.database === 'string' ? { connectionString: this.database } : this.database;
      const client = new pg.Client(connectingWithin({ ...settings, application_name: 'billing-outbox-listen' }));
      try {
        client.on('notification', (n) => {
          // The outbox channel (new rows, or a lane with room again) has no payload; the lease
          // channel's is "<lease id>\u001e<new holder>".
          if (n.channel !== this.schema.leaseChannel) return this.wake(OUTBOX_TOPIC);
          // The holder is empty when nobody was waiting.
          const [lease = '', holder = ''] = (n.payload ?? '').split('\u001e');
          this.handOff(lease, holder || undefined);
        });
        client.on('error', () => this.onLost(client));
        client.on('end', () => this.onLost(client));
        await client.connect();
        // Quoted: the channels contain ':' (the schema's name is a plain identifier). Answered in
        // time, like the probe: a server gone silent between the start-up and these would leave
        // this process without notifications for good, and the probe starts only after them.
        for (const channel of [this.schema.outboxChannel, this.schema.leaseChannel]) {
          await client.query({ text: `LISTEN "${channel}"`, query_timeout: LISTEN_PROBE_ANSWER_MS } as pg.QueryConfig);
        }
        // Closed while this connection was being made: nobody would ever end it.
        if (this.closed) {
          closeWithin(client, CLOSE_WAIT_MS);
          await client.end().catch(() => undefined);
          return;
        }
        this.client = client;
        this.reconnectDelayMs = 100;
        this.probe ??= setInterval(() => this.askListener(), this.probeEveryMs).unref();
        // Rows may have committed, and leases been given back, while we were not listening.
        this.wakeEveryone();
        return;
      } catch {
        closeWithin(client, CLOSE_WAIT_MS);
        await client.end().catch(() => undefined);
        await new Promise((r) => setTimeout(r, this.reconnectDelayMs));
        this.reconnectDelayMs = Math.min(this.reconnectDelayMs * 2, 5_000);
      }
    }
  }

  /** One trivial question to the LISTEN connection: unanswered in time, it is replaced. */
  private probing = false;
  private askListener(): void {
    const client = this.client;
    if (!client || this.probing) return;
    this.probing = true;
    client
      .query({ text: 'SELECT 1', query_timeout: LISTEN_PROBE_ANSWER_MS } as pg.QueryConfig)
      .catch(() => this.onLost(client))
      .finally(() => (this.probing = false));
  }

  private onLost(client: pg.Client): void {
    if (this.client !== client) return;
    this.client = undefined;
    closeWithin(client, CLOSE_WAIT_MS);
    client.end().catch(() => undefined);
    if (this.closed) return;
    this.connecting = this.connect();
  }

  /**
   * A lease was given up, and handed to `holder` (if anyone was waiting): its waiters wake, and the
   * one it was handed to learns it from `handedTo` without asking PostgreSQL.
   */
  handOff(lease: string, holder: string | undefined): void {
    this.wake(lease);
    // Stamped with the wake's mark: a waiter asks only for hand-offs heard since its own mark.
    if (holder) this.handedTo_.set(lease, { holder, at: this.mark(lease) });
  }

  /**
   * Who `lease` was handed to after `since` (a `mark(lease)`), as far as this process has heard. An
   * older hand-off is not news: handed to a waiter that then lost it (it lapsed before its attempt
   * began), the lease may be another's since, and every later wake would hand it back the same.
   */
  handedTo(lease: string, since: number): string | undefined {
    const last = this.handedTo_.get(lease);
    return last && last.at > since ? last.holder : undefined;
  }

  /** Wakes the waiters of `topic` now: a notification, or a hand-off within this process. */
  wake(topic: string): void {
    this.seq.set(topic, ++this.counter);
    if (this.seq.size > 10_000) {
      this.floor = this.counter;
      for (const t of this.seq.keys()) if (!this.waiters.has(t)) this.seq.delete(t);
      for (const t of this.handedTo_.keys()) if (!this.waiters.has(t)) this.handedTo_.delete(t);
    }
    const waiting = this.waiters.get(topic);
    if (!waiting) return;
    this.waiters.delete(topic);
    for (const wake of waiting) wake();
  }

  private wakeEveryone(): void {
    for (const topic of [...this.waiters.keys(), OUTBOX_TOPIC]) this.wake(topic);
  }

  /** A mark to pass to `wait`: take it before looking for work (or trying for a lease). */
  mark(topic: string = OUTBOX_TOPIC): number {
    return this.seq.get(topic) ?? this.floor;
  }

  /**
   * Resolves on the next notification of `topic`, after `timeoutMs`, or when `signal` aborts; at
   * once if one arrived since `since` (taken with `mark(topic)`).
   */
  wait(timeoutMs: number, signal?: AbortSignal, since?: number, topic: string = OUTBOX_TOPIC): Promise<void> {
    return new Promise((resolve) => {
      if (signal?.aborted || this.closed || (since !== undefined && since !== this.mark(topic))) return resolve();
      let waiting = this.waiters.get(topic);
      if (!waiting) this.waiters.set(topic, (waiting = new Set()));
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', done);
        const set = this.waiters.get(topic);
        set?.delete(done);
        if (set?.size === 0) this.waiters.delete(topic);
        resolve();
      };
      const timer = setTimeout(done, timeoutMs);
      signal?.addEventListener('abort', done, { once: true });
      waiting.add(done);
    });
  }

  async close(): Promise<void> {
    this.closed = true;
    clearInterval(this.probe);
    this.wakeEveryone();
    const client = this.client;
    this.client = undefined;
    if (!client) return;
    // A silent connection never confirms its end: its socket is destroyed after a moment.
    closeWithin(client, CLOSE_WAIT_MS);
    await client.end().catch(() => undefined);
  }
}
