/**
 * recordUsage inside the transactions of what applications use: node-postgres as it is, Kysely,
 * Drizzle (node-postgres and postgres.js drivers), Knex and Prisma (interactive transactions,
 * @prisma/adapter-pg) through billing-outbox's adapters, each on its own pool with the driver's
 * default type parsing (not ours), and Kysely and Knex with the result rows camel-cased, as many
 * applications set them up. For each: a commit leaves one event, a rollback
 * none, a repeat adds nothing, and bad input throws a UsageError before anything is written and
 * leaves the transaction usable.
 */
import { randomUUID } from 'node:crypto';
import { drizzle } from 'drizzle-orm/node-postgres';
import { drizzle as drizzlePostgresJs } from 'drizzle-orm/postgres-js';
import { sql as drizzleSql } from 'drizzle-orm';
import knexFactory from 'knex';
import { CamelCasePlugin, Kysely, PostgresDialect, sql as kyselySql } from 'kysely';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { InvalidUsageError, NotATransactionError, recordUsage, UnknownTenantError, UnreadableRowsError, UsageError, withoutPreparedStatements, type TransactionClient } from '../src/index.js';
import { fromDrizzle } from '../src/outbox/adapters/drizzle.js';
import { fromKnex } from '../src/outbox/adapters/knex.js';
import { fromKysely } from '../src/outbox/adapters/kysely.js';
import { fromPrisma } from '../src/outbox/adapters/prisma.js';
import { useDatabase } from './hooks.js';
import { generatePrismaClient, type GeneratedPrisma } from './prisma.js';

const t = useDatabase({ customers: { acme: 'cus_acme' } });

/** One way to open a transaction: `fn` gets recordUsage's client and a way to run the application's own SQL. */
interface Driver {
  name: string;
  transaction<T>(fn: (client: TransactionClient, own: (text: string) => Promise<unknown>) => Promise<T>): Promise<T>;
  close(): Promise<void>;
}

let prisma: GeneratedPrisma | undefined;
beforeAll(async () => void (prisma = await generatePrismaClient()), 120_000);
afterAll(() => prisma?.remove());

const drivers: [string, () => Driver][] = [
  [
    'node-postgres',
    () => {
    const pool = new pg.Pool({ connectionString: t.db.url, max: 2 });
    return {
      name: 'node-postgres',
      async transaction(fn) {
        const client = await pool.connect();
        try {
          await client.query('BEGIN');
          const result = await fn(client, (text) => client.query(text));
          await client.query('COMMIT');
          return result;
        } catch (err) {
          await client.query('ROLLBACK');
          throw err;
        } finally {
          client.release();
        }
      },
      close: () => pool.end(),
    };
  }],
  [
    'Kysely',
    () => {
    const kysely = new Kysely<never>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: t.db.url, max: 2 }) }) });
    return {
      name: 'Kysely',
      transaction: (fn) => kysely.transaction().execute((trx) => fn(fromKysely(trx), (text) => kyselySql.raw(text).execute(trx))),
      close: () => kysely.destroy(),
    };
  }],
  [
    'Drizzle',
    () => {
    const pool = new pg.Pool({ connectionString: t.db.url, max: 2 });
    const orm = drizzle(pool);
    return {
      name: 'Drizzle',
      transaction: (fn) => orm.transaction((tx) => fn(fromDrizzle(tx), (text) => tx.execute(drizzleSql.raw(text)))),
      close: () => pool.end(),
    };
  }],
  [
    'Kysely with CamelCasePlugin',
    () => {
    const kysely = new Kysely<never>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: t.db.url, max: 2 }) }), plugins: [new CamelCasePlugin()] });
    return {
      name: 'Kysely with CamelCasePlugin',
      transaction: (fn) => kysely.transaction().execute((trx) => fn(fromKysely(trx), (text) => kyselySql.raw(text).execute(trx))),
      close: () => kysely.destroy(),
    };
  }],
  [
    'Drizzle on postgres.js',
    () => {
    const client = postgres(t.db.url, { max: 2, onnotice: () => {} });
    const orm = drizzlePostgresJs(client);
    return {
      name: 'Drizzle on postgres.js',
      transaction: (fn) => orm.transaction((tx) => fn(fromDrizzle(tx), (text) => tx.execute(drizzleSql.raw(text)))),
      close: () => client.end(),
    };
  }],
  [
    'Knex with camel-cased rows',
    () => {
    const camel = (key: string) => key.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
    const knex = knexFactory({
      client: 'pg',
      connection: t.db.url,
      pool: { min: 0, max: 2 },
      postProcessResponse: (result: { rows?: Record<string, unknown>[] }) => {
        if (result?.rows) result.rows = result.rows.map((row) => Object.fromEntries(Object.entries(row).map(([k, v]) => [camel(k), v])));
        return result;
      },
    });
    return {
      name: 'Knex with camel-cased rows',
      transaction: (fn) => knex.transaction((trx) => fn(fromKnex(trx), (text) => trx.raw(text))),
      close: () => knex.destroy(),
    };
  }],
  [
    'Knex',
    () => {
    const knex = knexFactory({ client: 'pg', connection: t.db.url, pool: { min: 0, max: 2 } });
    return {
      name: 'Knex',
      transaction: (fn) => knex.transaction((trx) => fn(fromKnex(trx), (text) => trx.raw(text))),
      close: () => knex.destroy(),
    };
  }],
  [
    'Prisma',
    () => {
    const client = prisma!.connect(t.db.url, 2);
    return {
      name: 'Prisma',
      transaction: (fn) => client.$transaction((tx) => fn(fromPrisma(tx), (text) => tx.$queryRawUnsafe(text))),
      close: () => client.$disconnect(),
    };
  }],
];

const eventsFor = async (usageId: string) =>
  (await t.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM outbox WHERE tenant_id = $1 AND usage_id = $2', ['acme', usageId])).rows[0]!.n;

describe.each(drivers)('%s', (_name, make) => {
  let driver: Driver;
  beforeAll(() => void (driver = make()));
  afterAll(() => driver.close());

  it('a commit leaves one event, with the values given', async () => {
    const usageId = randomUUID();
    const at = new Date('2026-12-01T08:00:00.250Z');
    const { entry, created } = await driver.transaction((c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 41, occurredAt: at }));
    expect(created).toBe(true);
    // Numbers and a Date whatever the driver's own parsing (bigint as text, Drizzle's timestamps as text).
    expect(entry).toMatchObject({ tenantId: 'acme', usageId, quantity: 41, status: 'pending', eventName: 'api_requests' });
    expect(typeof entry.id).toBe('number');
    expect(entry.occurredAt).toEqual(at);
    expect(await eventsFor(usageId)).toBe(1);
  });

  it('a session in another time zone: the instant given is stored, returned, and its repeat matches', async () => {
    const usageId = randomUUID();
    const at = new Date('2026-12-01T08:00:00.250Z');
    const inNewYork = <T,>(fn: (c: TransactionClient) => Promise<T>) =>
      driver.transaction(async (c, own) => {
        await own("SET LOCAL TimeZone = 'America/New_York'");
        return fn(c);
      });
    const { entry } = await inNewYork((c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 5, occurredAt: at }));
    expect(entry.occurredAt).toEqual(at);
    const { rows } = await t.pool.query<{ occurred_at: Date }>('SELECT occurred_at FROM outbox WHERE tenant_id = $1 AND usage_id = $2', ['acme', usageId]);
    expect(rows[0]!.occurred_at).toEqual(at);
    // The same usage again: the same entry, not a conflict over its time.
    expect(await inNewYork((c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 5, occurredAt: at }))).toEqual({ created: false, entry });
  });

  it('a repeat after the outbox row was pruned is refused as recorded before, with the same values, in a session of another time zone', async () => {
    const usageId = randomUUID();
    const at = new Date('2026-12-01T08:00:00.250Z');
    await driver.transaction((c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 4, occurredAt: at }));
    await t.pool.query('DELETE FROM outbox WHERE tenant_id = $1 AND usage_id = $2', ['acme', usageId]);
    const again = await driver
      .transaction(async (c, own) => {
        await own("SET LOCAL TimeZone = 'America/New_York'");
        return recordUsage(c, { tenantId: 'acme', usageId, quantity: 4, occurredAt: at });
      })
      .catch((e: unknown) => e);
    expect(again).toMatchObject({ code: 'already_recorded', message: expect.stringContaining('was recorded before, with these values') });
  });

  it('a rollback leaves none', async () => {
    const usageId = randomUUID();
    await expect(
      driver.transaction(async (c) => {
        await recordUsage(c, { tenantId: 'acme', usageId, quantity: 1 });
        throw new Error('the application changed its mind');
      }),
    ).rejects.toThrow('changed its mind');
    expect(await eventsFor(usageId)).toBe(0);
  });

  it('a repeat adds nothing and returns the first entry', async () => {
    const usageId = randomUUID();
    const first = await driver.transaction((c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 3 }));
    const again = await driver.transaction(async (c) => {
      // Twice in one transaction too.
      await recordUsage(c, { tenantId: 'acme', usageId, quantity: 3 });
      return recordUsage(c, { tenantId: 'acme', usageId, quantity: 3 });
    });
    expect(again).toEqual({ created: false, entry: first.entry });
    expect(await eventsFor(usageId)).toBe(1);
  });

  it('bad input throws a UsageError before anything is written, and the transaction goes on', async () => {
    const usageId = randomUUID();
    const afterwards = await driver.transaction(async (c, own) => {
      await expect(recordUsage(c, { tenantId: 'acme', usageId, quantity: 0 })).rejects.toBeInstanceOf(InvalidUsageError);
      await expect(recordUsage(c, { tenantId: 'nobody', usageId, quantity: 1 })).rejects.toBeInstanceOf(UnknownTenantError);
      // The transaction is not aborted: the application's own statement and a good usage still run.
      await own('SELECT 1');
      return recordUsage(c, { tenantId: 'acme', usageId, quantity: 2 });
    });
    expect(afterwards.created).toBe(true);
    expect(await eventsFor(usageId)).toBe(1);
  });
});

it("rows renamed past reading (a plugin that upper-cases columns): recordUsage says so, and it is not a UsageError (the rows may be written: roll back)", async () => {
  const client = await t.pool.connect();
  try {
    await client.query('BEGIN');
    const shouting: TransactionClient = {
      async query(statement) {
        const { rows } = await client.query(statement);
        return { rows: rows.map((row: Record<string, unknown>) => Object.fromEntries(Object.entries(row).map(([k, v]) => [k.toUpperCase(), v]))) };
      },
    };
    const err = await recordUsage(shouting, { tenantId: 'acme', usageId: randomUUID(), quantity: 1 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnreadableRowsError);
    expect(err).not.toBeInstanceOf(UsageError);
    expect((err as Error).message).toContain('columns: KNOWN, ID, KEY');
  } finally {
    await client.query('ROLLBACK');
    client.release();
  }
});

it('answered with the rows alone (not `{ rows }`: a driver like pg-promise, a Knex postProcessResponse): recordUsage says it could not read them, not a TypeError', async () => {
  const client = await t.pool.connect();
  try {
    await client.query('BEGIN');
    const bare = { query: async (statement: { text: string; values: unknown[] }) => (await client.query(statement)).rows } as unknown as TransactionClient;
    const err = await recordUsage(bare, { tenantId: 'acme', usageId: randomUUID(), quantity: 1 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnreadableRowsError);
    expect((err as Error).message).toContain("the client answered the rows alone (first row's columns: known, id, key");
    // A Knex transaction whose postProcessResponse answers the rows: read as rows.
    const knex = knexFactory({ client: 'pg', connection: t.db.url, pool: { min: 0, max: 1 }, postProcessResponse: (result: { rows?: unknown }) => result?.rows ?? result });
    try {
      const recorded = await knex.transaction((trx) => recordUsage(fromKnex(trx), { tenantId: 'acme', usageId: randomUUID(), quantity: 1 }));
      expect(recorded.created).toBe(true);
    } finally {
      await knex.destroy();
    }
  } finally {
    await client.query('ROLLBACK');
    client.release();
  }
});

it('a pool, an idle client or an ORM instance instead of its transaction is refused before any statement: each statement on it would commit on its own', async () => {
  const pool = new pg.Pool({ connectionString: t.db.url, max: 1 });
  const idle = new pg.Client({ connectionString: t.db.url });
  const committed = new pg.Client({ connectionString: t.db.url });
  await Promise.all([idle.connect(), committed.connect()]);
  await committed.query('BEGIN');
  await committed.query('COMMIT');
  const kysely = new Kysely<never>({ dialect: new PostgresDialect({ pool }) });
  const knex = knexFactory({ client: 'pg', connection: t.db.url, pool: { min: 0, max: 1 } });
  const postgresJs = postgres(t.db.url, { max: 1 });
  const client = prisma!.connect(t.db.url, 1);
  const usageId = randomUUID();
  try {
    const refusals: [string, () => Promise<unknown>][] = [
      ['a pg.Pool', () => recordUsage(pool, { tenantId: 'acme', usageId, quantity: 1 })],
      ['a pg.Pool', async () => recordUsage(withoutPreparedStatements(pool), { tenantId: 'acme', usageId, quantity: 1 })],
      ['a client outside a transaction', () => recordUsage(idle, { tenantId: 'acme', usageId, quantity: 1 })],
      ['a client outside a transaction', () => recordUsage(committed, { tenantId: 'acme', usageId, quantity: 1 })],
      ['a client outside a transaction', async () => recordUsage(withoutPreparedStatements(idle), { tenantId: 'acme', usageId, quantity: 1 })],
      ['a Kysely instance', async () => fromKysely(kysely)],
      ['a Drizzle database', async () => fromDrizzle(drizzle(pool))],
      ['a Drizzle database', async () => fromDrizzle(drizzlePostgresJs(postgresJs))],
      ['a Knex instance', async () => fromKnex(knex)],
      ['a Prisma client', async () => fromPrisma(client as unknown as Parameters<typeof fromPrisma>[0])],
    ];
    for (const [given, attempt] of refusals) {
      const err = await attempt().catch((e: unknown) => e);
      expect(err, given).toBeInstanceOf(NotATransactionError);
      expect((err as Error).message, given).toContain(`was given ${given}`);
    }
    expect(await eventsFor(usageId)).toBe(0);
    // A BEGIN sent but not awaited yet is on its way: the client is taken as in its transaction.
    const begun = idle.query('BEGIN');
    await recordUsage(idle, { tenantId: 'acme', usageId, quantity: 1 });
    await begun;
    await idle.query('ROLLBACK');
    // Wrapped before its BEGIN (as importUsage does): each statement is judged when it is sent.
    const unprepared = withoutPreparedStatements(committed);
    await committed.query('BEGIN');
    await recordUsage(unprepared, { tenantId: 'acme', usageId, quantity: 1 });
    await committed.query('ROLLBACK');
    expect(await eventsFor(usageId)).toBe(0);
  } finally {
    await idle.end();
    await committed.end();
    await client.$disconnect();
    await postgresJs.end();
    await knex.destroy();
    await kysely.destroy();
  }
});
