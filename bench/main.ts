/**
 * `npm run bench -- <name> [options]`: reproducible figures on real PostgreSQL and a real Temporal
 * dev server (both started here, embedded) with the local Stripe-compatible server. Each prints a
 * table and writes its figures to bench/results/. Compare figures from one run on one machine.
 *
 *   request-path   a bare usage-insert transaction vs the same with recordUsage (≥ 10,000 each)
 *   ceiling        bare workflow shapes vs billing-outbox draining the same number of events
 *   drain          billing-outbox alone draining a backlog (--customers, --latency, --events)
 */
import { parseArgs } from 'node:util';
import { ceiling, drainOnce } from './ceiling.js';
import { newReport, publish, startServices } from './harness.js';
import { requestPath } from './request-path.js';

const [name, ...rest] = process.argv.slice(2);
const { values } = parseArgs({
  args: rest,
  options: {
    events: { type: 'string', default: '2000' },
    starters: { type: 'string', default: '100' },
    customers: { type: 'string', default: '100' },
    latency: { type: 'string', default: '30' },
  },
});
const num = (v: string | undefined) => Number(v);

const benches: Record<string, (services: Awaited<ReturnType<typeof startServices>>) => Promise<void>> = {
  async ceiling(services) {
    const report = newReport('ceiling');
    await ceiling(services, report, {
      events: num(values.events),
      starters: num(values.starters),
      customers: num(values.customers),
      latencyMs: num(values.latency),
    });
    await publish(report);
  },
  async 'request-path'(services) {
    const report = newReport('request-path');
    await requestPath(services, report, { events: Math.max(num(values.events), 10_000) });
    await publish(report);
  },
  async drain(services) {
    const report = newReport('drain');
    await drainOnce(services, report, { events: num(values.events), customers: num(values.customers), latencyMs: num(values.latency) });
    await publish(report);
  },
};

if (!name || !benches[name]) {
  console.error(`usage: npm run bench -- <${Object.keys(benches).join('|')}> [--events N] [--customers N] [--latency MS]`);
  process.exit(2);
}
const services = await startServices();
try {
  await benches[name](services);
} finally {
  await services.stop();
}
