/**
 * `npm run chaos -- --seed S --events N --duration D`: the product as deployed (an API process,
 * worker processes hosting the relays and the deliveries, PostgreSQL, Temporal, a Stripe-compatible
 * server) under the application's load and a seeded schedule of real faults; then the invariant
 * table. Exits 1 on any violation, keeping the run's folder (data and every process's log).
 *
 *   --seed S         schedule and usage are drawn from it (default: random, printed)
 *   --events N       usages the application commits (default 2000)
 *   --duration D     seconds of load and faults, before the drain (default 90)
 *   --workers W      worker processes (default 2)
 *   --stripe-api v1|v2   (default v1)
 *   --tenants T      tenants, each its own Stripe customer; tenant-0 is hot (default 8)
 *   --burst B        usages in the one big transaction (default events/4, at most 10,000)
 *   --faults a,b     only these faults (default all; names in chaos/faults.ts)
 *   --dir PATH       where data and logs go (default .data/chaos/<seed>)
 *   --keep           keep the folder after a clean run
 */
import { randomInt } from 'node:crypto';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { PROJECT_ROOT } from '../src/embedded/temporal.js';
import { FAULTS } from './faults.js';
import { formatTable } from './invariant.js';
import { runChaos } from './run.js';

const { values } = parseArgs({
  options: {
    seed: { type: 'string' },
    events: { type: 'string', default: '2000' },
    duration: { type: 'string', default: '90' },
    workers: { type: 'string', default: '2' },
    'stripe-api': { type: 'string', default: 'v1' },
    tenants: { type: 'string', default: '8' },
    burst: { type: 'string' },
    faults: { type: 'string' },
    dir: { type: 'string' },
    keep: { type: 'boolean', default: false },
  },
  strict: true,
});

function positiveInt(name: string, raw: string | undefined, max: number): number {
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 1 || n > max) {
    console.error(`--${name} must be a whole number from 1 to ${max}, got ${JSON.stringify(raw)}`);
    process.exit(2);
  }
  return n;
}

const stripeApi = values['stripe-api'];
if (stripeApi !== 'v1' && stripeApi !== 'v2') {
  console.error(`--stripe-api must be v1 or v2, got ${JSON.stringify(stripeApi)}`);
  process.exit(2);
}
const faults = values.faults?.split(',').map((f) => f.trim()).filter(Boolean);
const unknown = faults?.filter((f) => !FAULTS.some((k) => k.name === f)) ?? [];
if (unknown.length > 0) {
  console.error(`unknown fault(s): ${unknown.join(', ')}; known: ${FAULTS.map((f) => f.name).join(', ')}`);
  process.exit(2);
}
const seed = values.seed === undefined ? randomInt(1, 2 ** 31 - 1) : positiveInt('seed', values.seed, 2 ** 31 - 1);
const started = Date.now();
const say = (line: string) => console.log(`[chaos +${String(Math.round((Date.now() - started) / 1000)).padStart(4)}s] ${line}`);

const result = await runChaos({
  seed,
  events: positiveInt('events', values.events, 1_000_000),
  durationS: positiveInt('duration', values.duration, 86_400),
  workers: positiveInt('workers', values.workers, 16),
  stripeApi,
  tenants: positiveInt('tenants', values.tenants, 1_000),
  ...(values.burst !== undefined ? { burst: positiveInt('burst', values.burst, 1_000_000) } : {}),
  ...(faults ? { faults } : {}),
  dir: path.resolve(values.dir ?? path.join(PROJECT_ROOT, '.data', 'chaos', String(seed))),
  keep: values.keep,
  say,
});

const survived = new Map<string, number>();
for (const f of result.faults) survived.set(f.name, (survived.get(f.name) ?? 0) + 1);
console.log(`\nchaos seed ${seed}, ${result.options.stripeApi}, ${result.options.workers} workers: ${result.totalSeconds} s (drain ${result.drainSeconds} s)`);
console.log(`faults injected (${result.faults.length}): ${[...survived].map(([n, c]) => `${n} ×${c}`).join(', ')}`);
console.log(`load: ${JSON.stringify(result.load)}`);
const r = result.stripeRequests;
console.log(
  `Stripe requests (${r.api === 'v2' ? 'stream' : 'meter-event calls'}): ${r.requests} (${r.failed} failed or unanswered) for ${r.recorded} events recorded: ` +
    `${r.perEvent} per event${r.api === 'v2' ? " (the aim for v2 under faults: ≤ 0.2)" : ''}`,
);
console.log(formatTable(result.table));
if (result.ok) {
  console.log('\nOK: no event lost, none billed twice, every row settled.');
} else {
  console.log(`\nVIOLATIONS (${result.violations.length}):`);
  for (const v of result.violations) console.log(`  - ${v}`);
  console.log(`data and logs kept in ${result.options.dir}; run again with --seed ${seed}`);
  process.exitCode = 1;
}
