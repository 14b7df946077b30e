/**
 * The README's two programs ("Using it from your application"), run as written: taken from the
 * README, their `billing-outbox…` imports pointed at this checkout's sources, each in a Node
 * process of its own against the file's database, the shared Temporal dev server and a local
 * Stripe. Only the fixed port becomes a free one, the task queue one of its own (several test
 * files and runs share the machine and the Temporal server: a relay on a shared queue is shared), the
 * job's id one of its own (a workflow id is the idempotency key, and Temporal's namespace is shared
 * too: test/schema.test.ts also bills acme's job-1, and a second start of that id meets its closed
 * run, so the row is dead, rightly, instead of sent), and
 * the worker is given the run's workflow bundle (installed, it uses the one the package ships; from
 * this checkout it would run webpack at start, over a minute while the rest of the suite runs).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Client, Connection } from '@temporalio/client';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { idempotencyKeyFor, useStripe, waitFor } from './hooks.js';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const DIR = path.join(ROOT, '.data', `readme-${randomUUID().slice(0, 8)}`);
const t = useStripe({ customers: { acme: 'cus_acme' }, stripe: { meters: ['api_requests'] } });
const children: ChildProcess[] = [];
const TASK_QUEUE = `readme-${randomUUID().slice(0, 8)}`;
const JOB = `job-${randomUUID().slice(0, 8)}`;

/** The README's program whose first line is `// <name>`, runnable from this checkout. */
async function program(name: string): Promise<string> {
  const readme = await readFile(path.join(ROOT, 'README.md'), 'utf8');
  const block = [...readme.matchAll(/```js\n([\s\S]*?)```/g)].map((m) => m[1]!).find((code) => code.startsWith(`// ${name}\n`));
  if (!block) throw new Error(`README.md has no program ${name}`);
  const source = (file: string) => `'${path.join(ROOT, 'src', file)}'`;
  const code = block
    .replace("from 'billing-outbox/worker'", `from ${source('worker.ts')}`)
    .replace("from 'billing-outbox/fastify'", `from ${source('fastify.ts')}`)
    .replace("from 'billing-outbox'", `from ${source('index.ts')}`)
    .replace(/port: \d+/, 'port: 0')
    .replaceAll("'job-1'", `'${JOB}'`)
    .replace("taskQueue: 'billing-outbox'", `taskQueue: '${TASK_QUEUE}', workflowBundle: { codePath: ${JSON.stringify(inject('workflowBundlePath'))} }`);
  const file = path.join(DIR, name);
  await writeFile(file, code);
  return file;
}

function run(file: string, env: Record<string, string>): { child: ChildProcess; output: () => string; exited: Promise<number | null> } {
  const child = spawn(process.execPath, ['--import', 'tsx', file], { cwd: DIR, env: { PATH: process.env.PATH ?? '', ...env } });
  children.push(child);
  let output = '';
  child.stdout!.on('data', (d: Buffer) => (output += d.toString()));
  child.stderr!.on('data', (d: Buffer) => (output += d.toString()));
  const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => resolve(code)));
  return { child, output: () => output, exited };
}

beforeAll(async () => {
  await mkdir(DIR, { recursive: true });
});

afterAll(async () => {
  for (const c of children) if (c.exitCode === null) c.kill('SIGKILL');
  // The README's worker leaves its relay workflows on the task queue it names: ended here.
  const connection = await Connection.connect({ address: inject('temporalAddress') });
  const client = new Client({ connection });
  for await (const wf of client.workflow.list({ query: `TaskQueue = "${TASK_QUEUE}" AND ExecutionStatus = "Running"` })) {
    await client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
  }
  await connection.close();
  await rm(DIR, { recursive: true, force: true });
});

describe("the README's programs", () => {
  it('app.mjs records a job with its usage, its own worker delivers it, and SIGTERM ends it cleanly', async () => {
    const app = run(await program('app.mjs'), {
      DATABASE_URL: t.db.url,
      TEMPORAL_ADDRESS: inject('temporalAddress'),
      STRIPE_API_KEY: 'sk_test_readme',
      STRIPE_API_BASE: t.stripe.url,
    });
    const key = idempotencyKeyFor('acme', JOB);
    await waitFor(`${key} sent`, async () => (await t.row(key))?.status === 'sent', 100_000).catch((err: Error) => {
      throw new Error(`${err.message}; the program said: ${app.output()}`);
    });
    expect(t.eventsFor(key)).toHaveLength(1);
    expect((await t.pool.query('SELECT tokens FROM public.jobs WHERE id = $1', [JOB])).rows).toEqual([{ tokens: 120 }]);
    app.child.kill('SIGTERM');
    expect(await app.exited, app.output()).toBe(0);
  }, 150_000);

  it('server.mjs serves its own route and POST /billing/v1/usage with the token, and closes on SIGTERM', async () => {
    const token = `tok_${randomUUID().replace(/-/g, '')}`;
    const server = run(await program('server.mjs'), { DATABASE_URL: t.db.url, BILLING_API_TOKEN: token });
    const base = await waitFor('the server to listen', async () => /Server listening at (http:\/\/127\.0\.0\.1:\d+)/.exec(server.output())?.[1], 60_000);
    expect(await (await fetch(`${base}/hello`)).json()).toEqual({ hello: 'world' });
    const body = JSON.stringify({ tenant_id: 'acme', usage_id: 'req-1', quantity: 3 });
    const headers = { 'content-type': 'application/json' };
    expect((await fetch(`${base}/billing/v1/usage`, { method: 'POST', headers, body })).status).toBe(401);
    const created = await fetch(`${base}/billing/v1/usage`, { method: 'POST', headers: { ...headers, authorization: `Bearer ${token}` }, body });
    expect(created.status).toBe(201);
    expect((await t.row(idempotencyKeyFor('acme', 'req-1')))?.quantity).toBe(3);
    server.child.kill('SIGTERM');
    expect(await server.exited, server.output()).toBe(0);
  });
});
