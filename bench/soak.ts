/**
 * `npm run bench -- soak`: the API and a worker as their own processes, usage posted over HTTP at a
 * steady rate for `--seconds` (600 by default), and the resident memory (RSS) of both sampled every
 * 15 s. Flat means no leak; the table shows every sample, the notes the growth from the first
 * sample after warm-up to the last.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes, randomUUID } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { freePort } from '../src/embedded/postgres.js';
import { countSent, freshDatabase, onSchedule, startStripeProcess, waitUntil, type Report, type Services } from './harness.js';

async function rssMb(pid: number): Promise<number> {
  const status = await readFile(`/proc/${pid}/status`, 'utf8');
  const kb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? NaN);
  return Math.round(kb / 102.4) / 10;
}

export async function soak(services: Services, report: Report, opts: { seconds: number; rate: number; customers: number; latencyMs: number }): Promise<void> {
  const db = await freshDatabase(services, opts.customers);
  const stripe = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
  const token = `soak_${randomBytes(24).toString('hex')}`;
  const apiPort = await freePort();
  const env = {
    ...process.env,
    DATABASE_URL: db.url,
    TEMPORAL_ADDRESS: services.temporal.address,
    TEMPORAL_TASK_QUEUE: `soak-${randomUUID()}`,
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_soak',
    STRIPE_RATE_LIMIT_PER_SECOND: '5000',
    API_PORT: String(apiPort),
    API_TOKENS: JSON.stringify([{ name: 'soak', token, tenants: ['*'], scopes: ['usage:write'] }]),
    LOG_LEVEL: 'warn',
  };
  const start = (entry: string) =>
    spawn(process.execPath, ['--import', 'tsx', path.join(import.meta.dirname, '..', 'src', 'bin', entry)], { env, stdio: ['ignore', 'ignore', 'inherit'] });
  const children: ChildProcess[] = [start('worker.ts'), start('api.ts')];
  const [worker, api] = children as [ChildProcess, ChildProcess];
  try {
    await waitUntil('the API', async () => fetch(`http://127.0.0.1:${apiPort}/health`).then((r) => r.ok, () => false), 120_000, 500);
    let posted = 0;
    let failed = 0;
    const started = performance.now();
    const samples: { second: number; apiRssMb: number; workerRssMb: number; delivered: number }[] = [];
    const sampler = setInterval(() => {
      void (async () => {
        samples.push({ second: Math.round((performance.now() - started) / 1000), apiRssMb: await rssMb(api.pid!), workerRssMb: await rssMb(worker.pid!), delivered: await countSent(db.pool) });
      })();
    }, 15_000);
    try {
      const total = opts.rate * opts.seconds;
      await onSchedule(
        total,
        opts.rate,
        async (i) => {
          const res = await fetch(`http://127.0.0.1:${apiPort}/v1/usage`, {
            method: 'POST',
            headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
            body: JSON.stringify({ tenant_id: `t${(i % opts.customers) + 1}`, usage_id: `soak-${i}`, quantity: 1 }),
          }).catch(() => undefined);
          if (res?.status === 201) posted++;
          else failed++;
        },
        started,
      );
    } finally {
      clearInterval(sampler);
    }
    await waitUntil('the last events', async () => (await countSent(db.pool)) >= posted, 120_000, 500);
    report.rows.push(...samples);
    const warm = samples.find((s) => s.second >= 60) ?? samples[0];
    const last = samples.at(-1);
    if (warm && last) {
      report.notes.push(
        `RSS from ${warm.second} s to ${last.second} s: API ${warm.apiRssMb} → ${last.apiRssMb} MB, worker ${warm.workerRssMb} → ${last.workerRssMb} MB`,
      );
    }
    report.notes.push(`${posted} usages posted over HTTP at ${opts.rate}/s for ${opts.seconds} s (${failed} failed), all delivered`);
  } finally {
    for (const c of children) if (c.exitCode === null) c.kill('SIGTERM');
    await stripe.stop();
    await db.pool.end();
  }
}
