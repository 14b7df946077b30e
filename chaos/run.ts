/**
 * One chaos run: start the world, run the application's load and the fault schedule side by side
 * for the window, heal everything, wait for the outbox to drain, and check the invariant.
 */
import { rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { runFaults, type AppliedFault } from './faults.js';
import { waitForDrain } from './drain.js';
import { checkInvariant, type InvariantTable } from './invariant.js';
import { Load, type LoadCounts } from './load.js';
import { countStripeRequests, type StripeRequestCount } from './requests.js';
import { Rng } from './rng.js';
import { World } from './world.js';

export interface ChaosOptions {
  seed: number;
  /** Usages the application commits. */
  events: number;
  /** Seconds of load and faults; the drain comes after. */
  durationS: number;
  workers: number;
  stripeApi: 'v1' | 'v2';
  tenants: number;
  /** Usages in the one big transaction (default: a quarter of `events`, at most 10,000). */
  burst?: number;
  /** Only these faults (names from chaos/faults.ts); default all. */
  faults?: string[];
  /** Where data and logs go; removed after a clean run unless `keep`. */
  dir: string;
  keep?: boolean;
  say?: (line: string) => void;
}

export interface ChaosResult {
  options: Omit<ChaosOptions, 'say'>;
  ok: boolean;
  table: InvariantTable;
  violations: string[];
  faults: AppliedFault[];
  load: LoadCounts;
  drainSeconds: number;
  totalSeconds: number;
  stripeRequests: StripeRequestCount;
}

export async function runChaos(opts: ChaosOptions): Promise<ChaosResult> {
  const say = opts.say ?? (() => undefined);
  const started = Date.now();
  const rng = new Rng(opts.seed);
  const world = await World.start({ dir: opts.dir, workers: opts.workers, stripeApi: opts.stripeApi, tenants: opts.tenants, say });
  let ok = false;
  try {
    const windowMs = opts.durationS * 1000;
    const load = new Load(world, rng.fork(), {
      events: opts.events,
      windowMs: windowMs * 0.8,
      burst: opts.burst ?? Math.min(10_000, Math.floor(opts.events / 4)),
      clients: 4,
    }, say);
    const faultRng = rng.fork();
    say(`seed ${opts.seed}: ${opts.events} usages over ${opts.durationS} s, faults throughout`);
    const [, faults] = await Promise.all([load.run(), runFaults(world, faultRng, windowMs, say, opts.faults)]);

    say('faults over: healing and draining');
    world.heal();
    const drainStarted = Date.now();
    await drain(world, Math.max(300_000, opts.events * 100), say);
    const drainSeconds = Math.round((Date.now() - drainStarted) / 100) / 10;

    const { table, violations } = await checkInvariant(world, load, opts.dir);
    // A process of the product that ended by itself (no fault ended it) is a crash, whatever the
    // outbox says afterwards: the other processes may have covered for it.
    violations.push(...[world.api, ...world.workers].flatMap((p) => p.exitsOnItsOwn));
    ok = violations.length === 0;
    const { say: _say, ...options } = opts;
    const result: ChaosResult = {
      options,
      ok,
      table,
      violations,
      faults,
      load: load.counts,
      drainSeconds,
      totalSeconds: Math.round((Date.now() - started) / 1000),
      stripeRequests: countStripeRequests(world.stripe, opts.stripeApi, table.recorded),
    };
    await writeFile(path.join(opts.dir, 'result.json'), JSON.stringify(result, null, 2));
    return result;
  } finally {
    await world.stop();
    if (ok && !opts.keep) await rm(opts.dir, { recursive: true, force: true });
  }
}

/** Waits until no row is pending, claimed or dispatched, saying where it stands every 10 s. */
async function drain(world: World, timeoutMs: number, say: (line: string) => void): Promise<void> {
  let lastSaid = 0;
  let unfinished = 0;
  const drained = await waitForDrain(world.pool, {
    timeoutMs,
    onProgress: (p) => {
      unfinished = p.unfinished;
      if (Date.now() - lastSaid < 10_000) return;
      lastSaid = Date.now();
      say(`drain: ${Object.entries(p.counts).filter(([, n]) => n > 0).map(([status, n]) => `${status} ${n}`).join(', ')}`);
    },
  });
  if (!drained) say(`drain: gave up after ${timeoutMs / 1000} s with ${unfinished} rows unfinished`);
}
