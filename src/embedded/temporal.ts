/**
 * A real Temporal server: the `temporal server start-dev` CLI (installed by scripts/tools.sh),
 * with the search attributes billing-outbox needs registered at start.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { accessSync, constants, existsSync, readFileSync, statSync } from 'node:fs';
import { chmod } from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { freePort } from './postgres.js';

export const PROJECT_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');

/** The temporal CLI: TEMPORAL_CLI_PATH, what scripts/tools.sh recorded in .tools/, or a `temporal` on PATH. */
export function findTemporalCli(configured?: string): string | undefined {
  if (configured) return configured;
  const recorded = path.join(PROJECT_ROOT, '.tools', 'temporal-path');
  if (existsSync(recorded)) {
    const p = readFileSync(recorded, 'utf8').trim();
    if (p && existsSync(p)) return p;
  }
  return onPath('temporal', process.env.PATH);
}

/** The first executable file `name` in the folders of `pathList` (PATH's form), or undefined. */
export function onPath(name: string, pathList: string | undefined): string | undefined {
  for (const dir of (pathList ?? '').split(path.delimiter)) {
    if (!dir) continue;
    const file = path.join(dir, name);
    try {
      accessSync(file, constants.X_OK);
      if (statSync(file).isFile()) return file;
    } catch {
      // Not there, or not ours to run.
    }
  }
  return undefined;
}

/** No temporal CLI here, nor the SDK's package that downloads one: what to do instead. */
export class NoTemporalCliError extends Error {
  constructor(cause: unknown) {
    super(
      'the embedded Temporal dev server needs the temporal CLI, and none was found: set TEMPORAL_ADDRESS to a Temporal server of yours, ' +
        'or install the CLI (https://docs.temporal.io/cli) on PATH or at TEMPORAL_CLI_PATH',
      { cause },
    );
    this.name = 'NoTemporalCliError';
  }
}

/**
 * Task queue fairness (GA with server 1.31), on in every dev server we start unless asked: matching
 * dispatches each fairness key's backlog in turn (a usage run's key is its tenant, see
 * src/temporal/start-usage.ts), so one tenant's flood of workflow and activity tasks does not
 * queue every other tenant's behind it. Off, the keys are carried and ignored: one FIFO.
 */
const fairnessConfig = (on = true) => [`matching.enableFairness=${on}`];

export interface DevServer {
  address: string;
  uiUrl: string | undefined;
  /** False once the server process has exited. */
  alive(): boolean;
  stop(): Promise<void>;
}

export interface DevServerOptions {
  dbFile?: string;
  port?: number;
  uiPort?: number;
  headless?: boolean;
  namespace?: string;
  logFile?: (line: string) => void;
  /** TEMPORAL_CLI_PATH; otherwise what scripts/tools.sh found. */
  cliPath?: string | undefined;
  /**
   * More dynamic config, as `key=value` (each one a `--dynamic-config-value`): a test provokes a
   * server-side refusal with a limit, e.g. `limit.maxIDLength=60`.
   */
  dynamicConfig?: string[];
  /** Task queue fairness (default on); off only to measure what it does (`npm run bench -- fairness`). */
  taskQueueFairness?: boolean;
}

export async function startTemporalDevServer(opts: DevServerOptions = {}): Promise<DevServer> {
  if (opts.dbFile) await keepPrivate(opts.dbFile);
  const cli = findTemporalCli(opts.cliPath);
  if (!cli) return startDownloadedDevServer({ ...opts, port: opts.port ?? (await freePort()) });
  // The ports are free when chosen, not when the server binds them (the CLI picks its HTTP API port
  // itself, in the range the kernel also hands out to outgoing connections): a server that lost a
  // port to another process in between is started again on new ones.
  for (let attempt = 1; ; attempt++) {
    try {
      return await launchDevServer(cli, opts);
    } catch (err) {
      if (attempt === 3 || !(err instanceof Error) || !err.message.includes('address already in use')) throw err;
    }
  }
}

async function launchDevServer(cli: string, opts: DevServerOptions): Promise<DevServer> {
  const port = opts.port ?? (await freePort());
  const args = [
    'server', 'start-dev',
    '--ip', '127.0.0.1',
    '--port', String(port),
    '--namespace', opts.namespace ?? 'default',
    '--search-attribute', 'OutboxStatus=Keyword',
    '--search-attribute', 'TenantId=Keyword',
    '--search-attribute', 'OutboxError=Keyword',
    '--log-level', 'error',
    '--sqlite-pragma', 'journal_mode=WAL',
    '--sqlite-pragma', 'synchronous=OFF',
    // One node gains nothing from task-queue partitions; with one, a poller finds every task at
    // once (measured here: p99 start-to-result 5.8 s → 1.9 s).
    '--dynamic-config-value', 'matching.numTaskqueueReadPartitions=1',
    '--dynamic-config-value', 'matching.numTaskqueueWritePartitions=1',
  ];
  for (const value of [...fairnessConfig(opts.taskQueueFairness), ...(opts.dynamicConfig ?? [])]) args.push('--dynamic-config-value', value);
  if (opts.dbFile) args.push('--db-filename', opts.dbFile);
  let uiUrl: string | undefined;
  if (opts.headless ?? true) {
    args.push('--headless');
  } else {
    const uiPort = opts.uiPort ?? (await freePort());
    args.push('--ui-port', String(uiPort), '--ui-ip', '127.0.0.1');
    uiUrl = `http://127.0.0.1:${uiPort}`;
  }
  // Its own process group: a Ctrl-C in the terminal reaches us, and we stop the server after the
  // worker has drained, instead of the server vanishing under in-flight workflows. Under a guard
  // that stops it when this process is gone, however it went (even SIGKILL, which runs no hook).
  const child = spawn('sh', ['-c', `umask 077\n${GUARD}`, 'temporal-guard', String(process.pid), cli, ...args], { stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  const killOnExit = () => killGroup(child, 'SIGKILL');
  process.once('exit', killOnExit);
  child.once('exit', () => process.off('exit', killOnExit));
  const output: string[] = [];
  const collect = (b: Buffer) => {
    const s = b.toString();
    output.push(s);
    if (output.length > 50) output.shift();
    opts.logFile?.(s);
  };
  child.stdout.on('data', collect);
  child.stderr.on('data', collect);
  const address = `127.0.0.1:${port}`;
  await waitForPort(port, 60_000, child).catch((err: Error) => {
    killGroup(child, 'SIGKILL');
    throw new Error(`temporal dev server did not start: ${err.message}\n${output.join('')}`);
  });
  return {
    address,
    uiUrl,
    alive: () => child.exitCode === null && child.signalCode === null,
    stop: () => stopChild(child),
  };
}

/**
 * The dev server's SQLite file holds every workflow history: tenants, quantities, Stripe's answers.
 * SQLite creates it with the process's umask (0644 here) and gives its -wal and -shm files the main
 * file's mode: the server runs under umask 077 (below), and a file left by an earlier version is
 * narrowed to its owner. (An empty file made in advance is not an option: the CLI takes any existing
 * file for a database whose schema is already set up.)
 */
async function keepPrivate(dbFile: string): Promise<void> {
  if (existsSync(dbFile)) await chmod(dbFile, 0o600);
}

/**
 * Without a local CLI (no Python to install the PyPI wheel, nothing on PATH), the Temporal SDK
 * downloads the same CLI itself: this works on a machine with internet access only.
 */
// @temporalio/testing is a runtime dependency for this path (the Docker image installs without dev dependencies).
async function startDownloadedDevServer(opts: {
  dbFile?: string;
  port: number;
  uiPort?: number;
  headless?: boolean;
  namespace?: string;
  dynamicConfig?: string[];
  taskQueueFairness?: boolean;
}): Promise<DevServer> {
  const { TestWorkflowEnvironment } = await import('@temporalio/testing').catch((err: unknown) => {
    throw new NoTemporalCliError(err);
  });
  const { SEARCH_ATTRIBUTES } = await import('../../workflows/shared.js');
  const ui = !(opts.headless ?? true);
  const uiPort = ui ? (opts.uiPort ?? (await freePort())) : undefined;
  const env = await TestWorkflowEnvironment.createLocal({
    server: {
      ip: '127.0.0.1',
      port: opts.port,
      namespace: opts.namespace ?? 'default',
      searchAttributes: SEARCH_ATTRIBUTES,
      ...(opts.dbFile ? { dbFilename: opts.dbFile } : {}),
      ...(ui ? { ui: true, uiPort } : {}),
      extraArgs: [...fairnessConfig(opts.taskQueueFairness), ...(opts.dynamicConfig ?? [])].flatMap((value) => ['--dynamic-config-value', value]),
    },
  });
  let stopped = false;
  return {
    address: `127.0.0.1:${opts.port}`,
    uiUrl: ui ? `http://127.0.0.1:${uiPort}` : undefined,
    alive: () => !stopped,
    stop: async () => {
      stopped = true;
      await env.teardown();
    },
  };
}

/**
 * Runs the server (`$2…`) and stops it when the process `$1` is gone, or when the guard is told to
 * stop (TERM/INT), then waits for it and exits with its status. Polls once a second.
 */
const GUARD = [
  'parent=$1; shift',
  '"$@" &',
  'server=$!',
  "trap 'kill -TERM $server 2>/dev/null' TERM INT",
  'while kill -0 "$parent" 2>/dev/null && kill -0 "$server" 2>/dev/null; do sleep 1 & wait $!; done',
  'kill -TERM "$server" 2>/dev/null',
  'wait "$server"',
].join('\n');

/** Signals a detached child's whole process group (the guard and the server under it). */
function killGroup(child: ChildProcess, signal: NodeJS.Signals): void {
  try {
    if (child.pid) process.kill(-child.pid, signal);
  } catch {
    child.kill(signal);
  }
}

export function stopChild(child: ChildProcess, graceMs = 10_000): Promise<void> {
  return new Promise((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) return resolve();
    const timer = setTimeout(() => killGroup(child, 'SIGKILL'), graceMs);
    child.once('exit', () => {
      clearTimeout(timer);
      resolve();
    });
    child.kill('SIGTERM');
  });
}

async function waitForPort(port: number, timeoutMs: number, child: ChildProcess): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    if (child.exitCode !== null) throw new Error(`exited with code ${child.exitCode}`);
    const ok = await new Promise<boolean>((resolve) => {
      const s = net.connect(port, '127.0.0.1');
      s.once('connect', () => {
        s.destroy();
        resolve(true);
      });
      s.once('error', () => resolve(false));
    });
    if (ok) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`port ${port} not open after ${timeoutMs} ms`);
}
