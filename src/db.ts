/**
 * PostgreSQL access: the pool, and the migration runner.
 */
import { readdir, readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import net, { type Socket } from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { schemaFor } from './outbox/sql/schema.js';

export type Queryable = Pick<pg.ClientBase, 'query'>;

/**
 * pg's own text parsers (pg-types', pg's dependency, reached through pg), in a table of ours. The
 * application may have replaced some in `pg.types` (timestamps kept as strings, numbers as
 * something else): our statements read what they read as pg ships it, whatever it did.
 */
const PG_PARSERS: ReadonlyMap<number, (value: string) => unknown> = (() => {
  const parsers = new Map<number, (value: string) => unknown>();
  const fromPg = createRequire(createRequire(import.meta.url).resolve('pg'));
  (fromPg('pg-types/lib/textParsers') as { init(register: (oid: number, parse: (value: string) => unknown) => void): void }).init((oid, parse) =>
    parsers.set(oid, parse),
  );
  return parsers;
})();

/** pg's parser for a type it has none for: the text as it came. */
const asText = (value: string) => value;

/**
 * The type parsers of billing-outbox's own connections and statements: bigint columns (quantities,
 * ids, counts) as numbers, since every value we store fits in one (quantities are capped at
 * Number.MAX_SAFE_INTEGER by recordUsage); everything else as pg parses it out of the box
 * (PG_PARSERS). Given per pool or per query, never set on `pg.types`: that is the application's, and
 * importing a library must not change how its own queries read bigint, nor may the application's
 * changes there change how ours read a timestamp.
 */
export const pgTypes: pg.CustomTypesConfig = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') => {
    if (format === 'binary') return pg.types.getTypeParser(oid, 'binary');
    if (oid === pg.types.builtins.INT8) return (v: string) => Number(v);
    return PG_PARSERS.get(oid) ?? asText;
  }) as pg.CustomTypesConfig['getTypeParser'],
};

/**
 * An application's pool seen through billing-outbox's type parsers: every query made through it,
 * or through a client it hands out, carries `pgTypes`. `waitMs`: a caller that has had no
 * connection for this long fails as PostgreSQL unavailable (createPool's waitMs, for the worker's
 * deliveries on the application's pool). The pool itself, its clients and `pg.types`
 * are left as they were, so the application's own queries read bigint as before. Used where the
 * application gives us its pool (the worker library, the Fastify plugin); our own pools get
 * `pgTypes` at creation instead. `answerMs`: each of our statements through it that names no
 * `query_timeout` gets this one (answeredWithin), as our own pools give theirs.
 */
export function withPgTypes(pool: pg.Pool, opts: { answerMs?: number; waitMs?: number } = {}): pg.Pool {
  type Query = (first: unknown, ...rest: unknown[]) => unknown;
  const ours = opts.answerMs === undefined ? { types: pgTypes } : { types: pgTypes, query_timeout: opts.answerMs };
  const typed = (query: Query): Query => (first, ...rest) => {
    if (typeof first === 'string') return query({ text: first, ...ours }, ...rest);
    // A submittable (a cursor, a stream) brings its own reader; a config keeps what it names.
    if (first !== null && typeof first === 'object' && !('submit' in first)) return query({ ...ours, ...first }, ...rest);
    return query(first, ...rest);
  };
  const view = <T extends object>(target: T, own: (prop: string | symbol) => unknown): T =>
    new Proxy(target, {
      get(t, prop) {
        const special = own(prop);
        if (special !== undefined) return special;
        const value: unknown = Reflect.get(t, prop, t);
        return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(t) : value;
      },
    });
  // pg-pool takes its own 'error' listener off a client it lends: the server going away while we
  // hold one (a restart, a failover) would then throw in the application's process. We listen while
  // we hold it (the next statement on it fails, as on our own pools) and stop when it goes back.
  const client = (c: pg.PoolClient): pg.PoolClient => {
    const ignore = () => undefined;
    c.on('error', ignore);
    const release = (err?: Error | boolean) => {
      c.removeListener('error', ignore);
      return c.release(err);
    };
    return view(c, (prop) => (prop === 'query' ? typed(c.query.bind(c) as Query) : prop === 'release' ? release : undefined));
  };
  const { waitMs } = opts;
  // With waitMs: a client within it, or NO_CONNECTION_IN_TIME (as createPool's waitMs gives our own
  // pools); one that comes free after the caller gave up goes straight back.
  const connectWithin = (ms: number) =>
    new Promise<pg.PoolClient>((resolve, reject) => {
      let gaveUp = false;
      const timer = setTimeout(() => {
        gaveUp = true;
        reject(new Error(NO_CONNECTION_IN_TIME));
      }, ms);
      pool.connect((err, c, done) => {
        clearTimeout(timer);
        if (gaveUp) return void (c && done());
        if (err || !c) reject(err ?? new Error(NO_CONNECTION_IN_TIME));
        else resolve(client(c));
      });
    });
  const boundedQuery = (ms: number): Query => async (first, ...rest) => {
    const c = await connectWithin(ms);
    try {
      const result = await (c.query as unknown as Query)(first, ...rest);
      c.release();
      return result;
    } catch (err) {
      c.release(connectionLost(err) ? (err as Error) : undefined);
      throw err;
    }
  };
  return view(pool, (prop) => {
    if (prop === 'query') {
      return ((first: unknown, ...rest: unknown[]) => {
        // A callback or a submittable (a cursor, a stream) goes the pool's own way, unbounded.
        const plain = typeof rest.at(-1) !== 'function' && !(first !== null && typeof first === 'object' && 'submit' in first);
        return waitMs !== undefined && plain ? boundedQuery(waitMs)(first, ...rest) : typed(pool.query.bind(pool) as Query)(first, ...rest);
      }) as Query;
    }
    if (prop === 'connect' && waitMs !== undefined) {
      return (cb?: (err: Error | undefined, c: pg.PoolClient | undefined, done: (release?: unknown) => void) => void) => {
        const connecting = connectWithin(waitMs);
        if (!cb) return connecting;
        connecting.then(
          (c) => cb(undefined, c, (release?: unknown) => c.release(release as Error | boolean | undefined)),
          (err: unknown) => cb(err as Error, undefined, () => undefined),
        );
        return undefined;
      };
    }
    if (prop === 'connect') {
      return (cb?: (err: Error | undefined, c: pg.PoolClient | undefined, done: (release?: unknown) => void) => void) =>
        cb
          ? pool.connect((err, c, done) => {
              const ours = c && client(c);
              cb(err, ours, (release?: unknown) => (ours ? ours.release(release as Error | boolean | undefined) : done(release)));
            })
          : pool.connect().then(client);
    }
    return undefined;
  });
}

/**
 * `answerMs`: every statement of the pool unanswered this long fails as PostgreSQL away and its
 * connection is dropped (answeredWithin, for a pool whose every statement is quick: the API's).
 * `waitMs`: a caller that has had no connection (free or newly opened) for this long fails as
 * PostgreSQL unavailable instead of waiting on: for a pool whose callers have deadlines of their
 * own (the worker's deliveries, whose attempt would time out in the queue and be counted as failed,
 * where a database too busy to answer must cost no attempt).
 */
export function createPool(databaseUrl: string, max = 10, opts: { answerMs?: number; waitMs?: number } = {}): pg.Pool {
  const pool = new pg.Pool({
    connectionString: databaseUrl,
    max,
    application_name: 'billing-outbox',
    types: pgTypes,
    Client: ClosingClient,
    ...(opts.answerMs === undefined ? {} : { query_timeout: opts.answerMs }),
    ...(opts.waitMs === undefined ? {} : { connectionTimeoutMillis: opts.waitMs }),
  });
  // An idle client losing its connection (server restart) must not crash the process; the pool
  // discards it and the next query opens a new one.
  pool.on('error', () => undefined);
  // Nor may a checked-out client that loses it between two queries (inside a transaction): its
  // 'error' event would have no listener and end the process. The next query on it fails, and the
  // pool drops it when it is released (it is no longer queryable).
  pool.on('connect', (client) => client.on('error', () => undefined));
  return pool;
}

const MIGRATIONS_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', 'migrations');
// Arbitrary constant: the advisory lock that serialises concurrent migrators.
const MIGRATION_LOCK = 727_274_001;
/**
 * The first line of a migration that must run outside a transaction: `CREATE INDEX CONCURRENTLY`
 * and `ALTER TABLE … VALIDATE CONSTRAINT` (after `ADD … NOT VALID`), which let the application go
 * on writing while they run. Such a file holds plain statements, one per `;` at a line's end (no
 * function bodies), each safe to run again: the file is recorded as applied only when all of them
 * have succeeded, and a run cut short repeats it from the top.
 */
const NO_TRANSACTION = '-- billing-outbox: no transaction';

/**
 * Refuses a database whose encoding is not UTF-8. Ids and names are Unicode, limited in characters
 * (validate.ts) and checked so by the tables: in SQL_ASCII (what `initdb` makes under a C or POSIX
 * locale, as in many containers) `length()` counts bytes, so a valid 90-character usage id of
 * Chinese text fails its CHECK inside the caller's transaction; LATIN1 cannot store it at all.
 */
async function requireUtf8(client: pg.Client): Promise<void> {
  const { rows } = await client.query<{ name: string; encoding: string }>(
    'SELECT datname AS name, pg_encoding_to_char(encoding) AS encoding FROM pg_database WHERE datname = current_database()',
  );
  const db = rows[0];
  if (db && db.encoding !== 'UTF8') {
    throw new Error(
      `database ${JSON.stringify(db.name)} uses the encoding ${db.encoding}; billing-outbox needs UTF8 (tenant ids, usage ids and event names are Unicode text, ` +
        `their limits counted in characters). Create a database with CREATE DATABASE … ENCODING 'UTF8' TEMPLATE template0 and migrate that one`,
    );
  }
}

/**
 * Applies every `migrations/NNN_*.sql` file not yet applied to the schema `opts.schema` (default
 * `billing_outbox`; created if missing, and its own `schema_migrations` says what is applied), in
 * order: each in its own transaction, or statement by statement when it starts with NO_TRANSACTION. Safe when several processes migrate
 * at once: they take turns on an advisory lock and the later ones find nothing left to do. Returns
 * the names it applied.
 *
 * Migrations must not block the application's inserts for the length of a table scan: indexes on
 * the outbox are built CONCURRENTLY, new constraints added NOT VALID and validated apart (see
 * docs/operations.md, "Upgrading"; test/migrate.test.ts records usage while one runs).
 */
export function migrate(database: string | pg.ClientConfig, opts: MigrateOptions = {}): Promise<string[]> {
  return applyMigrations(database, MIGRATIONS_DIR, opts);
}

export interface MigrateOptions {
  schema?: string;
  /** Told, when a migration waits (for another migrator, for a table's lock), what it waits for. */
  onWait?: (message: string) => void;
}

/**
 * migrate, with the migrations of `folder`: the files there not yet recorded in the schema's
 * `schema_migrations` are applied (tests apply migrations of their own on top of this version's).
 */
export async function applyMigrations(
  database: string | pg.ClientConfig,
  folder: string,
  opts: MigrateOptions = {},
): Promise<string[]> {
  if (typeof database === 'string' ? database.trim() === '' : typeof database !== 'object' || database === null) {
    throw new TypeError(`migrate needs a PostgreSQL connection string (postgres://…) or connection settings, got ${JSON.stringify(database) ?? String(database)}: is DATABASE_URL set?`);
  }
  const schema = schemaFor(opts.schema);
  // A URL, or an application pool's connection settings (`pool.options`): the migrator holds an
  // advisory lock on a connection of its own, never one of the application's pool.
  // Not the application's time limits: an index built CONCURRENTLY over a big outbox outlasts any
  // statement_timeout meant for requests, and cancelled, it was dropped and begun again on every run.
  const { statement_timeout: _statementTimeout, query_timeout: _queryTimeout, ...settings } = typeof database === 'string' ? { connectionString: database } : database;
  const client = new pg.Client(connectingWithin({ ...settings, application_name: 'billing-outbox-migrate', types: pgTypes }));
  // The server going away mid-migration fails the statement under way; without a listener, its
  // 'error' event would end the process that migrates (an application's, through createWorker).
  client.on('error', () => undefined);
  await client.connect();
  try {
    // Nor a role's or database's own (set for the application): each transactional migration sets
    // its lock wait itself (MIGRATION_LOCK_WAIT_MS).
    await client.query('SET statement_timeout = 0; SET lock_timeout = 0');
    await requireUtf8(client);
    // Polled, not waited for: a migrator blocked inside pg_advisory_lock() would hold a snapshot,
    // and CREATE INDEX CONCURRENTLY in the lock holder waits for every older snapshot (a deadlock).
    // One lock for the whole database, whatever the schema: two migrators of different schemas
    // would otherwise meet the same way in each other's CREATE INDEX CONCURRENTLY.
    const waiting = new WaitReporter(opts.onWait);
    while (!(await client.query<{ ok: boolean }>('SELECT pg_try_advisory_lock($1) AS ok', [MIGRATION_LOCK])).rows[0]!.ok) {
      await waiting.say(async () => `another migrator holds the migration lock (${await lockHolder(client)}); waiting for it to finish`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    // Created only when missing: CREATE SCHEMA IF NOT EXISTS checks the right to create schemas in
    // the database before it looks, and a DBA may have created ours for a role without that right.
    const exists = (await client.query('SELECT 1 FROM pg_namespace WHERE nspname = $1::text', [schema.name])).rowCount! > 0;
    if (!exists) await client.query(`CREATE SCHEMA IF NOT EXISTS ${schema.quoted}`);
    // Likewise: CREATE TABLE IF NOT EXISTS checks the right to create in the schema first, and a
    // role granted only the use of its tables (the API's, under least privilege) has nothing to apply.
    const tracked = (await client.query<{ ok: boolean }>('SELECT to_regclass($1::text) IS NOT NULL AS ok', [schema.schemaMigrations])).rows[0]!.ok;
    if (!tracked) {
      await client.query(`CREATE TABLE IF NOT EXISTS ${schema.schemaMigrations} (
        name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`);
    }
    const done = new Set((await client.query<{ name: string }>(`SELECT name FROM ${schema.schemaMigrations}`)).rows.map((r) => r.name));
    const files = await migrationFiles(folder);
    const applied: string[] = [];
    for (const file of files) {
      if (done.has(file)) continue;
      const sql = await readFile(path.join(folder, file), 'utf8');
      // The files name their tables unqualified: they run with the schema alone as search_path
      // (pg_catalog is always searched first), so whatever they create goes into it and nothing
      // they name can be found in the application's schemas. Functions they define pin it
      // (`SET search_path FROM CURRENT`), so they do not depend on their caller's.
      try {
        if (sql.startsWith(NO_TRANSACTION)) {
          const previous = (await client.query<{ path: string }>(`SELECT current_setting('search_path') AS path`)).rows[0]!.path;
          await client.query(`SELECT set_config('search_path', $1::text, false)`, [schema.quoted]);
          try {
            for (const statement of splitStatements(sql)) {
              await runSaying(client, statement, waiting, (blockers) => `${file} is still running ${JSON.stringify(statement.slice(0, 60))}: ${blockers}`, () =>
                new pg.Client(connectingWithin({ ...settings, application_name: 'billing-outbox-migrate (watching)', types: pgTypes })),
              );
            }
          } finally {
            await client.query(`SELECT set_config('search_path', $1::text, false)`, [previous]);
          }
          await client.query(`INSERT INTO ${schema.schemaMigrations} (name) VALUES ($1)`, [file]);
        } else {
          // A table's lock it cannot have at once (a long transaction reads the outbox) is given
          // up after MIGRATION_LOCK_WAIT_MS and asked for again later: queued for it meanwhile,
          // it would hold every later statement on that table (the application's inserts, the
          // relay's claims) behind it for as long as that transaction lasts.
          for (let pause = 1_000; ; pause = Math.min(pause * 2, 10_000)) {
            await client.query('BEGIN');
            try {
              await client.query(`SELECT set_config('search_path', $1::text, true), set_config('lock_timeout', $2::text, true)`, [schema.quoted, `${MIGRATION_LOCK_WAIT_MS}ms`]);
              await client.query(sql);
              await client.query(`INSERT INTO ${schema.schemaMigrations} (name) VALUES ($1)`, [file]);
              await client.query('COMMIT');
              break;
            } catch (err) {
              await client.query('ROLLBACK');
              if ((err as { code?: string }).code !== LOCK_NOT_AVAILABLE) throw err;
            }
            await waiting.say(async () => `${file} cannot lock its tables yet (${await tableLockHolders(client, schema.name)}); trying again every few seconds`);
            await new Promise((resolve) => setTimeout(resolve, pause));
          }
        }
      } catch (err) {
        throw new Error(`migration ${file} failed: ${(err as Error).message}`, { cause: err });
      }
      applied.push(file);
    }
    return applied;
  } finally {
    await client.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => undefined);
    await client.end();
  }
}

/** How long a migration waits for a table's lock before it lets the statements queued behind it through. */
const MIGRATION_LOCK_WAIT_MS = 1_000;
const LOCK_NOT_AVAILABLE = '55P03';

/** Says what a migration waits for: at once, then every 10 s while it still waits (however often asked). */
class WaitReporter {
  private last = 0;
  private readonly onWait: ((message: string) => void) | undefined;
  constructor(onWait: ((message: string) => void) | undefined) {
    this.onWait = onWait;
  }

  /** Whether anyone is told. */
  get listening(): boolean {
    return this.onWait !== undefined;
  }

  async say(message: () => Promise<string>): Promise<void> {
    if (!this.onWait || Date.now() - this.last < 10_000) return;
    this.last = Date.now();
    this.onWait(await message().catch((err: unknown) => `waiting (${(err as Error).message})`));
  }
}

/**
 * Runs `statement` on `client`, and while it runs says what it waits for (`waiting` decides how
 * often: a look every second), asked over a second connection: CREATE INDEX CONCURRENTLY waits for every transaction that may write the
 * table (an application's long one that recorded usage, a dump's snapshot), without a word.
 */
async function runSaying(client: pg.Client, statement: string, waiting: WaitReporter, say: (blockers: string) => string, watcher: () => pg.Client): Promise<void> {
  if (!waiting.listening) {
    await client.query(statement);
    return;
  }
  const pid = (await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
  let side: pg.Client | undefined;
  let stopped = false;
  const look = async () => {
    if (!side) {
      const c = watcher();
      c.on('error', () => undefined);
      await c.connect();
      if (stopped) return void (await c.end());
      side = c;
    }
    const watching = side;
    await waiting.say(async () => say(await blockingSessions(watching, pid)));
  };
  const timer = setInterval(() => void look().catch(() => undefined), 1_000);
  try {
    await client.query(statement);
  } finally {
    stopped = true;
    clearInterval(timer);
    await side?.end().catch(() => undefined);
  }
}

/**
 * A session as a DBA would find it: its pid, application, since when its transaction is open, its
 * state and its statement's first word. Never the statement's text, which may hold the application's
 * literals (a token, a customer's data) and goes to the application's log.
 */
const SESSION_COLUMNS = `a.pid, a.application_name AS app, a.xact_start AS since, a.state, upper((regexp_match(a.query, '^\\s*([A-Za-z]+)'))[1]) AS command`;
interface SessionRow {
  pid: number;
  app: string;
  since: Date | null;
  state: string | null;
  command: string | null;
}
function describeSession(r: SessionRow): string {
  return `pid ${r.pid} (${r.app || 'no application_name'}, in a transaction since ${r.since?.toISOString() ?? '?'}, ${r.state ?? 'state unknown'}, last statement ${r.command ?? '?'})`;
}

/** The sessions `pid` waits for, oldest transaction first. */
async function blockingSessions(client: pg.Client, pid: number): Promise<string> {
  const { rows } = await client.query<SessionRow>(
    `SELECT ${SESSION_COLUMNS}
       FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids($1::int))
      ORDER BY since NULLS LAST LIMIT 3`,
    [pid],
  );
  if (rows.length === 0) return 'waiting for no session (building)';
  return `waiting for ${rows.map(describeSession).join(', ')} to end`;
}

/** Who holds the migration lock, as pg_stat_activity knows them. */
async function lockHolder(client: pg.Client): Promise<string> {
  const { rows } = await client.query<{ pid: number; app: string; since: Date | null }>(
    `SELECT a.pid, a.application_name AS app, a.backend_start AS since FROM pg_locks l JOIN pg_stat_activity a USING (pid)
      WHERE l.locktype = 'advisory' AND l.granted AND (l.classid::bigint << 32 | l.objid::bigint) = $1::bigint LIMIT 1`,
    [MIGRATION_LOCK],
  );
  const holder = rows[0];
  return holder ? `pid ${holder.pid}, ${holder.app || 'no application_name'}, connected since ${holder.since?.toISOString() ?? '?'}` : 'it has just let go';
}

/** The sessions holding locks on the schema's tables, oldest transaction first (what a DBA would end). */
async function tableLockHolders(client: pg.Client, schemaName: string): Promise<string> {
  const { rows } = await client.query<SessionRow>(
    `SELECT DISTINCT ${SESSION_COLUMNS}
       FROM pg_locks l JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_stat_activity a ON a.pid = l.pid
      WHERE l.granted AND n.nspname = $1::text AND a.pid <> pg_backend_pid()
      ORDER BY since NULLS LAST LIMIT 3`,
    [schemaName],
  );
  if (rows.length === 0) return 'held by sessions that have just let go';
  return `held by ${rows.map(describeSession).join(', ')}`;
}

/** The migrations of `folder` (this version's: MIGRATIONS_DIR), in order. */
async function migrationFiles(folder: string): Promise<string[]> {
  return (await readdir(folder)).filter((f) => /^\d+_.+\.sql$/.test(f)).sort();
}

/**
 * This version's migrations not yet applied to the schema `opts.schema` (default `billing_outbox`):
 * every one of them when it was never migrated. A worker that does not migrate checks it at start:
 * its statements name the columns of every migration it ships with.
 */
export async function pendingMigrations(db: Queryable, opts: { schema?: string } = {}): Promise<string[]> {
  const schema = schemaFor(opts.schema);
  const files = await migrationFiles(MIGRATIONS_DIR);
  const { rows } = await db.query<{ exists: boolean }>('SELECT to_regclass($1::text) IS NOT NULL AS exists', [schema.schemaMigrations]);
  if (!rows[0]!.exists) return files;
  const applied = new Set((await db.query<{ name: string }>(`SELECT name FROM ${schema.schemaMigrations}`)).rows.map((r) => r.name));
  return files.filter((f) => !applied.has(f));
}

/** The statements of a NO_TRANSACTION migration: split at each `;` that ends a line, comments dropped. */
function splitStatements(sql: string): string[] {
  return sql
    .split(/;[ \t]*$/m)
    .map((s) => s.replace(/^[ \t]*--.*$/gm, '').trim())
    .filter((s) => s !== '');
}

/**
 * SQLSTATEs that say "not now" rather than "never": the same statement can succeed later.
 * - 08 (connection exception), 57P (operator intervention: a shutdown, a restart);
 * - 53 (insufficient resources: too many connections 53300, out of memory, disk full);
 * - 40001 serialization failure, 40P01 deadlock (one side is chosen to fail, the retry succeeds);
 * - 57014 query cancelled (statement_timeout under load), 55P03 lock not available (lock_timeout);
 * - 25006 read-only transaction: a standby reached during a failover, or a managed server that
 *   turned itself read-only (its disk nearly full) until someone makes room.
 */
const TRANSIENT_SQLSTATE = /^(08|57P|53)|^(40001|40P01|57014|55P03|25006)$/;

/**
 * Whether `err` says the database is away or overloaded rather than the statement wrong: the
 * connection lost (connectionLost), no connection free in time (createPool's waitMs), a pool
 * already ended, and the SQLSTATEs above. A delivery that meets one waits and
 * tries again without spending one of its attempts (twenty minutes of overload must not dead-letter
 * every event in flight); the API answers 503.
 */
export function isDatabaseUnavailable(err: unknown): boolean {
  const e = err as { code?: unknown; message?: unknown } | null;
  return (
    connectionLost(err) ||
    e?.message === NO_CONNECTION_IN_TIME ||
    e?.message === POOL_ENDED ||
    (typeof e?.code === 'string' && TRANSIENT_SQLSTATE.test(e.code))
  );
}

/** What pg-pool says when a caller had no connection within the pool's `connectionTimeoutMillis` (createPool's waitMs). */
const NO_CONNECTION_IN_TIME = 'timeout exceeded when trying to connect';
/**
 * What pg-pool says to a caller after the pool was ended: an application stopping that ends its
 * pool before the worker, while deliveries are under way. Not the event's fault: no attempt spent.
 */
const POOL_ENDED = 'Cannot use a pool after calling end on the pool';

/** What pg says when a statement given a `query_timeout` got no answer within it. */
const UNANSWERED = 'Query read timeout';
/** What pg says when opening a connection took longer than its `connectionTimeoutMillis`. */
const NOT_OPENED = 'timeout expired';

/**
 * Whether `err` says the connection itself is gone, not a statement's error: Node socket errors,
 * node-postgres's own connection errors, a connection not opened within its time (CONNECT_WAIT_MS)
 * and a statement unanswered past its timeout (a silent connection, answeredWithin). Such a
 * connection is dropped, not rolled back and lent out again.
 */
export function connectionLost(err: unknown): boolean {
  const e = err as { code?: unknown; message?: unknown } | null;
  if (typeof e?.code === 'string') return ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENOTFOUND', 'EPIPE'].includes(e.code);
  return typeof e?.message === 'string' && (/Connection terminated|connection timeout|Client has encountered a connection error|not queryable/i.test(e.message) || e.message === UNANSWERED || e.message === NOT_OPENED);
}

/**
 * `db` (a pool or a client), with every statement failing (`Query read timeout`, which
 * isDatabaseUnavailable counts as PostgreSQL away) when it is not answered within `ms`. For
 * statements that each take milliseconds: a connection gone silent (the server failed over, the
 * network path dropped) is found in `ms` instead of by TCP minutes later. A pool then drops that
 * connection itself; a client's holder must release it with the error (`releaseAfter`). A statement
 * that was only slow may still commit after its timeout: only for statements whose caller can take
 * "unknown" and try again.
 */
export function answeredWithin(db: Queryable, ms: number): Queryable {
  type Query = (first: unknown, ...rest: unknown[]) => unknown;
  const query = db.query.bind(db) as Query;
  return {
    query: ((first: unknown, ...rest: unknown[]) => {
      if (typeof first === 'string') return query({ text: first, query_timeout: ms }, ...rest);
      return query({ ...(first as object), query_timeout: ms }, ...rest);
    }) as Queryable['query'],
  };
}

/** How long a connection being ended waits for the server's goodbye before its socket is destroyed. */
export const CLOSE_WAIT_MS = 2_000;

/**
 * Makes sure `client`'s socket is gone `ms` after its end was asked for. pg ends an idle
 * connection by telling the server and waiting for it to close the socket: a connection gone
 * silent (the server failed over) never does, and its half-closed socket would stay open for good,
 * keeping a stopped worker's process from exiting.
 */
export function closeWithin(client: pg.ClientBase, ms: number): void {
  const socket = (client as unknown as { connection?: { stream?: Socket } }).connection?.stream;
  if (!socket || socket.destroyed) return;
  const timer = setTimeout(() => socket.destroy(), ms).unref();
  socket.once('close', () => clearTimeout(timer));
}

/**
 * How long opening a connection (TCP, TLS, start-up, authentication) may take before it fails as
 * PostgreSQL away (`connectionLost`). Without it a connection opened just as the server failed over
 * waits for an answer that never comes: its statement never starts, so no statement's answer time
 * applies, and the pool's slot and the caller (a delivery, a claim) wait for good.
 */
export const CONNECT_WAIT_MS = 10_000;

/** `settings` with CONNECT_WAIT_MS as its connect timeout, unless it names its own. */
export function connectingWithin<T extends pg.ClientConfig>(settings: T): T {
  return { ...settings, connectionTimeoutMillis: settings.connectionTimeoutMillis || CONNECT_WAIT_MS };
}

/**
 * Whether an application's pool (given to the worker library or the Fastify plugin) opens its
 * connections without a time limit, and what to tell its owner. Its clients are the application's:
 * CONNECT_WAIT_MS cannot be given to them from here.
 */
export function opensWithoutLimit(pool: pg.Pool): boolean {
  const options = pool.options as pg.PoolConfig;
  return !options.connectionTimeoutMillis && options.Client !== ClosingClient;
}
export const OPENS_WITHOUT_LIMIT =
  "the application's pool has no connectionTimeoutMillis: a connection opened just as PostgreSQL fails over waits for good, and so does what waits on it (a request, a delivery); give the pool one (billing-outbox's own pools take 10 s)";

/**
 * Whether nobody listens to an application's pool's 'error' events. An idle connection PostgreSQL
 * ends (a restart, a failover, an idle timeout on a proxy) errors, the pool re-emits it, and an
 * event emitter's 'error' with no listener ends the process: the worker or the route would not
 * ride the outage out, the application would exit. Its listener is the application's to add.
 */
export function hearsNoErrors(pool: pg.Pool): boolean {
  return pool.listenerCount('error') === 0;
}
export const HEARS_NO_ERRORS =
  "the application's pool has no 'error' listener: when PostgreSQL restarts or fails over, an idle connection's error is re-emitted by the pool with nobody listening, and Node ends the process; add one (pool.on('error', (err) => log it)) before passing the pool";

/**
 * The client of our pools: opening its connection takes at most CONNECT_WAIT_MS, and a connection
 * the pool lets go (idle too long, failed, or the pool ended) is ended politely, and destroyed if
 * the server has not closed it CLOSE_WAIT_MS later. (Given to the client, not the pool: the pool's
 * own `connectionTimeoutMillis` would also bound the wait for a free connection under load.)
 */
class ClosingClient extends pg.Client {
  constructor(config: pg.ClientConfig = {}) {
    super(connectingWithin(config));
  }

  override end(): Promise<void>;
  override end(callback: (err: Error) => void): void;
  override end(callback?: (err: Error) => void): Promise<void> | void {
    // A statement its caller gave up on (answeredWithin) goes on at the server, which notices the
    // closed socket only when it next writes to it. One waiting for a lock (behind a migration's
    // ALTER TABLE, say) would hold its connection slot until it gets the lock, then run and commit
    // after its caller took it as failed; every retry would leave another. Cancelled first.
    if ((this as unknown as { _activeQuery: unknown })._activeQuery) cancelStatement(this);
    closeWithin(this, CLOSE_WAIT_MS);
    return callback ? super.end(callback) : super.end();
  }
}

/** PostgreSQL's CancelRequest code (protocol: a 16-byte packet on a connection of its own). */
const CANCEL_REQUEST_CODE = 80_877_102;

/**
 * Asks the server to cancel the statement `client`'s session is running: fire and forget, given up
 * after CLOSE_WAIT_MS (a server gone silent takes no requests either).
 */
function cancelStatement(client: pg.Client): void {
  const { processID, secretKey, host, port } = client as unknown as { processID: number | null; secretKey: number | null; host: string; port: number };
  if (processID === null || secretKey === null) return;
  const packet = Buffer.alloc(16);
  packet.writeInt32BE(16, 0);
  packet.writeInt32BE(CANCEL_REQUEST_CODE, 4);
  packet.writeInt32BE(processID, 8);
  packet.writeInt32BE(secretKey, 12);
  const socket = host.startsWith('/') ? net.connect(path.join(host, `.s.PGSQL.${port}`)) : net.connect(port, host);
  socket.setTimeout(CLOSE_WAIT_MS, () => socket.destroy());
  socket.on('error', () => socket.destroy());
  socket.on('connect', () => socket.end(packet));
}

/**
 * Gives a pooled client back after `err` (undefined: none): one whose connection failed or went
 * silent is dropped, not lent out again (a silent one would hold its next borrower's statements).
 */
export function releaseAfter(client: pg.PoolClient, err: unknown): void {
  client.release(connectionLost(err) ? (err as Error) : undefined);
}

/**
 * How long PostgreSQL lets one of our short transactions (a claim, a usage recorded by the API)
 * wait for its client's next statement before it ends the session. A connection gone silent in the
 * middle of one (a dropped network path; a failover's old server, if it lives on) would otherwise
 * keep its locks until the server's TCP keepalive noticed, two hours by default: the claim lock
 * stopping every relay of the schema, a usage's idempotency key blocking the client's retry.
 */
export const IDLE_IN_TRANSACTION_MS = 10_000;

/**
 * The statement that begins such a transaction, in one round trip. READ COMMITTED whatever the
 * database's default: the claim's lock wait and its SKIP LOCKED, and a usage meeting its duplicate,
 * are written for it; under REPEATABLE READ or SERIALIZABLE they fail with 40001 when they meet a
 * row another transaction committed meanwhile.
 */
export const BEGIN_SHORT = `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout = ${IDLE_IN_TRANSACTION_MS}`;

/** No connection of the pool came free by the caller's deadline (`withTransaction`'s `connectBy`). */
export class ConnectWaitError extends Error {
  override readonly name = 'ConnectWaitError';
  readonly waitedMs: number;
  constructor(waitedMs: number) {
    super(`no free database connection within ${waitedMs} ms`);
    this.waitedMs = waitedMs;
  }
}

/**
 * A client of `pool` by `deadline` (`performance.now()` ms), or ConnectWaitError. One that comes free later goes
 * straight back to the pool: the caller has moved on.
 */
export async function connectBy(pool: pg.Pool, deadline: number): Promise<pg.PoolClient> {
  const waitMs = Math.max(0, deadline - performance.now());
  const pending = pool.connect();
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new ConnectWaitError(waitMs)), waitMs)));
  try {
    return await Promise.race([pending, late]);
  } catch (err) {
    if (err instanceof ConnectWaitError) pending.then((client) => client.release(), () => undefined);
    throw err;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * A transaction that ended in ROLLBACK at its COMMIT: a statement in it failed, and the error was
 * caught and not thrown again, so PostgreSQL had aborted the transaction. Nothing in it was kept,
 * a usage recorded in it included.
 */
export class RolledBackError extends Error {
  constructor() {
    super('the transaction was rolled back, not committed: a statement in it failed (its error was caught and not thrown again), so nothing in it was kept');
    this.name = 'RolledBackError';
  }
}

/**
 * Runs `fn` inside BEGIN/COMMIT on a pooled client, rolling back if it throws. A COMMIT that
 * PostgreSQL answers with ROLLBACK (the transaction was aborted) throws RolledBackError. `short`: a
 * transaction of a few quick statements, ended by PostgreSQL if its client goes silent in the
 * middle of it (IDLE_IN_TRANSACTION_MS). `connectBy`: the client must be had by then (`performance.now()` ms).
 */
export async function withTransaction<T>(pool: pg.Pool, fn: (client: pg.PoolClient) => Promise<T>, opts: { short?: boolean; connectBy?: number } = {}): Promise<T> {
  const client = opts.connectBy === undefined ? await pool.connect() : await connectBy(pool, opts.connectBy);
  let failed: unknown;
  try {
    await client.query(opts.short ? BEGIN_SHORT : 'BEGIN');
    const result = await fn(client);
    const ended = await client.query('COMMIT');
    if (ended.command !== 'COMMIT') throw new RolledBackError();
    return result;
  } catch (err) {
    failed = err;
    if (!connectionLost(err) && !(err instanceof RolledBackError)) await client.query('ROLLBACK').catch(() => undefined);
    throw err;
  } finally {
    releaseAfter(client, failed);
  }
}

/** Query parameters of a PostgreSQL URL that carry a secret (node-postgres reads them as settings). */
const SECRET_PARAMS = ['password', 'sslpassword'];

/** The database URL with its password replaced (in its user part or its query), for messages and logs. */
export function redactUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    for (const name of SECRET_PARAMS) if (u.searchParams.has(name)) u.searchParams.set(name, '***');
    return u.toString().replaceAll('%2A%2A%2A', '***');
  } catch {
    return '(unparseable URL)';
  }
}
