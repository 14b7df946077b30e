/**
 * `npx tsx bench/import.ts [--lines N] [--batch-size N] [--again] [--compare N]`: `billing-outbox
 * import` of a generated JSON-lines file of N usages (default 1,000,000; 100 tenants, all mapped,
 * stamped within the last day) into a fresh embedded PostgreSQL. The import runs as its own process
 * (the CLI through tsx, as `npx billing-outbox` runs in a checkout) under /usr/bin/time -v, so its
 * peak RSS is the import's alone; its wall time includes the CLI's start (measured apart, `--help`).
 * --again imports the file a second time (nothing added). --heap-mb N caps the import's V8 heap
 * (--max-old-space-size): an import that holds more than a batch would fail under a small cap. --compare N first records N usages in
 * this process twice, through importUsage and through recordUsage once per usage (both N/1000
 * transactions of 1,000): the rejected alternative of src/outbox/sql/import.ts. Only PostgreSQL
 * (embedded); nothing else is started.
 */
import { spawn } from 'node:child_process';
import { createWriteStream } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { once } from 'node:events';
import { parseArgs } from 'node:util';
import { createPool, migrate, withTransaction } from '../src/db.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { importUsage } from '../src/ops/import.js';

const { values } = parseArgs({
  options: { lines: { type: 'string', default: '1000000' }, 'batch-size': { type: 'string', default: '1000' }, again: { type: 'boolean' }, 'heap-mb': { type: 'string' }, compare: { type: 'string', default: '0' } },
});
const LINES = Number(values.lines);
const TENANTS = 100;

const tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-import-'));
// PostgreSQL runs as its own user when started by root: it must be able to enter the folder.
await chmod(tmp, 0o755);
const server = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'postgres', persistent: false });

async function writeFile(file: string): Promise<void> {
  const out = createWriteStream(file);
  const now = Date.now();
  for (let i = 1; i <= LINES; i++) {
    const line = `${JSON.stringify({ tenant_id: `t${i % TENANTS}`, usage_id: `u-${i}`, quantity: 1 + (i % 9), occurred_at: new Date(now - 60_000 - (i % 86_400) * 1_000).toISOString() })}\n`;
    if (!out.write(line)) await once(out, 'drain');
  }
  out.end();
  await once(out, 'finish');
}

/** Runs the CLI's import under /usr/bin/time -v; returns its wall time, peak RSS and its output. */
async function runImport(url: string, file: string): Promise<{ ms: number; peakRssMb: number; out: string }> {
  const started = performance.now();
  const child = spawn('/usr/bin/time', ['-v', process.execPath, ...(values['heap-mb'] ? [`--max-old-space-size=${values['heap-mb']}`] : []), '--import', 'tsx', 'src/bin/cli.ts', 'import', file, '--batch-size', values['batch-size']!], {
    env: { ...process.env, DATABASE_URL: url },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  let err = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  const [code] = (await once(child, 'exit')) as [number];
  const ms = performance.now() - started;
  const rss = /Maximum resident set size \(kbytes\): (\d+)/.exec(err);
  if (code !== 0 || !rss) throw new Error(`import exited ${code}:\n${out}\n${err}`);
  return { ms, peakRssMb: Math.round(Number(rss[1]) / 1024), out: out.trim() };
}

try {
  const url = await server.createDatabase('import_bench');
  await migrate(url);
  const pool = createPool(url, 1);
  await pool.query(`INSERT INTO ${schemaFor().billingCustomers} (tenant_id, stripe_customer_id) SELECT 't' || g, 'cus_' || g FROM generate_series(0, $1::int - 1) g`, [TENANTS]);
  await pool.end();
  const file = path.join(tmp, 'usage.jsonl');
  await writeFile(file);

  const compare = Number(values.compare);
  if (compare > 0) {
    const pool2 = createPool(url, 2);
    const usage = (prefix: string, i: number) => ({ tenantId: `t${i % TENANTS}`, usageId: `${prefix}-${i}`, quantity: 1, occurredAt: new Date(Date.now() - 60_000) });
    let started = performance.now();
    await importUsage(pool2, (function* () {
      for (let i = 0; i < compare; i++) yield usage('batched', i);
    })());
    const batchedMs = performance.now() - started;
    started = performance.now();
    for (let from = 0; from < compare; from += 1_000) {
      await withTransaction(pool2, async (c) => {
        for (let i = from; i < Math.min(compare, from + 1_000); i++) await recordUsage(c, usage('one-by-one', i));
      });
    }
    const oneByOneMs = performance.now() - started;
    await pool2.end();
    process.stdout.write(`in process, ${compare} usages: importUsage ${Math.round(compare / (batchedMs / 1000))}/s, recordUsage one at a time ${Math.round(compare / (oneByOneMs / 1000))}/s\n`);
  }

  const startMs = performance.now();
  await once(spawn(process.execPath, ['--import', 'tsx', 'src/bin/cli.ts', 'import', '--help'], { stdio: 'ignore' }), 'exit');
  process.stdout.write(`the CLI's start (import --help): ${((performance.now() - startMs) / 1000).toFixed(1)} s\n`);

  for (const run of values.again ? ['first import', 'again (nothing added)'] : ['first import']) {
    const r = await runImport(url, file);
    process.stdout.write(`${run}${values['heap-mb'] ? ` (heap capped at ${values['heap-mb']} MB)` : ''}: ${LINES} lines in ${(r.ms / 1000).toFixed(1)} s = ${Math.round(LINES / (r.ms / 1000))} lines/s, peak RSS ${r.peakRssMb} MB\n  ${r.out.replace(file, 'usage.jsonl')}\n`);
  }
} finally {
  await server.stop();
  await rm(tmp, { recursive: true, force: true });
}
