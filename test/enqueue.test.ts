import { describe, expect, it, vi } from 'vitest';
import pg from 'pg';
// Through the package's public entry point, as an application imports it.
import {
  DEFAULT_EVENT_NAME,
  InvalidMappingError,
  InvalidUsageError,
  MAX_QUANTITY,
  recordUsage,
  RolledBackError,
  setBillingCustomer,
  UnknownTenantError,
  idempotencyKeyFor,
  UsageConflictError,
  withTransaction,
  type TransactionClient,
  type UsageInput,
} from 'billing-outbox';
import { loadConfig } from '../src/config.js';
import { useDatabase } from './hooks.js';

const t = useDatabase({ customers: { acme: 'cus_acme', globex: 'cus_globex' } });

const count = async (table: string) => Number((await t.pool.query(`SELECT count(*) FROM ${table}`)).rows[0].count);

describe('recordUsage', () => {
  it('writes the usage row and the outbox row in the caller transaction', async () => {
    const at = new Date('2026-11-30T10:00:00.123Z');
    const result = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'u-1', tenantId: 'acme', quantity: 7, occurredAt: at }));
    expect(result.created).toBe(true);
    expect(result.entry).toMatchObject({ idempotencyKey: 'u:acme:u-1', usageId: 'u-1', tenantId: 'acme', quantity: 7, status: 'pending', eventName: 'api_requests' });
    expect(result.entry.occurredAt.toISOString()).toBe(at.toISOString());
    const usage = await t.pool.query('SELECT * FROM usage_logs WHERE id = $1', ['u-1']);
    expect(usage.rows[0]).toMatchObject({ tenant_id: 'acme', quantity: 7 });
  });

  it('leaves no row when the transaction rolls back', async () => {
    const before = [await count('usage_logs'), await count('outbox')];
    await expect(
      withTransaction(t.pool, async (c) => {
        await recordUsage(c, { usageId: 'u-rollback', tenantId: 'acme', quantity: 1 });
        throw new Error('the application failed after recording');
      }),
    ).rejects.toThrow('the application failed');
    expect([await count('usage_logs'), await count('outbox')]).toEqual(before);
    expect((await t.pool.query(`SELECT 1 FROM outbox WHERE idempotency_key = $1`, [idempotencyKeyFor('acme', 'u-rollback')])).rowCount).toBe(0);
  });

  it("a transaction aborted by the application's own failed statement, its error swallowed: withTransaction throws RolledBackError, not the usage as recorded", async () => {
    const before = [await count('usage_logs'), await count('outbox')];
    const err = await withTransaction(t.pool, async (c) => {
      const recorded = await recordUsage(c, { usageId: 'u-aborted', tenantId: 'acme', quantity: 1 });
      // The application's own insert fails and it carries on (a duplicate it means to ignore).
      await c.query('SELECT 1/0').catch(() => undefined);
      return recorded;
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RolledBackError);
    expect([await count('usage_logs'), await count('outbox')]).toEqual(before);
  });

  it('returns the existing entry for the same usage and adds nothing', async () => {
    const input: UsageInput = { usageId: 'u-dup', tenantId: 'acme', quantity: 3, eventName: 'tokens', occurredAt: new Date('2026-11-30T11:00:00Z') };
    const first = await withTransaction(t.pool, (c) => recordUsage(c, input));
    const before = [await count('usage_logs'), await count('outbox')];
    const second = await withTransaction(t.pool, (c) => recordUsage(c, input));
    expect(second.created).toBe(false);
    expect(second.entry).toEqual(first.entry);
    expect([await count('usage_logs'), await count('outbox')]).toEqual(before);
  });

  it('answers a usage recorded in time as recorded after it has grown too old for Stripe; a new one that old is refused', async () => {
    // Recorded 34 days 22 hours 30 minutes after it happened, in time; asked again (a job queue's redelivery,
    // a retry after a lost answer) two hours later, when Stripe would no longer take a new one.
    const occurredAt = new Date(Date.now() - (35 * 86_400_000 + 1_800_000));
    const input: UsageInput = { usageId: 'u-late-repeat', tenantId: 'acme', quantity: 2, occurredAt };
    vi.useFakeTimers({ toFake: ['Date'], now: Date.now() - 2 * 3_600_000 });
    const first = await withTransaction(t.pool, (c) => recordUsage(c, input)).finally(() => vi.useRealTimers());
    expect(first.created).toBe(true);
    const again = await withTransaction(t.pool, (c) => recordUsage(c, input));
    expect(again).toEqual({ entry: first.entry, created: false });
    // The same id with other values is still a conflict, not a usage too old.
    await expect(withTransaction(t.pool, (c) => recordUsage(c, { ...input, quantity: 3 }))).rejects.toBeInstanceOf(UsageConflictError);
    // A usage that old never recorded is refused, naming the window, and writes nothing.
    const before = [await count('usage_logs'), await count('outbox')];
    await expect(withTransaction(t.pool, (c) => recordUsage(c, { ...input, usageId: 'u-late-new' }))).rejects.toMatchObject({
      name: 'InvalidUsageError',
      field: 'occurredAt',
      reason: expect.stringContaining('must be less than 34 days 23 hours old'),
    });
    expect([await count('usage_logs'), await count('outbox')]).toEqual(before);
  });

  it('answers a usage recorded again after its outbox row was pruned (by then past Stripe\'s window) as recorded before, not as too old', async () => {
    const occurredAt = new Date(Date.now() - 20 * 86_400_000);
    const input: UsageInput = { usageId: 'u-pruned-old', tenantId: 'acme', quantity: 5, occurredAt };
    const first = await withTransaction(t.pool, (c) => recordUsage(c, input));
    // Delivered and pruned (OUTBOX_RETENTION_DAYS): the usage row stays.
    await t.pool.query('DELETE FROM outbox WHERE id = $1', [first.entry.id]);
    // Asked again 40 days later: a job queue's redelivery of last quarter's work.
    vi.useFakeTimers({ toFake: ['Date'], now: Date.now() + 40 * 86_400_000 });
    try {
      await expect(withTransaction(t.pool, (c) => recordUsage(c, input))).rejects.toMatchObject({
        code: 'already_recorded',
        field: 'usageId',
        message: expect.stringMatching(/was recorded before, with these values; its outbox entry was delivered and pruned/),
      });
      await expect(withTransaction(t.pool, (c) => recordUsage(c, { ...input, quantity: 6 }))).rejects.toMatchObject({
        code: 'usage_conflict',
        message: expect.stringContaining('with different values: quantity (recorded 5, given 6)'),
      });
      // Another tenant's usage of that id and age was never recorded: too old for Stripe.
      await expect(withTransaction(t.pool, (c) => recordUsage(c, { ...input, tenantId: 'globex' }))).rejects.toMatchObject({ name: 'InvalidUsageError', field: 'occurredAt' });
    } finally {
      vi.useRealTimers();
    }
    expect(await count(`outbox WHERE usage_id = 'u-pruned-old'`)).toBe(0);
  });

  it('handles the same usage recorded by concurrent transactions: one row', async () => {
    const input: UsageInput = { usageId: 'u-race', tenantId: 'acme', quantity: 2, occurredAt: new Date('2026-11-30T12:00:00Z') };
    const results = await Promise.all(Array.from({ length: 8 }, () => withTransaction(t.pool, (c) => recordUsage(c, input))));
    expect(results.filter((r) => r.created)).toHaveLength(1);
    expect(new Set(results.map((r) => r.entry.id)).size).toBe(1);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = $1`, [idempotencyKeyFor('acme', 'u-race')])).rows[0].n).toBe(1);
  });

  it('under REPEATABLE READ, a duplicate committed after the transaction began fails it with 40001; its retry is told created: false', async () => {
    const input: UsageInput = { usageId: 'u-rr', tenantId: 'acme', quantity: 2, occurredAt: new Date('2026-11-30T12:30:00Z') };
    const later = await t.pool.connect();
    try {
      await later.query('BEGIN ISOLATION LEVEL REPEATABLE READ');
      await later.query('SELECT 1'); // its snapshot, taken before the other commits
      expect((await withTransaction(t.pool, (c) => recordUsage(c, input))).created).toBe(true);
      await expect(recordUsage(later, input)).rejects.toMatchObject({ code: '40001' });
      await later.query('ROLLBACK');
    } finally {
      later.release();
    }
    expect((await withTransaction(t.pool, (c) => recordUsage(c, input))).created).toBe(false);
  });

  it('refuses a usage id reused with different values, without aborting the transaction', async () => {
    await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'u-conflict', tenantId: 'acme', quantity: 5 }));
    await withTransaction(t.pool, async (c) => {
      await expect(recordUsage(c, { usageId: 'u-conflict', tenantId: 'acme', quantity: 6 })).rejects.toBeInstanceOf(UsageConflictError);
      // The caller's transaction is still usable.
      await c.query('SELECT 1');
    });
  });

  it('rejects an unknown tenant with a typed error, writes nothing, and keeps the transaction usable', async () => {
    const before = [await count('usage_logs'), await count('outbox')];
    await withTransaction(t.pool, async (c) => {
      const err = await recordUsage(c, { usageId: 'u-ghost', tenantId: 'ghost', quantity: 1 }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(UnknownTenantError);
      expect((err as UnknownTenantError).code).toBe('unknown_tenant');
      await c.query('SELECT 1');
    });
    expect([await count('usage_logs'), await count('outbox')]).toEqual(before);
  });

  const bad: [string, Partial<UsageInput>, string][] = [
    ['zero quantity', { quantity: 0 }, 'quantity'],
    ['negative quantity', { quantity: -3 }, 'quantity'],
    ['fractional quantity', { quantity: 1.5 }, 'quantity'],
    ['quantity as string', { quantity: '5' as unknown as number }, 'quantity'],
    ['NaN quantity', { quantity: Number.NaN }, 'quantity'],
    ['quantity beyond 15 digits', { quantity: MAX_QUANTITY + 1 }, 'quantity'],
    ['empty usage id', { usageId: '' }, 'usageId'],
    ['usage id over 90 chars', { usageId: 'x'.repeat(91) }, 'usageId'],
    ['usage id with a newline', { usageId: 'a\nb' }, 'usageId'],
    ['usage id with a lone surrogate', { usageId: 'a\ud800b' }, 'usageId'],
    ['usage id with U+FFFD (text already damaged upstream)', { usageId: 'a\ufffdb' }, 'usageId'],
    ['usage id with a zero-width space', { usageId: 'a\u200bb' }, 'usageId'],
    ['usage id with a right-to-left override', { usageId: 'abc\u202etxt.exe' }, 'usageId'],
    ['usage id with a byte-order mark', { usageId: '\ufeffabc' }, 'usageId'],
    ['usage id with a line separator', { usageId: 'a\u2028b' }, 'usageId'],
    ['usage id with a noncharacter', { usageId: 'a\uffffb' }, 'usageId'],
    ['tenant with a left-to-right isolate', { tenantId: '\u2066acme' }, 'tenantId'],
    ['tenant with a zero-width joiner', { tenantId: 'ac\u200dme' }, 'tenantId'],
    ['event name with a soft hyphen', { eventName: 'api\u00adrequests' }, 'eventName'],
    ['empty event name', { eventName: '' }, 'eventName'],
    ['event name over 100 chars', { eventName: 'e'.repeat(101) }, 'eventName'],
    ['empty tenant', { tenantId: '' }, 'tenantId'],
    ['invalid date', { occurredAt: new Date('nope') }, 'occurredAt'],
    ['usage stamped over an hour ahead', { occurredAt: new Date(Date.now() + 65 * 60_000) }, 'occurredAt'],
  ];
  it.each(bad)('rejects %s before sending any query', async (_name, patch, field) => {
    const input = { usageId: 'u-bad', tenantId: 'acme', quantity: 1, ...patch } as UsageInput;
    // A client that records every statement: "rejected before anything is written" means none ran,
    // not only that none is visible after a rollback.
    const sent: string[] = [];
    const err = await withTransaction(t.pool, async (c) => {
      const spy: TransactionClient = { query: (statement) => (sent.push(statement.text), c.query(statement)) };
      return recordUsage(spy, input);
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidUsageError);
    expect((err as InvalidUsageError).field).toBe(field);
    expect((err as InvalidUsageError).message).toMatch(new RegExp(`^${field}: (must|too)`));
    expect(sent).toEqual([]);
  });

  it('accepts the largest quantity Stripe takes and a 90-character usage id', async () => {
    const r = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'y'.repeat(90), tenantId: 'acme', quantity: MAX_QUANTITY }));
    expect(r.entry.quantity).toBe(MAX_QUANTITY);
    // u:acme: plus 90 characters is 98 bytes: still the readable form.
    expect(r.entry.idempotencyKey).toBe(`u:acme:${'y'.repeat(90)}`);
  });
});

describe('setBillingCustomer: the application maps its tenants', () => {
  it("in the signup's own transaction: rolled back, no mapping; committed, the tenant's usage is recorded; remapped, the previous customer is said; each recorded", async () => {
    await expect(
      withTransaction(t.pool, async (tx) => {
        await setBillingCustomer(tx, { tenantId: 'signup', stripeCustomerId: 'cus_signup' });
        throw new Error('the signup failed');
      }),
    ).rejects.toThrow('the signup failed');
    await expect(withTransaction(t.pool, (tx) => recordUsage(tx, { tenantId: 'signup', usageId: 'u1', quantity: 1 }))).rejects.toBeInstanceOf(UnknownTenantError);

    const first = await withTransaction(t.pool, (tx) => setBillingCustomer(tx, { tenantId: 'signup', stripeCustomerId: 'cus_signup' }));
    expect(first).toEqual({ created: true, previousStripeCustomerId: null });
    const recorded = await withTransaction(t.pool, (tx) => recordUsage(tx, { tenantId: 'signup', usageId: 'u1', quantity: 1 }));
    expect(recorded.created).toBe(true);

    // A pool works too (one statement); a remap answers what it replaced.
    expect(await setBillingCustomer(t.pool, { tenantId: 'signup', stripeCustomerId: 'cus_signup_2' }, { by: 'billing-admin' })).toEqual({ created: false, previousStripeCustomerId: 'cus_signup' });
    const { rows } = await t.pool.query(`SELECT actor, outcome, detail FROM operator_actions WHERE action = 'customers.set' AND tenant_id = 'signup' ORDER BY id`);
    expect(rows).toEqual([
      { actor: 'application', outcome: 'created', detail: '→ cus_signup' },
      { actor: 'billing-admin', outcome: 'updated', detail: 'cus_signup → cus_signup_2' },
    ]);
  });

  it("two remaps at once: the second says the first's customer, not the one before both; the tenant's usage recorded meanwhile, neither waiting", async () => {
    await setBillingCustomer(t.pool, { tenantId: 'remapped', stripeCustomerId: 'cus_remap_a' });
    const first = await t.pool.connect();
    try {
      await first.query('BEGIN');
      await setBillingCustomer(first, { tenantId: 'remapped', stripeCustomerId: 'cus_remap_b' });
      const second = setBillingCustomer(t.pool, { tenantId: 'remapped', stripeCustomerId: 'cus_remap_c' }, { by: 'second' });
      // Under the first remap's lock, usage is still recorded.
      expect((await withTransaction(t.pool, (tx) => recordUsage(tx, { tenantId: 'remapped', usageId: 'r1', quantity: 1 }))).created).toBe(true);
      await new Promise((resolve) => setTimeout(resolve, 200));
      await first.query('COMMIT');
      expect(await second).toEqual({ created: false, previousStripeCustomerId: 'cus_remap_b' });
    } finally {
      first.release();
    }
    const { rows } = await t.pool.query(`SELECT detail FROM operator_actions WHERE action = 'customers.set' AND tenant_id = 'remapped' AND actor = 'second'`);
    expect(rows).toEqual([{ detail: 'cus_remap_b → cus_remap_c' }]);
  });

  it('refuses, writing nothing, a tenant recordUsage would refuse or an id that is not a customer\'s', async () => {
    const before = (await t.pool.query('SELECT count(*)::int AS n FROM billing_customers')).rows[0].n;
    await expect(setBillingCustomer(t.pool, { tenantId: '', stripeCustomerId: 'cus_x' })).rejects.toBeInstanceOf(InvalidMappingError);
    await expect(setBillingCustomer(t.pool, { tenantId: 'ok', stripeCustomerId: 'acct_123' })).rejects.toThrow(/cus_/);
    await expect(setBillingCustomer(t.pool, { tenantId: 'ok', stripeCustomerId: 42 as unknown as string })).rejects.toBeInstanceOf(InvalidMappingError);
    await expect(setBillingCustomer(t.pool, null as unknown as { tenantId: string; stripeCustomerId: string })).rejects.toBeInstanceOf(InvalidMappingError);
    expect((await t.pool.query('SELECT count(*)::int AS n FROM billing_customers')).rows[0].n).toBe(before);
  });
});

describe('usage ids are scoped by tenant', () => {
  it("one tenant taking an id first does not stop another tenant's usage with the same id", async () => {
    // globex's token must not be able to learn, or block, acme's usage ids.
    const g = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'shared-id', tenantId: 'globex', quantity: 999 }));
    const a = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'shared-id', tenantId: 'acme', quantity: 1 }));
    expect(g.created).toBe(true);
    expect(a.created).toBe(true);
    expect(a.entry.idempotencyKey).not.toBe(g.entry.idempotencyKey);
    expect([a.entry.quantity, g.entry.quantity]).toEqual([1, 999]);
    const { rows } = await t.pool.query(`SELECT tenant_id, quantity FROM usage_logs WHERE id = 'shared-id' ORDER BY tenant_id`);
    expect(rows).toEqual([
      { tenant_id: 'acme', quantity: 1 },
      { tenant_id: 'globex', quantity: 999 },
    ]);
    // Each tenant's repeat is still its own no-op.
    const again = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'shared-id', tenantId: 'acme', quantity: 1 }));
    expect(again).toMatchObject({ created: false, entry: { id: a.entry.id } });
  });

  it('gives every (tenant, usage id) pair its own key, within 100 bytes', () => {
    const pairs: [string, string][] = [
      ['a:b', 'c'],
      ['a', 'b:c'],
      ['a%3Ab', 'c'],
      ['t'.repeat(200), 'x'],
      ['t'.repeat(200), 'y'],
      ['租户', '使用'.repeat(45)],
      ['租户', `${'使用'.repeat(44)}用`],
    ];
    const keys = pairs.map(([tenant, usage]) => idempotencyKeyFor(tenant, usage));
    expect(new Set(keys).size).toBe(pairs.length);
    for (const key of keys) expect(Buffer.byteLength(key, 'utf8')).toBeLessThanOrEqual(100);
    expect(keys[0]).toBe('u:a%3Ab:c');
    expect(keys[3]).toMatch(/^h:[0-9a-f]{64}$/);
  });
});

describe('importing the package', () => {
  it("leaves the application's own pg type parsing as it was", async () => {
    // The package entry is already imported at the top of this file, as an application would.
    expect(pg.types.getTypeParser(pg.types.builtins.INT8)('9007199254740993')).toBe('9007199254740993');
    // The application's own connection still reads bigint as text; recordUsage on it reads numbers.
    const app = new pg.Client({ connectionString: t.db.url });
    await app.connect();
    try {
      expect((await app.query(`SELECT 9007199254740993::bigint AS big`)).rows[0].big).toBe('9007199254740993');
      await app.query('BEGIN');
      const first = await recordUsage(app, { usageId: 'u-app-parsers', tenantId: 'acme', quantity: 12 });
      const again = await recordUsage(app, { usageId: 'u-app-parsers', tenantId: 'acme', quantity: 12 });
      await app.query('COMMIT');
      expect([first.entry.quantity, typeof first.entry.id, again.created, again.entry.quantity]).toEqual([12, 'number', false, 12]);
    } finally {
      await app.end();
    }
  });
});

describe("recordUsage's meter event name when the usage names none", () => {
  it('is defaultEventName when the caller passes one, else DEFAULT_EVENT_NAME; the usage\'s own name wins', async () => {
    const own = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'meter-own', tenantId: 'acme', quantity: 1, eventName: 'tokens' }, { defaultEventName: 'other' }));
    const given = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'meter-given', tenantId: 'acme', quantity: 1 }, { defaultEventName: 'tokens' }));
    const none = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'meter-none', tenantId: 'acme', quantity: 1 }));
    expect([own.entry.eventName, given.entry.eventName, none.entry.eventName]).toEqual(['tokens', 'tokens', 'api_requests']);
    expect(DEFAULT_EVENT_NAME).toBe('api_requests');
  });

  it("never reads STRIPE_METER_EVENT_NAME from the application's environment", async () => {
    const before = process.env.STRIPE_METER_EVENT_NAME;
    process.env.STRIPE_METER_EVENT_NAME = 'from_the_environment';
    try {
      const r = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'meter-env', tenantId: 'acme', quantity: 1 }));
      expect(r.entry.eventName).toBe(DEFAULT_EVENT_NAME);
    } finally {
      if (before === undefined) delete process.env.STRIPE_METER_EVENT_NAME;
      else process.env.STRIPE_METER_EVENT_NAME = before;
    }
  });

  it('is the default of STRIPE_METER_EVENT_NAME too, so the library and the HTTP API agree when nothing is configured', () => {
    expect(loadConfig({}).stripe.meterEventName).toBe(DEFAULT_EVENT_NAME);
  });
});
