/**
 * PostgreSQL failing over under a busy worker: the connections it had go silent (no answer, no
 * reset: the old server's address is gone) while new ones reach the new server. Nothing may wait on
 * a silent connection for long: each statement of a delivery or a claim unanswered for
 * `statementAnswerMs` (5 s) is taken for PostgreSQL away and its connection dropped, so the event
 * whose Stripe call was under way, those in flight and those committed after are billed once each,
 * none dead, and no attempt is spent on it (measured: all billed 12.5 s after the failover, 43.8 s
 * before the timeout, when each hung delivery failed an attempt at its attempt timeout), in v1 and
 * v2, busy, quiet, and with the new server slow to answer (a connection opened meanwhile gives up
 * after CONNECT_WAIT_MS, 10 s, instead of waiting for good). (v2's batcher pace has the same limit:
 * one pace statement hung there would hold every request of the worker's batcher. Which statement
 * meets which silent connection is not ours to choose here, and in these runs the pace never met
 * one: no test fails without that limit.)
 * The worker's maintenance gives up after `maintenanceAnswerMs` and goes on (the
 * closed-run sweep waited for good before), and a stopped worker exits (half-closed silent sockets
 * kept its process alive). The API's requests are answered 503 (the client tries again) instead of
 * hanging on a silent connection.
 */
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import type pg from 'pg';
import { afterAll, expect, inject, it, onTestFinished } from 'vitest';
import { operatorPool } from '../src/cli/context.js';
import { runCli } from '../src/cli/run.js';
import { freePort } from '../src/embedded/postgres.js';
import { BEGIN_SHORT, createPool, IDLE_IN_TRANSACTION_MS, withTransaction } from '../src/db.js';
import { beginClaim, claimBatch } from '../src/outbox/sql/relay.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { createStripeClient } from '../src/stripe/client.js';
import { startWorker } from '../src/temporal/worker.js';
import { TemporalErrorCodes } from '../workflows/shared.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { cleanUpAway, failingOver, startProcess, untilSaid } from './away.js';
import { workflowBundle } from './helpers.js';
import { usePipeline, waitFor } from './hooks.js';

const ENV = { STRIPE_API_KEY: 'sk_test_failover', RELAY_COUNT: '1', LOG_LEVEL: 'info' };
const TENANTS = Array.from({ length: 10 }, (_, i) => `t${i}`);
const t = usePipeline({ customers: Object.fromEntries(TENANTS.map((id) => [id, `cus_${id}`])), stripe: { meters: ['api_requests'] }, env: ENV, worker: false });
afterAll(cleanUpAway);

const statusOf = async (key: string) => (await t.pool.query<{ status: string }>('SELECT status FROM outbox WHERE idempotency_key = $1', [key])).rows[0]?.status;

it.each(['v1', 'v2'])('a running worker (%s) whose PostgreSQL connections go silent carries on over new ones: nothing lost, nothing billed twice, nothing dead', async (meterApi) => {
  // What Stripe's answer makes the row: v1's endpoint billed it, v2's stream took it.
  const delivered = meterApi === 'v1' ? 'sent' : 'accepted';
  const proxy = await failingOver(t.db.url);
  const worker = startProcess({
    ...ENV,
    STRIPE_METER_API: meterApi,
    DATABASE_URL: proxy.url,
    TEMPORAL_ADDRESS: inject('temporalAddress'),
    TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue,
    STRIPE_API_BASE: t.stripe.url,
  });
  // A failure below must not leave it running: it would take the next tests' events on this task queue.
  onTestFinished(() => void worker.child.kill('SIGKILL'));
  await untilSaid(worker, 'worker running', 90_000);
  const record = async (usageId: string, tenantId = 't0') => (await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId, quantity: 5 }))).entry.idempotencyKey;
  const warm = await record(`failover-warm-${randomUUID()}`);
  await waitFor('the first event billed', async () => t.stripe.events().some((e) => e.identifier === warm), 60_000);

  t.stripe.setLatency(2_000);
  const inFlight = await record(`failover-in-flight-${randomUUID()}`);
  // v1: a call for it, answered in 2 s; v2: a stream request holding it, answered in 2 s.
  const underWay = () => (meterApi === 'v1' ? t.stripe.callsInFlight() > 0 : t.stripe.streamRequests().some((r) => r.identifiers.includes(inFlight)));
  await waitFor('its Stripe call under way', async () => underWay(), 30_000);
  // Busy: every connection of the worker's pool opened and in use.
  const busy: string[] = [];
  for (let i = 0; i < 40; i++) busy.push(await record(`failover-busy-${i}-${randomUUID()}`, TENANTS[i % TENANTS.length]));
  await new Promise((r) => setTimeout(r, 1_000));
  proxy.failOver();
  expect(proxy.silenced()).toBeGreaterThan(0);
  const after: string[] = [];
  for (let i = 0; i < 3; i++) after.push(await record(`failover-after-${i}-${randomUUID()}`));
  t.stripe.setLatency(0);

  const delivery = async (key: string) => {
    await waitFor(`${key} delivered`, async () => (await statusOf(key)) === delivered || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 180_000).catch((err: unknown) => {
      console.log('WORKER OUTPUT', worker.output().split('\n').filter((l) => !l.includes('acknowledged')).slice(-80).join('\n'));
      throw err;
    });
    expect(t.stripe.events().filter((e) => e.identifier === key)).toHaveLength(1);
  };
  for (const key of [inFlight, ...busy, ...after]) await delivery(key);

  // Failing over again while the worker is quiet: its pool's idle connections, all silent now, are
  // what the next events' statements get first, one after the other (the v2 batcher's pace too).
  const silencedBefore = proxy.silenced();
  proxy.failOver();
  expect(proxy.silenced()).toBeGreaterThan(silencedBefore);
  const quiet: string[] = [];
  for (let i = 0; i < 3; i++) quiet.push(await record(`failover-quiet-${i}-${randomUUID()}`, TENANTS[i]));
  for (const key of quiet) await delivery(key);

  // v1, once more, with the new server slow to answer: the connections opened in its first 8 s
  // (the silent ones' replacements) never get an answer to their start-up. Each gives up after
  // CONNECT_WAIT_MS and the next one gets through; before, each waited for good, and the delivery
  // or the claim on it with it. (Opening a connection is the same in both modes: v1 only, for the
  // suite's time; db.test.ts tests the limit itself.)
  const slow: string[] = [];
  if (meterApi === 'v1') {
    proxy.failOver({ newSilentForMs: 8_000 });
    for (let i = 0; i < 3; i++) slow.push(await record(`failover-slow-${i}-${randomUUID()}`, TENANTS[i]));
    for (const key of slow) await delivery(key);
  }

  const all = [inFlight, ...busy, ...after, ...quiet, ...slow];
  const { rows } = await t.pool.query<{ status: string; n: number }>('SELECT status, count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1::text[]) GROUP BY status', [[warm, ...all]]);
  expect(rows).toEqual([{ status: delivered, n: 1 + all.length }]);
  // A statement on a silent connection is given up on within seconds, as PostgreSQL away: the
  // delivery waits and comes back, spending no attempt. Without that it hung until the attempt's
  // timeout, which failed the attempt (a local activity's marker, or an activity, with a failure).
  for (const key of all) {
    const { events } = await t.client.workflow.getHandle(key).fetchHistory();
    const failed = (events ?? []).filter((e) => e.markerRecordedEventAttributes?.failure || e.activityTaskFailedEventAttributes || e.activityTaskTimedOutEventAttributes);
    expect(failed, key).toEqual([]);
  }
  expect(worker.child.exitCode).toBeNull();
  // And it stops when told: the sockets of its silent connections are destroyed, not left
  // half-closed for good (they kept a stopped worker's process alive).
  const exited = once(worker.child, 'exit');
  worker.child.kill('SIGTERM');
  await waitFor('the worker to exit after SIGTERM', async () => worker.child.exitCode !== null, 30_000);
  expect(await exited).toEqual([0, null]);
}, 300_000);

it('an operator command on a connection a failover left silent fails in time, saying why, instead of waiting for TCP to give up', async () => {
  const proxy = await failingOver(t.db.url);
  // Its statements given up on after 2 s (2 minutes by default).
  const config = { ...t.config, timings: { ...t.config.timings, maintenanceAnswerMs: 2_000 } };
  const pool = operatorPool(proxy.url, config);
  try {
    const out: string[] = [];
    const err: string[] = [];
    const ctx = { config, db: async () => pool, temporal: async () => t.client, out: { write: (s: string) => out.push(s) }, err: { write: (s: string) => err.push(s) } };
    expect(await runCli(['status', '--json'], ctx)).toBe(0);
    proxy.failOver();
    const started = Date.now();
    expect(await runCli(['status', '--json'], ctx)).not.toBe(0);
    expect(Date.now() - started).toBeLessThan(15_000);
    expect(err.join('')).toMatch(/timeout/i);
  } finally {
    await pool.end();
  }
}, 60_000);

it("the worker's maintenance on a silent connection gives up in time and goes on: a run terminated after the failover still turns its row dead", async () => {
  const proxy = await failingOver(t.db.url);
  const pool = createPool(proxy.url);
  // The sweep's statements given up on after 3 s (2 minutes by default), its passes every 200 ms.
  const config = { ...t.config, timings: { ...t.config.timings, maintenanceAnswerMs: 3_000 } };
  const worker = await startWorker({
    config,
    databaseUrl: proxy.url,
    pool,
    stripe: createStripeClient(config.stripe),
    connection: t.pipeline.connection,
    client: t.client,
    workflowBundle: workflowBundle(),
    relayRunForMs: 5_000,
    workerOptions: { shutdownGraceTime: '10 seconds', shutdownForceTime: '15 seconds' },
    closedRunSweep: { intervalMs: 200, staleAfterMs: 0 },
  });
  try {
    // Stripe away: the event stays dispatched, its run retrying.
    t.stripe.refuseFor(600);
    const key = (await withTransaction(t.pool, (c) => recordUsage(c, { usageId: `failover-sweep-${randomUUID()}`, tenantId: 't0', quantity: 1 }))).entry.idempotencyKey;
    await waitFor('the event dispatched', async () => (await statusOf(key)) === 'dispatched', 30_000);
    // Every connection the sweep has used goes silent; the next pass takes one of them.
    proxy.failOver();
    expect(proxy.silenced()).toBeGreaterThan(0);
    await new Promise((r) => setTimeout(r, 1_000));
    await t.client.workflow.getHandle(key).terminate('operator terminated it after the failover');
    await waitFor('the row of the terminated run dead', async () => (await statusOf(key)) === 'dead', 60_000);
    const { rows } = await t.pool.query<{ last_error_code: string }>('SELECT last_error_code FROM outbox WHERE idempotency_key = $1', [key]);
    expect(rows[0]!.last_error_code).toBe(TemporalErrorCodes.workflowClosed);
  } finally {
    t.stripe.heal();
    // Within its grace time: a connection being opened as the failover came gives up after
    // CONNECT_WAIT_MS (it waited for good before, and so did the delivery on it and the shutdown).
    await worker.shutdown();
    await pool.end();
  }
}, 120_000);

it('the API whose PostgreSQL connections go silent answers 503 within seconds, not never, and takes usage again over new ones', async () => {
  const proxy = await failingOver(t.db.url);
  const apiPort = await freePort();
  const token = `tok_${randomUUID().replace(/-/g, '')}`;
  const api = startProcess(
    { DATABASE_URL: proxy.url, TEMPORAL_ADDRESS: inject('temporalAddress'), API_PORT: String(apiPort), API_TOKENS: JSON.stringify([{ name: 'app', token, tenants: ['*'], scopes: ['usage:write'] }]) },
    'src/bin/api.ts',
  );
  await untilSaid(api, 'API listening', 60_000);
  // Each request is answered, one way or the other, well within this.
  const post = (usageId: string) =>
    fetch(`http://127.0.0.1:${apiPort}/v1/usage`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ tenant_id: 't0', usage_id: usageId, quantity: 1 }),
      signal: AbortSignal.timeout(20_000),
    });
  // Several connections open in the API's pool, then all of them silent.
  await Promise.all(Array.from({ length: 5 }, () => post(`failover-api-warm-${randomUUID()}`)));
  proxy.failOver();
  expect(proxy.silenced()).toBeGreaterThan(1);

  const ids = Array.from({ length: 5 }, (_, i) => `failover-api-${i}-${randomUUID()}`);
  const answers: number[] = [];
  for (const id of ids) {
    // As a client does: 503 means try again with the same usage_id.
    for (;;) {
      const res = await post(id);
      answers.push(res.status);
      if (res.status !== 503) break;
    }
  }
  expect(answers.filter((s) => s !== 503)).toEqual(ids.map(() => 201));
  const { rows } = await t.pool.query('SELECT id FROM usage_logs WHERE id = ANY($1::text[])', [ids]);
  expect(rows).toHaveLength(ids.length);
  api.child.kill('SIGTERM');
}, 300_000);

it("a claim or a usage whose connection goes silent before COMMIT keeps its locks seconds, not hours: PostgreSQL ends that session", async () => {
  // The old server living on behind a dropped network path: its sessions keep what they hold until
  // something ends them (its TCP keepalive: two hours by default).
  const proxy = await failingOver(t.db.url);
  const cutOff = createPool(proxy.url, 2);
  const schema = schemaFor(t.config.databaseSchema);
  const usageId = `failover-tx-${randomUUID()}`;
  const held: pg.PoolClient[] = [];
  try {
    // A claim with the schema's claim lock taken, and a usage with its rows written, then silence.
    const claimer = await cutOff.connect();
    held.push(claimer);
    await beginClaim(claimer, schema);
    const recorder = await cutOff.connect();
    held.push(recorder);
    await recorder.query(BEGIN_SHORT);
    await recordUsage(recorder, { usageId, tenantId: 't0', quantity: 1 });
    proxy.failOver();
    const at = Date.now();
    // Another relay's claim waits for the lock, and the client's retry of the usage for its key:
    // both get through once PostgreSQL has ended the silent sessions.
    await claimBatch(t.pool, schema, { limit: 1, claimedBy: 'failover-test', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 4 });
    const retried = await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 't0', quantity: 1 }));
    expect(retried.created).toBe(true);
    expect(Date.now() - at).toBeLessThan(IDLE_IN_TRANSACTION_MS + 10_000);
  } finally {
    for (const client of held) client.release(new Error('its connection went silent'));
    await cutOff.end();
  }
}, 60_000);
