/**
 * recordUsage behind PgBouncer in transaction pooling, the real one (scripts/tools.sh --test-server
 * unpacks Debian's package), in front of the test PostgreSQL: many client connections share a few
 * server connections, so one client's successive transactions run on different servers.
 *
 * What it shows: recordUsage's named statement (node-postgres prepares it once per connection)
 * breaks behind a PgBouncer that does not track prepared statements (before 1.21, or
 * max_prepared_statements = 0); `withoutPreparedStatements(client)` and the ORM adapters (which never
 * name statements) work: commit leaves one event, rollback none, a duplicate nothing more.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, chown, mkdtemp, rm, writeFile } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { drizzle } from 'drizzle-orm/node-postgres';
import Fastify, { type FastifyInstance } from 'fastify';
import knexFactory from 'knex';
import { Kysely, PostgresDialect } from 'kysely';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { PROJECT_ROOT } from '../src/embedded/temporal.js';
import { importUsage, recordUsage, withoutPreparedStatements, withTransaction, type RecordUsageResult, type TransactionClient } from '../src/index.js';
import billingOutbox from '../src/fastify.js';
import { fromDrizzle } from '../src/outbox/adapters/drizzle.js';
import { fromKnex } from '../src/outbox/adapters/knex.js';
import { fromKysely } from '../src/outbox/adapters/kysely.js';
import { fromPrisma } from '../src/outbox/adapters/prisma.js';
import { useDatabase } from './hooks.js';
import { generatePrismaClient, type GeneratedPrisma } from './prisma.js';

const t = useDatabase({ customers: { acme: 'cus_acme' } });

/** Server connections per database: far fewer than the clients' connections. */
const SERVER_CONNECTIONS = 3;
const CLIENT_CONNECTIONS = 12;

const recorded = path.join(PROJECT_ROOT, '.tools', 'pgbouncer-path');
const executable = existsSync(recorded) ? readFileSync(recorded, 'utf8').trim() : '';
// A developer's machine without Debian's packages skips this file; CI must not.
if (!executable && process.env.CI) throw new Error('no PgBouncer: scripts/tools.sh --test-server did not find or fetch one');

function versionOf(file: string): [number, number] {
  const first = execFileSync(file, ['--version'], { encoding: 'utf8' }).split('\n')[0]!;
  const [, major, minor] = /PgBouncer (\d+)\.(\d+)/.exec(first) ?? [];
  return [Number(major), Number(minor)];
}

async function freePort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as net.AddressInfo;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

interface Bouncer {
  version: [number, number];
  /** The URL of the test database through PgBouncer. */
  url: string;
  stop(): Promise<void>;
}

async function startPgBouncer(databaseUrl: string): Promise<Bouncer> {
  const version = versionOf(executable);
  // 1.21+ can keep named statements across server connections (max_prepared_statements); off
  // here, as in many deployments, so that what breaks a plain client breaks here on every version.
  const knowsPreparedStatements = version[0] > 1 || version[1] >= 21;
  const server = new URL(databaseUrl);
  const user = decodeURIComponent(server.username);
  const password = decodeURIComponent(server.password);
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-pgbouncer-'));
  const port = await freePort();
  const quoted = (s: string) => `"${s.replace(/"/g, '""')}"`;
  await writeFile(path.join(dir, 'users.txt'), `${quoted(user)} ${quoted(password)}\n`, { mode: 0o600 });
  await writeFile(
    path.join(dir, 'pgbouncer.ini'),
    [
      '[databases]',
      `app = host=${server.hostname} port=${server.port} dbname=${server.pathname.slice(1)} pool_size=${SERVER_CONNECTIONS}`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      'unix_socket_dir =',
      'auth_type = scram-sha-256',
      `auth_file = ${path.join(dir, 'users.txt')}`,
      'pool_mode = transaction',
      `max_client_conn = ${CLIENT_CONNECTIONS * 4}`,
      // Older ones refuse the setting.
      ...(knowsPreparedStatements ? ['max_prepared_statements = 0'] : []),
      '',
    ].join('\n'),
  );
  // PgBouncer refuses to run as root: as root, it runs as the `postgres` user the embedded
  // PostgreSQL already runs as (-u), which must own its files.
  const asRoot = process.getuid?.() === 0;
  if (asRoot) {
    const id = (flag: string) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim());
    for (const file of ['', 'users.txt', 'pgbouncer.ini']) await chown(path.join(dir, file), id('-u'), id('-g'));
    await chmod(dir, 0o700);
  }
  const child: ChildProcess = spawn(executable, [...(asRoot ? ['-u', 'postgres'] : []), path.join(dir, 'pgbouncer.ini')], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  child.stderr!.on('data', (chunk: Buffer) => (log += chunk.toString()));
  const url = new URL(databaseUrl);
  url.hostname = '127.0.0.1';
  url.port = String(port);
  url.pathname = '/app';
  for (let tries = 0; ; tries++) {
    if (child.exitCode !== null) throw new Error(`PgBouncer exited with ${child.exitCode}: ${log}`);
    const probe = new pg.Client({ connectionString: url.toString() });
    try {
      await probe.connect();
      await probe.query('SELECT 1');
      await probe.end();
      break;
    } catch (err) {
      await probe.end().catch(() => undefined);
      if (tries > 100) throw new Error(`PgBouncer did not answer: ${String(err)}\n${log}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
  return {
    version,
    url: url.toString(),
    async stop() {
      const exited = new Promise((resolve) => child.once('exit', resolve));
      child.kill('SIGTERM');
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}

/** One way to open a transaction through PgBouncer; `fn` gets recordUsage's client. */
interface Driver {
  transaction<T>(fn: (client: TransactionClient) => Promise<T>): Promise<T>;
  close(): Promise<void>;
}

function nodePostgres(url: string, wrap: (client: pg.PoolClient) => TransactionClient): Driver {
  const pool = new pg.Pool({ connectionString: url, max: CLIENT_CONNECTIONS });
  return {
    transaction: (fn) => withTransaction(pool, (client) => fn(wrap(client))),
    close: () => pool.end(),
  };
}

const backendPid = async (client: TransactionClient) =>
  Number(((await client.query({ text: 'SELECT pg_backend_pid() AS pid', values: [] })).rows[0] as { pid: number }).pid);

const eventsFor = async (usageId: string) =>
  (await t.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM outbox WHERE tenant_id = $1 AND usage_id = $2', ['acme', usageId])).rows[0]!.n;

/**
 * Forty transactions at once over CLIENT_CONNECTIONS client connections and SERVER_CONNECTIONS
 * server connections: a quarter roll back, a quarter record a usage that a concurrent transaction
 * records too, the rest commit. Returns the server process ids the transactions ran on.
 */
async function concurrentWorkload(driver: Pick<Driver, 'transaction'>): Promise<Set<number>> {
  const pids = new Set<number>();
  const record = (usageId: string, rollback = false) =>
    driver.transaction(async (client) => {
      pids.add(await backendPid(client));
      const result = await recordUsage(client, { tenantId: 'acme', usageId, quantity: 5 });
      if (rollback) throw new RolledBack();
      return result;
    });
  const committed: string[] = [];
  const rolledBack: string[] = [];
  const twice: string[] = [];
  const runs: Promise<unknown>[] = [];
  for (let i = 0; i < 40; i++) {
    const usageId = randomUUID();
    if (i % 4 === 0) {
      rolledBack.push(usageId);
      runs.push(record(usageId, true).catch((err: unknown) => expect(err).toBeInstanceOf(RolledBack)));
    } else if (i % 4 === 1) {
      twice.push(usageId);
      runs.push(
        Promise.all([record(usageId), record(usageId)]).then(([a, b]: RecordUsageResult[]) => {
          expect([a!.created, b!.created].sort()).toEqual([false, true]);
          expect(a!.entry).toEqual(b!.entry);
        }),
      );
    } else {
      committed.push(usageId);
      runs.push(record(usageId).then((r) => expect(r.created).toBe(true)));
    }
  }
  await Promise.all(runs);
  for (const usageId of [...committed, ...twice]) expect(await eventsFor(usageId)).toBe(1);
  for (const usageId of rolledBack) expect(await eventsFor(usageId)).toBe(0);
  return pids;
}

class RolledBack extends Error {}

describe.skipIf(!executable)('behind PgBouncer in transaction pooling', () => {
  let bouncer: Bouncer;
  let prisma: GeneratedPrisma;
  beforeAll(async () => {
    [bouncer, prisma] = await Promise.all([startPgBouncer(t.db.url), generatePrismaClient()]);
  }, 120_000);
  afterAll(async () => {
    await bouncer?.stop();
    await prisma?.remove();
  });

  it(`recordUsage with a node-postgres client as it is: works only where PgBouncer tracks prepared statements`, async () => {
    // Two client connections taking turns: PgBouncer hands each transaction the server connection
    // used last, so b's Parse of the named statement meets the one a left there ("already exists");
    // under load, a Bind also reaches a server that never saw the Parse ("does not exist").
    const a = new pg.Client({ connectionString: bouncer.url });
    const b = new pg.Client({ connectionString: bouncer.url });
    await Promise.all([a.connect(), b.connect()]);
    try {
      const once = async (client: pg.Client) => {
        await client.query('BEGIN');
        try {
          const result = await recordUsage(client, { tenantId: 'acme', usageId: randomUUID(), quantity: 1 });
          await client.query('COMMIT');
          return result;
        } catch (err) {
          await client.query('ROLLBACK');
          throw err;
        }
      };
      const failures: string[] = [];
      for (const client of [a, b, a, b, a, b]) await once(client).catch((err: unknown) => failures.push(String(err)));
      expect(failures.length, `PgBouncer ${bouncer.version.join('.')}`).toBeGreaterThan(0);
      for (const failure of failures) expect(failure).toMatch(/prepared statement "billing_outbox\/record-usage" (already exists|does not exist)/);
    } finally {
      await Promise.all([a.end(), b.end()]);
    }
  });

  it('withoutPreparedStatements(client): commit, rollback and duplicates hold while transactions move between server connections', async () => {
    const driver = nodePostgres(bouncer.url, (client) => withoutPreparedStatements(client));
    try {
      const pids = await concurrentWorkload(driver);
      expect(pids.size).toBeGreaterThan(1);
      expect(pids.size).toBeLessThanOrEqual(SERVER_CONNECTIONS);
    } finally {
      await driver.close();
    }
  });

  it('the Kysely adapter works as it is', async () => {
    const kysely = new Kysely<never>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: bouncer.url, max: CLIENT_CONNECTIONS }) }) });
    try {
      await concurrentWorkload({ transaction: (fn) => kysely.transaction().execute((trx) => fn(fromKysely(trx))) });
    } finally {
      await kysely.destroy();
    }
  });

  it('the Drizzle adapter works as it is', async () => {
    const pool = new pg.Pool({ connectionString: bouncer.url, max: CLIENT_CONNECTIONS });
    const orm = drizzle(pool);
    try {
      await concurrentWorkload({ transaction: (fn) => orm.transaction((tx) => fn(fromDrizzle(tx))) });
    } finally {
      await pool.end();
    }
  });

  it('the Knex adapter works as it is', async () => {
    const knex = knexFactory({ client: 'pg', connection: bouncer.url, pool: { min: 0, max: CLIENT_CONNECTIONS } });
    try {
      await concurrentWorkload({ transaction: (fn) => knex.transaction((trx) => fn(fromKnex(trx))) });
    } finally {
      await knex.destroy();
    }
  });

  it("the Fastify plugin on the application's pool, with preparedStatements: false: every usage recorded once", async () => {
    const pool = new pg.Pool({ connectionString: bouncer.url, max: CLIENT_CONNECTIONS, connectionTimeoutMillis: 10_000 });
    const writer = { name: 'bouncer', token: `tok_${randomUUID()}`, tenants: ['*'], scopes: ['usage:write' as const] };
    const post = (app: FastifyInstance, usageId: string) =>
      app.inject({ method: 'POST', url: '/v1/usage', headers: { authorization: `Bearer ${writer.token}` }, payload: { tenant_id: 'acme', usage_id: usageId, quantity: 3 } });
    const serve = async (preparedStatements?: boolean) => {
      const app = Fastify();
      await app.register(billingOutbox, { pool, tokens: [writer], ...(preparedStatements === undefined ? {} : { preparedStatements }) });
      return app;
    };
    try {
      // As it is: named statements, which this PgBouncer loses between server connections.
      const named = await serve();
      const asItIs = await Promise.all(Array.from({ length: 20 }, () => post(named, randomUUID())));
      expect(asItIs.filter((r) => r.statusCode === 500).length).toBeGreaterThan(0);
      await named.close();

      const app = await serve(false);
      const ids = Array.from({ length: 20 }, () => randomUUID());
      // Each twice, at once: one 201 and one 200 per usage.
      const answers = await Promise.all([...ids, ...ids].map((id) => post(app, id)));
      expect(answers.map((r) => r.statusCode).sort()).toEqual([...Array(20).fill(200), ...Array(20).fill(201)]);
      for (const id of ids) expect(await eventsFor(id)).toBe(1);
      await app.close();
    } finally {
      await pool.end();
    }
  });

  it('importUsage with preparedStatements: false: every batch recorded while imports share the server connections', async () => {
    const pool = new pg.Pool({ connectionString: bouncer.url, max: CLIENT_CONNECTIONS });
    const files = Array.from({ length: 4 }, () => Array.from({ length: 30 }, () => randomUUID()));
    const run = (ids: string[]) =>
      importUsage(pool, ids.map((id) => JSON.stringify({ tenant_id: 'acme', usage_id: id, quantity: 2 })), { batchSize: 5, preparedStatements: false });
    try {
      // Four imports at once: their batches' transactions move between the three server connections.
      for (const summary of await Promise.all(files.map(run))) expect(summary).toMatchObject({ read: 30, recorded: 30, refused: 0 });
      for (const summary of await Promise.all(files.map(run))) expect(summary).toMatchObject({ read: 30, alreadyRecorded: 30, refused: 0 });
      for (const id of files.flat()) expect(await eventsFor(id)).toBe(1);
    } finally {
      await pool.end();
    }
  });

  it('the Prisma adapter works as it is (interactive transactions, @prisma/adapter-pg)', async () => {
    const client = prisma.connect(bouncer.url, CLIENT_CONNECTIONS);
    try {
      await concurrentWorkload({ transaction: (fn) => client.$transaction((tx) => fn(fromPrisma(tx)), { timeout: 30_000 }) });
    } finally {
      await client.$disconnect();
    }
  });
});
