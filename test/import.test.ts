/**
 * Bulk import (billing-outbox import, importUsage): existing usage enters through the same outbox
 * as recordUsage, with its checks and keys; a re-run adds nothing; each refused line says why; a
 * dry run writes nothing; the exit code tells whether anything was refused.
 */
import { randomUUID } from 'node:crypto';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { importUsage } from '../src/index.js';
import { idempotencyKeyFor, runCliWithoutTemporal, testConfig, useDatabase } from './hooks.js';

const DAY = 86_400_000;
const t = useDatabase({ customers: { acme: 'cus_acme', globex: 'cus_globex' } });
let dir: string;
beforeAll(async () => {
  dir = await mkdtemp(join(tmpdir(), 'bo-import-'));
});
afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

const ago = (ms: number) => new Date(Date.now() - ms).toISOString();

async function file(name: string, lines: string[]): Promise<string> {
  const path = join(dir, name);
  await writeFile(path, lines.join('\n') + '\n');
  return path;
}

async function outboxCount(): Promise<number> {
  const { rows } = await t.pool.query<{ n: string }>('SELECT count(*) AS n FROM outbox');
  return Number(rows[0]!.n);
}

async function usageLogCount(): Promise<number> {
  const { rows } = await t.pool.query<{ n: string }>('SELECT count(*) AS n FROM usage_logs');
  return Number(rows[0]!.n);
}

const importCli = (args: string[]) => runCliWithoutTemporal(['import', ...args], testConfig(), t.db);

it("a field name with control characters (an escape sequence) is named as JSON text, never written raw to the operator's terminal", async () => {
  const p = randomUUID().slice(0, 8);
  const path = await file(`usage-${p}.jsonl`, [JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-1`, quantity: 1, '\u001b]52;c;eA==\u0007': 1 })]);
  const r = await importCli([path]);
  expect(r.code).toBe(1);
  expect(r.err.includes('\u001b') || r.err.includes('\u0007')).toBe(false);
  expect(r.err.trim()).toBe('line 1: invalid_usage: "\\u001b]52;c;eA==\\u0007": is not a known field');
});

it('a jsonl file: good lines recorded under recordUsage keys, each bad line refused with its number and reason, exit 1; a re-run adds nothing', async () => {
  const p = randomUUID().slice(0, 8);
  const path = await file(`usage-${p}.jsonl`, [
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-1`, quantity: 3, occurred_at: ago(60_000) }),
    JSON.stringify({ tenant_id: 'globex', usage_id: `${p}-2`, quantity: 1, event_name: 'api_requests', occurred_at: ago(DAY) }),
    '',
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-3`, quantity: 1, occurred_at: ago(40 * DAY) }),
    JSON.stringify({ tenant_id: 'initech', usage_id: `${p}-4`, quantity: 1, occurred_at: ago(60_000) }),
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-5`, quantity: '2' }),
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-6`, quantity: 1, colour: 'blue' }),
    '{"tenant_id": "acme", "usage_id": ',
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-8`, quantity: 2 }),
    // Read as the API reads a body: a key twice (which one would win?) and a number not as written are refused.
    `{"tenant_id": "acme", "usage_id": "${p}-10", "usage_id": "${p}-11", "quantity": 1}`,
    `{"tenant_id": "acme", "usage_id": "${p}-12", "quantity": 1e1}`,
    `{"tenant_id": "acme", "usage_id": "${p}-13", "quantity": 1, "occurred_at": "${ago(60_000).replace('T', 't').replace('Z', 'z')}"}`,
    // An offset without its colon, as the API takes it.
    `{"tenant_id": "acme", "usage_id": "${p}-14", "quantity": 1, "occurred_at": "${ago(60_000).replace('Z', '+0000')}"}`,
  ]);
  const before = await outboxCount();

  const first = await importCli([path, '--batch-size', '2']);
  expect(first.code).toBe(1);
  expect(first.out).toBe(`${path}: 12 line(s); 5 recorded, 0 already recorded, 7 refused\n`);
  const refusals = first.err.trim().split('\n');
  expect(refusals).toHaveLength(7);
  expect(refusals[0]).toMatch(/^line 4: invalid_usage: occurred_at: must be less than 34 days 23 hours old/);
  expect(refusals[1]).toBe('line 5: unknown_tenant: tenant "initech" has no billing customer; map it first (setBillingCustomer, or billing-outbox customers set)');
  expect(refusals[2]).toBe('line 6: invalid_usage: quantity: must be an integer');
  expect(refusals[3]).toBe('line 7: invalid_usage: colour: is not a known field');
  expect(refusals[4]).toBe('line 8: malformed_line: the line is not valid JSON');
  expect(refusals[5]).toBe(`line 10: malformed_line: the key "usage_id" appears more than once in one object`);
  expect(refusals[6]).toBe('line 11: malformed_line: the number 1e1 would be read as 10: write whole numbers as plain digits');
  expect(await outboxCount()).toBe(before + 5);

  const row = await t.row(idempotencyKeyFor('acme', `${p}-1`));
  expect(row).toMatchObject({ tenant_id: 'acme', usage_id: `${p}-1`, quantity: 3, status: 'pending' });
  expect(await t.row(idempotencyKeyFor('globex', `${p}-2`))).toMatchObject({ tenant_id: 'globex', event_name: 'api_requests' });
  // A usage without event_name gets the configured meter, without occurred_at the import's time.
  expect(await t.row(idempotencyKeyFor('acme', `${p}-8`))).toMatchObject({ event_name: testConfig().stripe.meterEventName, quantity: 2 });

  const again = await importCli([path, '--by', 'alice']);
  expect(again.code).toBe(1);
  expect(again.out).toBe(`${path}: 12 line(s); 0 recorded, 5 already recorded, 7 refused\n`);
  expect(await outboxCount()).toBe(before + 5);

  // Each import is in the audit log, with its file and counts.
  const { rows: audit } = await t.pool.query('SELECT actor, outcome, detail FROM operator_actions WHERE action = $1 AND detail LIKE $2 ORDER BY id', ['import', `${path}:%`]);
  expect(audit.map((a: { actor: string; outcome: string; detail: string }) => [a.actor === 'alice', a.outcome, a.detail])).toEqual([
    [false, 'partial', `${path}: 12 line(s); 5 recorded, 0 already recorded, 7 refused`],
    [true, 'partial', `${path}: 12 line(s); 0 recorded, 5 already recorded, 7 refused`],
  ]);
});

it('--dry-run answers as an import would and writes nothing', async () => {
  const p = randomUUID().slice(0, 8);
  await t.enqueue('acme', 1, { usageId: `${p}-old` });
  const path = await file(`dry-${p}.ndjson`, [
    JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-new`, quantity: 1 }),
    JSON.stringify({ tenant_id: 'nobody', usage_id: `${p}-x`, quantity: 1 }),
  ]);
  const before = [await outboxCount(), await usageLogCount()];
  const dry = await importCli([path, '--dry-run']);
  expect(dry.out).toBe(`dry run, nothing written: ${path}: 2 line(s); 1 would be recorded, 0 already recorded, 1 refused\n`);
  expect(dry.code).toBe(1);
  expect([await outboxCount(), await usageLogCount()]).toEqual(before);
  expect((await t.pool.query('SELECT 1 FROM operator_actions WHERE detail LIKE $1', [`${path}:%`])).rowCount).toBe(0);
  expect(await t.row(idempotencyKeyFor('acme', `${p}-new`))).toBeUndefined();
});

it('a csv file: header with the API fields, quoted fields, a malformed row refused; the format from the extension or --format', async () => {
  const p = randomUUID().slice(0, 8);
  const lines = [
    '\uFEFFusage_id,tenant_id,quantity,occurred_at,event_name',
    `"${p}, ""quoted""",acme,4,${ago(60_000)},`,
    `${p}-plain,acme,2,,api_requests`,
    `${p}-stray,"acme,5,,`,
    `${p}-short,acme`,
    `${p}-frac,acme,1.5,,`,
  ];
  const path = await file(`usage-${p}.csv`, lines);
  const run = await importCli([path]);
  expect(run.out).toBe(`${path}: 5 line(s); 2 recorded, 0 already recorded, 3 refused\n`);
  expect(run.code).toBe(1);
  expect(run.err.trim().split('\n')).toEqual([
    'line 4: malformed_line: a quoted field is not closed on its line',
    'line 5: malformed_line: 2 fields where the header has 5',
    'line 6: invalid_usage: quantity: must be an integer',
  ]);
  expect(await t.row(idempotencyKeyFor('acme', `${p}, "quoted"`))).toMatchObject({ quantity: 4 });

  // The same rows under a name that says nothing: --format says it.
  const unnamed = await file(`usage-${p}.txt`, lines.slice(0, 3));
  expect((await importCli([unnamed])).code).toBe(2);
  const again = await importCli([unnamed, '--format', 'csv']);
  expect(again.out).toBe(`${unnamed}: 2 line(s); 0 recorded, 2 already recorded, 0 refused\n`);
  expect(again.code).toBe(0);

  const badHeader = await file(`header-${p}.csv`, ['tenant,usage_id,quantity', 'acme,x,1']);
  const refused = await importCli([badHeader]);
  expect(refused.code).toBe(1);
  expect(refused.err).toContain('the CSV header names "tenant"');
});

it('importUsage for applications: records and lines alike, many batches, a usage twice in one batch, a reused id with other values refused', async () => {
  const p = randomUUID().slice(0, 8);
  const occurredAt = new Date(Date.now() - 3_600_000);
  async function* records() {
    for (let i = 1; i <= 7; i++) yield { tenantId: 'acme', usageId: `${p}-${i}`, quantity: i, occurredAt };
    yield { tenantId: 'acme', usageId: `${p}-7`, quantity: 7, occurredAt }; // twice in one batch
    yield { tenantId: 'acme', usageId: `${p}-1`, quantity: 1, occurredAt }; // the same again: nothing added
    yield { tenantId: 'acme', usageId: `${p}-2`, quantity: 99, occurredAt }; // the same id, other values
  }
  const refusals: string[] = [];
  const progress: number[] = [];
  const summary = await importUsage(t.pool, records(), { batchSize: 3, onRefusal: (r) => refusals.push(`${r.line} ${r.code} ${r.field}`), onProgress: (s) => progress.push(s.recorded) });
  expect(summary).toMatchObject({ read: 10, recorded: 7, alreadyRecorded: 2, refused: 1, dryRun: false });
  expect(refusals).toEqual(['10 usage_conflict usageId']);
  expect(summary.refusals[0]!.reason).toContain("already recorded with different values");
  expect(progress).toEqual([3, 6, 7, 7]);
  const { rows } = await t.pool.query<{ usage_id: string }>('SELECT usage_id FROM outbox WHERE usage_id LIKE $1 ORDER BY id', [`${p}-%`]);
  // Outbox ids follow the source's order: the relay claims an import in its order.
  expect(rows.map((r) => r.usage_id)).toEqual([1, 2, 3, 4, 5, 6, 7].map((i) => `${p}-${i}`));

  const lines = [JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-1`, quantity: 1, occurred_at: occurredAt.toISOString() })];
  expect(await importUsage(t.pool, lines)).toMatchObject({ read: 1, recorded: 0, alreadyRecorded: 1, refused: 0 });
});

it('a re-run after the usages grew too old for Stripe counts the ones recorded as already recorded, refusing only those never recorded', async () => {
  // An import of last month's usage ended part-way; run again two hours later, past Stripe's window.
  const p = randomUUID().slice(0, 8);
  const occurredAt = new Date(Date.now() - (35 * DAY + 1_800_000)).toISOString();
  const lines = [1, 2, 3].map((i) => JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-${i}`, quantity: i, occurred_at: occurredAt }));
  const twoHoursBefore = () => Date.now() - 2 * 3_600_000;
  expect(await importUsage(t.pool, lines.slice(0, 2), { now: twoHoursBefore })).toMatchObject({ recorded: 2, refused: 0 });
  const changed = JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-2`, quantity: 9, occurred_at: occurredAt });
  const refusals: string[] = [];
  const again = await importUsage(t.pool, [...lines, changed], { batchSize: 2, onRefusal: (r) => refusals.push(`${r.line} ${r.code} ${r.reason}`) });
  expect(again).toMatchObject({ read: 4, recorded: 0, alreadyRecorded: 2, refused: 2 });
  expect(refusals).toEqual([
    expect.stringMatching(/^3 invalid_usage occurred_at: must be less than 34 days 23 hours old/),
    expect.stringMatching(/^4 usage_conflict .*quantity \(recorded 2, given 9\)/),
  ]);
});

it('a progress bar on stderr only when stderr is a terminal; refusals above it, the summary on stdout', async () => {
  const { runCli } = await import('../src/cli/run.js');
  const p = randomUUID().slice(0, 8);
  const path = await file(`tty-${p}.jsonl`, [JSON.stringify({ tenant_id: 'acme', usage_id: `${p}-1`, quantity: 1 }), JSON.stringify({ tenant_id: 'nobody', usage_id: `${p}-2`, quantity: 1 })]);
  const run = async (isTTY: boolean) => {
    let out = '';
    let err = '';
    const code = await runCli(['import', path], {
      config: testConfig(),
      db: async () => t.pool,
      temporal: async () => {
        throw new Error('no Temporal in this test');
      },
      out: { write: (s: string) => (out += s) },
      err: { write: (s: string) => (err += s), isTTY },
    });
    return { code, out, err };
  };
  const tty = await run(true);
  expect(tty.code).toBe(1);
  expect(tty.err).toContain('\r\x1b[Kline 2: unknown_tenant:');
  const lastDraw = tty.err.slice(tty.err.lastIndexOf('\r'));
  expect(lastDraw).toMatch(/^\r\[#+\] \d+\/\d+ 100% 2 lines: 1 recorded, 0 already recorded, 1 refused/);
  expect(lastDraw.endsWith('\n')).toBe(true);
  expect(tty.out).toBe(`${path}: 2 line(s); 1 recorded, 0 already recorded, 1 refused\n`);

  const piped = await run(false);
  expect(piped.err).toBe('line 2: unknown_tenant: tenant "nobody" has no billing customer; map it first (setBillingCustomer, or billing-outbox customers set)\n');
});

it('a usage whose outbox row was pruned is never recorded twice: the same line counts as already recorded, other values are refused', async () => {
  const usageId = `pruned-${randomUUID()}`;
  const key = await t.enqueue('acme', 1, { usageId });
  // What prune leaves of a delivered usage: its usage_logs row, no outbox row.
  await t.pool.query('DELETE FROM outbox WHERE idempotency_key = $1', [key]);
  const same = await importUsage(t.pool, [{ tenantId: 'acme', usageId, quantity: 1 }]);
  expect(same).toMatchObject({ recorded: 0, alreadyRecorded: 1, refused: 0 });
  const other = await importUsage(t.pool, [{ tenantId: 'acme', usageId, quantity: 2 }]);
  expect(other).toMatchObject({ recorded: 0, alreadyRecorded: 0, refused: 1 });
  expect(other.refusals[0]).toMatchObject({ line: 1, code: 'usage_conflict', field: 'usageId' });
  expect(other.refusals[0]!.reason).toContain('with different values: quantity (recorded 1, given 2)');
  expect(other.refusals[0]!.reason).toContain('pruned after OUTBOX_RETENTION_DAYS');
  expect(await t.row(key)).toBeUndefined();
});

it('a file imported again months later: its lines, pruned and past the window of Stripe, count as already recorded, not as too old', async () => {
  const usageId = `old-${randomUUID()}`;
  const occurredAt = new Date(Date.now() - 20 * 86_400_000);
  const key = await t.enqueue('acme', 4, { usageId, occurredAt });
  await t.pool.query('DELETE FROM outbox WHERE idempotency_key = $1', [key]);
  const later = () => Date.now() + 40 * 86_400_000;
  const again = await importUsage(t.pool, [{ tenantId: 'acme', usageId, quantity: 4, occurredAt }], { now: later });
  expect(again.refusals).toEqual([]);
  expect(again).toMatchObject({ recorded: 0, alreadyRecorded: 1, refused: 0 });
  // A usage never recorded, as old: Stripe would refuse it, and so does the import.
  const fresh = await importUsage(t.pool, [{ tenantId: 'acme', usageId: `${usageId}-new`, quantity: 4, occurredAt }], { now: later });
  expect(fresh.refusals[0]).toMatchObject({ code: 'invalid_usage', field: 'occurredAt' });
  expect(fresh.refusals[0]!.reason).toContain('Stripe refuses usage older than 35 days');
});
