/**
 * The world a chaos run attacks: PostgreSQL and a file-backed Temporal dev server of its own, the
 * local Stripe-compatible server (in this process, so faults can be injected into it), and the
 * product as deployed: one API process and several worker processes (`src/bin/api.ts`,
 * `src/bin/worker.ts`), each of which a fault may kill, pause or restart.
 *
 * Relays are not processes of their own: each relay is a workflow whose claiming activity runs in
 * whichever worker process polls it, so killing a worker also kills the relay activity it hosted,
 * between a claim and the workflow starts if that is where it was.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createWriteStream, type WriteStream } from 'node:fs';
import { mkdir } from 'node:fs/promises';
import path from 'node:path';
import type pg from 'pg';
import { createPool, migrate } from '../src/db.js';
import { freePort, startEmbeddedPostgres, type EmbeddedPg } from '../src/embedded/postgres.js';
import { PROJECT_ROOT, startTemporalDevServer, type DevServer } from '../src/embedded/temporal.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

export const METERS = ['api_requests', 'tokens'] as const;
export const TASK_QUEUE = 'billing-outbox-chaos';

export interface WorldOptions {
  /** Where the data folders and each process's log go. */
  dir: string;
  workers: number;
  stripeApi: 'v1' | 'v2';
  tenants: number;
  /** One line per thing that happened, for the run's log. */
  say: (line: string) => void;
}

/** Settings of the product's processes: short timeouts and a retry budget no fault here exhausts. */
function productEnv(w: { pg: EmbeddedPg; temporal: DevServer; stripe: LocalStripe; stripeKey: string; opts: WorldOptions }): Record<string, string> {
  return {
    DATABASE_URL: w.pg.url,
    TEMPORAL_ADDRESS: w.temporal.address,
    TEMPORAL_TASK_QUEUE: TASK_QUEUE,
    STRIPE_API_BASE: w.stripe.url,
    STRIPE_API_KEY: w.stripeKey,
    STRIPE_METER_API: w.opts.stripeApi,
    STRIPE_TIMEOUT_MS: '1500',
    STRIPE_UNANSWERED_HOLD_MS: '2000',
    STRIPE_RATE_LIMIT_PER_SECOND: '500',
    RETRY_INITIAL_INTERVAL_MS: '200',
    RETRY_MAXIMUM_INTERVAL_MS: '2000',
    RETRY_MAXIMUM_ATTEMPTS: '1000',
    RETRY_MAX_RATE_LIMITED_MS: '3600000',
    RELAY_CLAIM_TIMEOUT_MS: '5000',
    RELAY_POLL_INTERVAL_MS: '500',
    LOG_LEVEL: 'info',
  };
}

/** One OS process of the product, restartable; its output appended to `<name>.log`. */
export class ProductProcess {
  private child: ChildProcess | undefined;
  private paused = false;
  /** Set while the runner itself ends the process (kill, stop): any other exit is the product's. */
  private ending = false;
  private readonly logFile: WriteStream;
  starts = 0;
  /** Exits the runner did not cause (a crash: an uncaught error, a lost connection it gave up on). */
  readonly exitsOnItsOwn: string[] = [];

  readonly name: string;
  private readonly script: string;
  private readonly env: () => Record<string, string>;
  constructor(
    name: string,
    script: string,
    env: () => Record<string, string>,
    dir: string,
  ) {
    this.name = name;
    this.script = script;
    this.env = env;
    this.logFile = createWriteStream(path.join(dir, `${name}.log`), { flags: 'a' });
  }

  get running(): boolean {
    return this.child !== undefined && this.child.exitCode === null && this.child.signalCode === null;
  }

  get pid(): number | undefined {
    return this.child?.pid;
  }

  start(): void {
    if (this.running) return;
    this.starts++;
    this.logFile.write(`--- start ${this.starts} at ${new Date().toISOString()}\n`);
    const child = spawn(process.execPath, ['--import', 'tsx', path.join(PROJECT_ROOT, 'src', 'bin', this.script)], {
      cwd: PROJECT_ROOT,
      env: { ...process.env, ...this.env() },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    child.stdout!.pipe(this.logFile, { end: false });
    child.stderr!.pipe(this.logFile, { end: false });
    child.once('exit', (code, signal) => {
      if (!this.ending) this.exitsOnItsOwn.push(`${this.name} exited on its own at ${new Date().toISOString()} (code ${code}, signal ${signal}); see ${this.name}.log`);
    });
    this.child = child;
    this.paused = false;
    this.ending = false;
  }

  /** SIGKILL: no shutdown hook runs, in-flight work is simply gone. */
  async kill(): Promise<void> {
    const child = this.child;
    if (!child || !this.running) return;
    const exited = new Promise((resolve) => child.once('exit', resolve));
    this.ending = true;
    if (this.paused) child.kill('SIGCONT');
    child.kill('SIGKILL');
    await exited;
  }

  /** SIGSTOP for `ms`, then SIGCONT: the process comes back to find its claims and leases expired. */
  async pause(ms: number): Promise<void> {
    const child = this.child;
    if (!child || !this.running) return;
    this.paused = true;
    child.kill('SIGSTOP');
    await sleep(ms);
    if (this.running && this.paused) child.kill('SIGCONT');
    this.paused = false;
  }

  /** SIGTERM (a deploy): the process drains and exits by itself. */
  async stop(): Promise<void> {
    const child = this.child;
    if (!child || !this.running) return;
    const exited = new Promise((resolve) => child.once('exit', resolve));
    this.ending = true;
    if (this.paused) child.kill('SIGCONT');
    child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), 30_000);
    await exited;
    clearTimeout(timer);
  }

  async close(): Promise<void> {
    await this.kill();
    await new Promise<void>((resolve) => this.logFile.end(resolve));
  }
}

export class World {
  /** The application's pool: the load writes usage through it, the check reads through it. */
  pool!: pg.Pool;
  pg!: EmbeddedPg;
  temporal!: DevServer;
  stripe!: LocalStripe;
  api!: ProductProcess;
  workers: ProductProcess[] = [];
  apiUrl = '';
  readonly apiToken = `chaos_${randomBytes(24).toString('hex')}`;
  readonly stripeKey = `sk_test_chaos_${randomBytes(12).toString('hex')}`;
  readonly tenants: { tenantId: string; customer: string }[];
  private pgPort = 0;
  private temporalPort = 0;

  readonly opts: WorldOptions;
  private constructor(opts: WorldOptions) {
    this.opts = opts;
    this.tenants = Array.from({ length: opts.tenants }, (_, i) => ({ tenantId: `tenant-${i}`, customer: `cus_chaos_${i}` }));
  }

  static async start(opts: WorldOptions): Promise<World> {
    const w = new World(opts);
    await mkdir(opts.dir, { recursive: true });
    await w.startPostgres();
    await migrate(w.pg.url);
    // The harness's own statements name our tables unqualified: its pool (only) reads our schema first.
    const url = new URL(w.pg.url);
    url.searchParams.set('options', `-c search_path=${schemaFor().name}`);
    w.pool = createPool(url.toString(), 20);
    for (const t of w.tenants) {
      await w.pool.query('INSERT INTO billing_customers (tenant_id, stripe_customer_id) VALUES ($1, $2)', [t.tenantId, t.customer]);
    }
    await w.startTemporal();
    w.stripe = await LocalStripe.start({
      apiKey: w.stripeKey,
      meters: [...METERS],
      customers: w.tenants.map((t) => t.customer),
      // Stripe's v2 stream validates later, not at once.
      streamProcessingDelayMs: 200,
    });
    const env = () => productEnv(w);
    const apiPort = await freePort();
    w.apiUrl = `http://127.0.0.1:${apiPort}`;
    w.api = new ProductProcess('api', 'api.ts', () => ({
      ...env(),
      API_PORT: String(apiPort),
      API_TOKENS: JSON.stringify([{ name: 'chaos-load', token: w.apiToken, tenants: ['*'], scopes: ['usage:write'] }]),
    }), opts.dir);
    w.api.start();
    for (let i = 0; i < opts.workers; i++) {
      const worker = new ProductProcess(`worker-${i}`, 'worker.ts', env, opts.dir);
      worker.start();
      w.workers.push(worker);
    }
    await w.waitForApi(60_000);
    opts.say(`world up: PostgreSQL :${w.pgPort}, Temporal ${w.temporal.address}, Stripe ${w.stripe.url} (${opts.stripeApi}), API ${w.apiUrl}, ${opts.workers} workers`);
    return w;
  }

  /** The secrets that must never appear in any process's log. */
  secrets(): string[] {
    return [this.apiToken, this.stripeKey, new URL(this.pg.url).password, new URL(this.pg.adminUrl).password];
  }

  private async startPostgres(): Promise<void> {
    this.pg = await startEmbeddedPostgres({ dataDir: path.join(this.opts.dir, 'pg'), database: 'chaos', ...(this.pgPort ? { port: this.pgPort } : {}) });
    this.pgPort = this.pg.port;
  }

  private async startTemporal(): Promise<void> {
    this.temporal = await startTemporalDevServer({ dbFile: path.join(this.opts.dir, 'temporal.db'), ...(this.temporalPort ? { port: this.temporalPort } : {}) });
    this.temporalPort = Number(this.temporal.address.split(':').at(-1));
  }

  /** A fast shutdown (every connection cut), `downMs` away, then the same data folder and port. */
  async restartPostgres(downMs: number): Promise<void> {
    await this.pg.stop();
    await sleep(downMs);
    await this.startPostgres();
  }

  /** The dev server stopped, `downMs` away, then started on the same SQLite file and port. */
  async restartTemporal(downMs: number): Promise<void> {
    await this.temporal.stop();
    await sleep(downMs);
    await this.startTemporal();
  }

  async waitForApi(timeoutMs: number): Promise<void> {
    const until = Date.now() + timeoutMs;
    while (Date.now() < until) {
      // Any answer will do: /health may say a dependency is away, the process is up.
      const ok = await fetch(`${this.apiUrl}/health`).then(() => true, () => false);
      if (ok) return;
      await sleep(200);
    }
    throw new Error(`the API process did not answer on ${this.apiUrl} within ${timeoutMs} ms (see ${path.join(this.opts.dir, 'api.log')})`);
  }

  /** Every process running, Stripe answering normally: what a run ends with before its check. */
  heal(): void {
    this.stripe.applyFaults({ latencyMs: 0, refuseForSeconds: 0 });
    if (!this.api.running) this.api.start();
    for (const w of this.workers) if (!w.running) w.start();
  }

  async stop(): Promise<void> {
    await Promise.all([this.api, ...this.workers].map((p) => p?.close()));
    await this.pool?.end().catch(() => undefined);
    await this.stripe?.close();
    await this.temporal?.stop();
    await this.pg?.stop();
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
