/**
 * One LISTEN connection per process, shared by every relay in it: wakes idle relays as soon as new
 * outbox rows commit. Losing the connection only costs latency: relays also poll, and the listener
 * reconnects with backoff.
 */
import pg from 'pg';

export const OUTBOX_CHANNEL = 'billing_outbox';

export class OutboxNotifier {
  private client: pg.Client | undefined;
  private waiters = new Set<() => void>();
  /** Counts notifications, so a waiter can tell it missed one that arrived before it waited. */
  private seq = 0;
  private closed = false;
  private reconnectDelayMs = 100;
  private connecting: Promise<void> | undefined;

  constructor(private readonly databaseUrl: string) {}

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
      const client = new pg.Client({ connectionString: this.databaseUrl, application_name: 'billing-outbox-listen' });
      try {
        client.on('notification', () => this.wakeAll());
        client.on('error', () => this.onLost(client));
        client.on('end', () => this.onLost(client));
        await client.connect();
        await client.query(`LISTEN ${OUTBOX_CHANNEL}`);
        this.client = client;
        this.reconnectDelayMs = 100;
        // Rows may have committed while we were not listening.
        this.wakeAll();
        return;
      } catch {
        await client.end().catch(() => undefined);
        await new Promise((r) => setTimeout(r, this.reconnectDelayMs));
        this.reconnectDelayMs = Math.min(this.reconnectDelayMs * 2, 5_000);
      }
    }
  }

  private onLost(client: pg.Client): void {
    if (this.client !== client) return;
    this.client = undefined;
    client.end().catch(() => undefined);
    if (this.closed) return;
    this.connecting = this.connect();
  }

  private wakeAll(): void {
    this.seq++;
    const waiters = [...this.waiters];
    this.waiters.clear();
    for (const wake of waiters) wake();
  }

  /** A mark to pass to `wait`: take it before looking for work. */
  mark(): number {
    return this.seq;
  }

  /**
   * Resolves on the next notification, after `timeoutMs`, or when `signal` aborts; at once if a
   * notification arrived since `since` (taken with `mark()`).
   */
  wait(timeoutMs: number, signal?: AbortSignal, since = this.seq): Promise<void> {
    return new Promise((resolve) => {
      if (signal?.aborted || since !== this.seq) return resolve();
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', done);
        this.waiters.delete(done);
        resolve();
      };
      const timer = setTimeout(done, timeoutMs);
      signal?.addEventListener('abort', done, { once: true });
      this.waiters.add(done);
    });
  }

  async close(): Promise<void> {
    this.closed = true;
    this.wakeAll();
    const client = this.client;
    this.client = undefined;
    await client?.end().catch(() => undefined);
  }
}
