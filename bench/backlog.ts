/**
 * `npm run bench -- backlog`: a backlog after an outage, drained: 20,000 events (by default) with 1,
 * 5 and 100 customers, on Stripe's v1 meter events and on the v2 stream, Stripe answering in
 * 30 ms. Per run: events per second, time to drain, Stripe requests per event, the most events
 * claimed or in flight at once, and the CPU each process spent per event.
 */
import { drainOnce } from './ceiling.js';
import type { Report, Services } from './harness.js';

export async function backlog(services: Services, report: Report, opts: { events: number; latencyMs: number; customers: number[]; apis: ('v1' | 'v2')[] }): Promise<void> {
  for (const api of opts.apis) {
    for (const customers of opts.customers) {
      await drainOnce(services, report, {
        events: opts.events,
        customers,
        latencyMs: opts.latencyMs,
        label: `${api}, ${customers} customer${customers === 1 ? '' : 's'}`,
        env: { STRIPE_METER_API: api },
      });
    }
  }
  report.notes.push(`Stripe latency ${opts.latencyMs} ms; LANE_MAX_IN_FLIGHT 4 (v1), 100 (v2); STRIPE_RATE_LIMIT_PER_SECOND 5000 (not binding)`);
}
