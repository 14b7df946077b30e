/**
 * STRIPE_IDENTIFIER_NAMESPACE: two deployments (two databases, two workers, two configurations)
 * sharing one Stripe account, with the same tenant and usage ids. Without namespaces the second
 * deployment's event is told "already exists" (the first's identifier) and marked sent: lost.
 * With one namespace each, both are billed under their own identifiers, and error reports, cancel
 * and reconcile find each row by the identifier Stripe got.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { cancelEvent } from '../src/ops/cancel.js';
import { recordErrorReport } from '../src/ops/error-reports.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { beginAttempt } from '../src/outbox/sql/delivery.js';
import { createStripeClient } from '../src/stripe/client.js';
import { addCustomer, createTestDb, runCliWithoutTemporal, startTestPipeline, temporalNamespace, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { readDeployment } from '../src/temporal/worker.js';

const CUSTOMER = 'cus_shared_account';

interface Deployment {
  db: TestDb;
  config: Config;
  pipeline: TestPipeline;
}

let stripe: LocalStripe;
let east: Deployment;
let west: Deployment;

async function deployment(namespace: string, temporalNs: string): Promise<Deployment> {
  const db = await createTestDb();
  await addCustomer(db.pool, 'acme', CUSTOMER);
  const config = testConfig({
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_shared',
    STRIPE_IDENTIFIER_NAMESPACE: namespace,
    TEMPORAL_NAMESPACE: temporalNs,
  });
  return { db, config, pipeline: await startTestPipeline({ db, config }) };
}

beforeAll(async () => {
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: [CUSTOMER] });
  east = await deployment('east', 'default');
  west = await deployment('west', await temporalNamespace());
});

afterAll(async () => {
  for (const d of [east, west]) {
    await d?.pipeline.stop();
    await d?.db.drop();
  }
  await stripe?.close();
});

async function record(d: Deployment, usageId: string, quantity: number): Promise<string> {
  const r = await withTransaction(d.db.pool, (c) => recordUsage(c, { usageId, tenantId: 'acme', quantity, occurredAt: new Date(Date.now() - 60_000) }));
  return r.entry.idempotencyKey;
}

async function row(d: Deployment, key: string) {
  const { rows } = await d.db.pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0] as Record<string, unknown> & { status: string; stripe_identifier: string | null };
}

const waitSent = (d: Deployment, key: string) =>
  waitFor(`${key} to be sent`, async () => ((await row(d, key)).status === 'sent' ? row(d, key) : undefined));

const counted = (identifier: string) => stripe.events().filter((e) => e.identifier === identifier && !e.asyncError && !e.cancelled);

describe('two deployments sharing one Stripe account', () => {
  it('bill the same tenant and usage id each under its own identifier: neither is marked sent by the other', async () => {
    const usageId = 'shared-usage-1';
    const eastKey = await record(east, usageId, 3);
    await waitSent(east, eastKey);
    const westKey = await record(west, usageId, 5);
    await waitSent(west, westKey);
    // The same key in both outboxes and workflow ids (each on its own database and task queue)...
    expect(westKey).toBe(eastKey);
    expect(eastKey).toBe(`u:acme:${usageId}`);
    // ...but not at Stripe: both are billed, with their own quantities.
    expect(counted(`east/${eastKey}`).map((e) => e.value)).toEqual([3]);
    expect(counted(`west/${westKey}`).map((e) => e.value)).toEqual([5]);
    expect(counted(eastKey)).toHaveLength(0);
    // Neither was told "already exists".
    for (const r of stripe.requests().filter((r) => r.identifier?.endsWith(eastKey))) expect(r.status).toBe(200);
    expect(await row(east, eastKey)).toMatchObject({ stripe_identifier: `east/${eastKey}`, attempt_count: 1 });
    expect(await row(west, westKey)).toMatchObject({ stripe_identifier: `west/${westKey}`, attempt_count: 1 });

    // An error report names west's identifier: only west's row is rejected, east's stays sent.
    const report = (identifier: string) => ({
      eventId: `evt_${identifier.replace(/[^A-Za-z0-9]/g, '_')}`,
      type: 'v1.billing.meter.error_report_triggered',
      meterId: null,
      errorCount: 1,
      errorTypes: [{ code: 'meter_event_invalid_value', errorCount: 1, samples: [{ identifier, message: 'bad value' }] }],
      validationStart: null,
      validationEnd: null,
    });
    expect(await recordErrorReport(east.db.pool, schemaFor(), report(`west/${westKey}`), {})).toMatchObject({ marked: [], unknown: [`west/${westKey}`] });
    expect(await recordErrorReport(west.db.pool, schemaFor(), report(`west/${westKey}`), {})).toMatchObject({ marked: [westKey] });
    expect((await row(east, eastKey)).status).toBe('sent');
    expect((await row(west, westKey)).status).toBe('rejected_async');

    // Cancel names east's identifier at Stripe, not the bare key.
    const cancelled = await cancelEvent(east.db.pool, schemaFor(), eastKey, { actor: 'test', stripe: () => createStripeClient(east.config.stripe) });
    expect(cancelled.outcome).toBe('cancelled');
    expect(counted(`east/${eastKey}`)).toHaveLength(0);
    expect(stripe.events().find((e) => e.identifier === `east/${eastKey}`)?.cancelled).toBe(true);
  });

  it('an event first attempted under its key (no namespace then) keeps its key whatever the namespace is now', async () => {
    const key = await withTransaction(east.db.pool, async (c) => {
      const r = await recordUsage(c, { usageId: 'unspaced-1', tenantId: 'acme', quantity: 1, occurredAt: new Date(Date.now() - 60_000) });
      // Claimed by nobody (a status the relay leaves alone), attempted once without a namespace: its
      // identifier was the key, so none is stored.
      await c.query(`UPDATE outbox SET status = 'dead', first_attempted_at = now(), attempt_count = 1 WHERE idempotency_key = $1`, [r.entry.idempotencyKey]);
      return r.entry.idempotencyKey;
    });
    const begun = await beginAttempt(east.db.pool, schemaFor(), key, { workflowId: key, safeWindowMs: 3_600_000, force: false, identifierNamespace: 'east' });
    expect(begun.row?.identifier).toBe(key);
    expect((await row(east, key)).stripe_identifier).toBeNull();

    const fresh = await record(east, 'fresh-1', 1);
    await waitSent(east, fresh);
    expect((await row(east, fresh)).stripe_identifier).toBe(`east/${fresh}`);
  });
});

describe("operator commands run with another environment than the workers'", () => {
  it("stamp identifiers with the namespace the deployment's workers started with, not their own (a shell without STRIPE_IDENTIFIER_NAMESPACE)", async () => {
    const { rows } = await east.db.pool.query<{ identifier_namespace: string | null }>('SELECT identifier_namespace FROM deployment');
    expect(rows[0]!.identifier_namespace).toBe('east');
    // A dead letter never attempted, as a restore leaves one that may have reached Stripe after the backup.
    const key = await withTransaction(east.db.pool, async (c) => {
      const r = await recordUsage(c, { usageId: 'restored-1', tenantId: 'acme', quantity: 1, occurredAt: new Date(Date.now() - 60_000) });
      await c.query(`UPDATE outbox SET status = 'dead', dead_at = now() WHERE idempotency_key = $1`, [r.entry.idempotencyKey]);
      return r.entry.idempotencyKey;
    });
    // Another namespace than the workers': refused, nothing stamped (which is right is the operator's to say).
    const other = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_shared', STRIPE_IDENTIFIER_NAMESPACE: 'west' });
    const refused = await runCliWithoutTemporal(['restored', '--backup-taken-at', new Date(Date.now() - 3_600_000).toISOString(), '--by', 'test'], other, east.db);
    expect(refused.code).toBe(1);
    expect(refused.err).toMatch(/STRIPE_IDENTIFIER_NAMESPACE is "west" here, but this database records "east" as the one its workers last started with/);
    expect((await row(east, key)).stripe_identifier).toBeNull();
    const bare = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_shared' });
    expect(bare.stripe.identifierNamespace).toBe('');
    const r = await runCliWithoutTemporal(['restored', '--backup-taken-at', new Date(Date.now() - 3_600_000).toISOString(), '--by', 'test'], bare, east.db);
    expect(r.code).toBe(0);
    // Its next attempt resends what the workers would have sent: east's identifier, recognised by Stripe.
    expect((await row(east, key)).stripe_identifier).toBe(`east/${key}`);
  });
});

it("a schema made by an earlier build, its deployment row without the namespace column: refused at the worker's start with what to do, not a column error", async () => {
  const db = await createTestDb();
  try {
    await db.pool.query('ALTER TABLE deployment DROP COLUMN identifier_namespace');
    await expect(readDeployment(db.pool, schemaFor().name)).rejects.toThrow(/made by an earlier build of billing-outbox's 001_schema\.sql/);
  } finally {
    await db.drop();
  }
});

it('a worker on a Temporal namespace without its search attributes refuses to start, naming them and how to create them', async () => {
  // Before: it started, and Temporal refused every usage start for good (each event dead at once).
  const bare = await temporalNamespace({ searchAttributes: false });
  const db = await createTestDb();
  const config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_shared', TEMPORAL_NAMESPACE: bare });
  try {
    await expect(startTestPipeline({ db, config })).rejects.toThrow(
      new RegExp(`namespace "${bare}" lacks the search attributes billing-outbox sets on its workflows: OutboxStatus, TenantId, OutboxError\\..*temporal operator search-attribute create --namespace ${bare} --name OutboxStatus --type Keyword`),
    );
  } finally {
    await db.drop();
  }
});
