/**
 * The faults a chaos run injects, each a real one: Stripe misbehaving (through the local server's
 * fault hooks), and the product's processes and servers killed, paused and restarted as an
 * operating system, a deploy or an outage would.
 *
 * The schedule deals the catalogue like cards: every fault once, in an order drawn from the seed,
 * then again reshuffled; so a run long enough for one round has met every fault.
 */
import type { Rng } from './rng.js';
import { sleep, type World } from './world.js';

export interface Fault {
  name: string;
  /** Does what it says and resolves when the fault is over (or has been set loose, for queued Stripe faults). */
  run(world: World, rng: Rng): Promise<string>;
}

const STRIPE_TIMEOUT_MS = 1_500;

export const FAULTS: readonly Fault[] = [
  {
    name: 'stripe-outage',
    async run(world, rng) {
      // Longer than several backoff steps (200 ms, ×2, capped at 2 s).
      const seconds = rng.int(4, 12);
      world.stripe.refuseFor(seconds);
      await sleep(seconds * 1000);
      return `Stripe refused every connection for ${seconds} s`;
    },
  },
  {
    name: 'stripe-5xx-burst',
    async run(world, rng) {
      const n = rng.int(5, 40);
      const status = rng.pick([500, 502, 503]);
      world.stripe.failNext(n, status);
      return `the next ${n} Stripe calls answer ${status}`;
    },
  },
  {
    name: 'stripe-429',
    async run(world, rng) {
      const n = rng.int(5, 30);
      world.stripe.failNext(n, 429, { retryAfterSeconds: 1 });
      return `the next ${n} Stripe calls answer 429 with Retry-After: 1`;
    },
  },
  {
    name: 'stripe-slower-than-timeout',
    async run(world, rng) {
      const ms = rng.int(3_000, 8_000);
      world.stripe.setLatency(STRIPE_TIMEOUT_MS + 500);
      await sleep(ms);
      world.stripe.setLatency(0);
      return `Stripe answered ${STRIPE_TIMEOUT_MS + 500} ms late (client timeout ${STRIPE_TIMEOUT_MS} ms) for ${ms} ms`;
    },
  },
  {
    name: 'stripe-recorded-then-dropped',
    async run(world, rng) {
      const n = rng.int(1, 10);
      world.stripe.dropAfterRecord(n);
      return `the next ${n} Stripe calls are recorded, then their connection dropped`;
    },
  },
  {
    name: 'stripe-malformed-body',
    async run(world, rng) {
      const n = rng.int(1, 10);
      world.stripe.garbleNext(n);
      return `the next ${n} Stripe calls are processed, then answered 200 with a malformed body`;
    },
  },
  {
    name: 'sigkill-worker',
    async run(world, rng) {
      const worker = rng.pick(world.workers);
      await worker.kill();
      const down = rng.int(0, 3_000);
      await sleep(down);
      worker.start();
      return `${worker.name} SIGKILLed (mid-activity or in its LISTEN wait), back after ${down} ms`;
    },
  },
  {
    name: 'sigkill-workers-after-claim',
    async run(world, rng) {
      // Wait for rows a relay has claimed and not yet handed to a workflow, then kill every worker:
      // whichever hosted that relay activity dies between claim and start.
      const until = Date.now() + 10_000;
      let claimed = 0;
      while (Date.now() < until) {
        claimed = await world.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status = 'claimed'`).then((r) => r.rows[0]!.n, () => 0);
        if (claimed > 0) break;
        await sleep(5);
      }
      await Promise.all(world.workers.map((w) => w.kill()));
      const down = rng.int(500, 3_000);
      await sleep(down);
      for (const w of world.workers) w.start();
      return `every worker SIGKILLed with ${claimed} rows claimed and not yet started, back after ${down} ms`;
    },
  },
  {
    name: 'worker-paused-past-its-leases',
    async run(world, rng) {
      const worker = rng.pick(world.workers);
      // Past the relay lease (5 s) and the activity heartbeat timeout (10 s): its claims and
      // activities are taken over meanwhile, then it wakes up and carries on where it was.
      const ms = rng.int(11_000, 14_000);
      await worker.pause(ms);
      return `${worker.name} SIGSTOPped for ${ms} ms, then SIGCONT`;
    },
  },
  {
    name: 'rolling-deploy',
    async run(world) {
      for (const w of world.workers) {
        await w.stop();
        w.start();
      }
      return 'every worker stopped with SIGTERM (drained) and started again, one after the other';
    },
  },
  {
    name: 'sigkill-api',
    async run(world, rng) {
      await world.api.kill();
      const down = rng.int(500, 2_000);
      await sleep(down);
      world.api.start();
      await world.waitForApi(30_000);
      return `the API process SIGKILLed mid-requests, back after ${down} ms`;
    },
  },
  {
    name: 'restart-postgres',
    async run(world, rng) {
      const down = rng.int(1_000, 5_000);
      await world.restartPostgres(down);
      return `PostgreSQL stopped (fast shutdown: every connection cut) and started again after ${down} ms`;
    },
  },
  {
    name: 'restart-temporal',
    async run(world, rng) {
      const down = rng.int(1_000, 5_000);
      await world.restartTemporal(down);
      return `the Temporal server stopped and started again on the same file after ${down} ms`;
    },
  },
];

export interface AppliedFault {
  name: string;
  atMs: number;
  tookMs: number;
  what: string;
}

/**
 * Injects faults one after another, a seeded pause between them, until `windowMs` has passed and
 * every fault of the catalogue has run at least once (a short window is stretched to one round).
 */
export async function runFaults(world: World, rng: Rng, windowMs: number, say: (line: string) => void, only?: readonly string[]): Promise<AppliedFault[]> {
  const catalogue = only ? FAULTS.filter((f) => only.includes(f.name)) : FAULTS;
  const started = Date.now();
  const applied: AppliedFault[] = [];
  let deck: Fault[] = [];
  let rounds = 0;
  for (;;) {
    await sleep(rng.int(1_000, 3_000));
    const roundDone = rounds > 1 || (rounds === 1 && deck.length === 0);
    if (Date.now() - started >= windowMs && roundDone) return applied;
    if (deck.length === 0) {
      deck = shuffle([...catalogue], rng);
      rounds++;
    }
    const fault = deck.shift()!;
    const at = Date.now();
    const what = await fault.run(world, rng);
    const entry = { name: fault.name, atMs: at - started, tookMs: Date.now() - at, what };
    applied.push(entry);
    say(`fault @${(entry.atMs / 1000).toFixed(1)}s ${fault.name}: ${what}`);
  }
}

function shuffle<T>(items: T[], rng: Rng): T[] {
  for (let i = items.length - 1; i > 0; i--) {
    const j = rng.int(0, i);
    [items[i], items[j]] = [items[j]!, items[i]!];
  }
  return items;
}
