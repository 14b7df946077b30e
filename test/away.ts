/**
 * Worker and API processes as `npm run worker` / `npm run api` start them, and the services they
 * need going away under them: a port nobody listens on yet, or a plain TCP proxy to the suite's
 * real PostgreSQL or Temporal that cuts every connection and refuses new ones for a while. Used by
 * services-away.test.ts (starting) and running-outages.test.ts (running). A file that uses them
 * calls `afterAll(cleanUpAway)`.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import net from 'node:net';
import { freePort } from '../src/embedded/postgres.js';
import { waitFor } from './helpers.js';

const children: ChildProcess[] = [];
const proxies: net.Server[] = [];
/** Connections a failover left silent (closed at clean-up). */
const silencedSockets: net.Socket[] = [];

export interface ProductProcess {
  child: ChildProcess;
  output: () => string;
}

/** The worker (or, with its script, the API) with `env` on top of this process's, its output gathered. */
export function startProcess(env: Record<string, string>, script = 'src/bin/worker.ts'): ProductProcess {
  const child = spawn(process.execPath, ['--import', 'tsx', script], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  let out = '';
  child.stdout!.on('data', (b: Buffer) => (out += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (out += b.toString()));
  return { child, output: () => out };
}

/** Waits until the process has said `text`; fails with its output if it exits first. */
export function untilSaid(p: ProductProcess, text: string | RegExp, timeoutMs: number): Promise<true> {
  const said = () => (typeof text === 'string' ? p.output().includes(text) : text.test(p.output()));
  return waitFor(`the process to say ${String(text)}`, async () => said() || (p.child.exitCode !== null && Promise.reject(new Error(p.output()))), timeoutMs);
}

export async function cleanUpAway(): Promise<void> {
  for (const c of children.splice(0)) if (c.exitCode === null) c.kill('SIGKILL');
  for (const s of silencedSockets.splice(0)) s.destroy();
  await Promise.all(proxies.splice(0).map((p) => new Promise((r) => p.close(r))));
}

/** Opens `port` and forwards every connection to `target`, both ways (a proxy never told to go away). */
export async function proxy(port: number, target: { host: string; port: number }): Promise<void> {
  await goingAway(port, target, { awayMs: 0 });
}

export interface GoingAway {
  port: number;
  /** Cuts every connection now and refuses new ones for `awayMs` (once). */
  goAway: () => void;
  cutAt: () => number | undefined;
}

/**
 * A proxy on a free `port` to `target` that can go away once, for `awayMs`: when the test says
 * (`goAway`), or, in front of Temporal, at a step of a worker's start: `client`, as the server
 * first answers the worker's second connection (its client's, opened after the native one);
 * `worker`, as the native connection makes its next call after that (Worker.create asking about
 * the namespace), which is not let through.
 */
export async function goingAway(port: number, target: { host: string; port: number }, cut: { at?: 'client' | 'worker'; awayMs: number }): Promise<GoingAway> {
  const open = new Set<net.Socket>();
  let connections = 0;
  let cutAt: number | undefined;
  let server: net.Server;
  const goAway = () => {
    if (cutAt !== undefined) return;
    cutAt = Date.now();
    server.close();
    for (const s of open) s.destroy();
    setTimeout(() => void listen(), cut.awayMs);
  };
  const listen = async (): Promise<void> => {
    server = net.createServer((client) => {
      const nth = ++connections;
      const upstream = net.connect(target.port, target.host);
      open.add(client).add(upstream);
      const end = () => {
        client.destroy();
        upstream.destroy();
      };
      if (cut.at === 'client' && nth === 2) upstream.once('data', goAway);
      client.on('data', (bytes: Buffer) => {
        if (cut.at === 'worker' && nth === 1 && connections >= 2 && cutAt === undefined) goAway();
        else upstream.write(bytes);
      });
      client.on('error', end).on('end', end);
      upstream.on('error', end).pipe(client);
    });
    proxies.push(server);
    await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  };
  await listen();
  return { port, goAway, cutAt: () => cutAt };
}

export interface FailingOver {
  /** The database URL through the proxy. */
  url: string;
  /**
   * What a database failover (or a dropped network path) does to open connections: from now on
   * they carry nothing either way and are never closed, as if the old server's address went
   * silent; new connections go through (to the new server). `newSilentForMs`: the new server's
   * address takes that long to answer, and the connections opened meanwhile are left silent too
   * (opened just as the failover came: their start-up is never answered).
   */
  failOver: (opts?: { newSilentForMs?: number }) => void;
  /** Connections left silent so far. */
  silenced: () => number;
}

/** A proxy on a free port to the database of `databaseUrl` whose open connections can go silent at once (`failOver`). */
export async function failingOver(databaseUrl: string): Promise<FailingOver> {
  const target = new URL(databaseUrl);
  const url = new URL(databaseUrl);
  url.hostname = '127.0.0.1';
  url.port = String(await freePort());
  const open = new Set<{ client: net.Socket; upstream: net.Socket }>();
  let silenced = 0;
  let newSilentUntil = 0;
  const server = net.createServer((client) => {
    if (Date.now() < newSilentUntil) {
      silencedSockets.push(client);
      silenced++;
      return;
    }
    const upstream = net.connect(Number(target.port), target.hostname);
    const pair = { client, upstream };
    open.add(pair);
    const end = () => {
      open.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on('error', end).on('end', end);
    upstream.on('error', end).on('end', end);
    client.pipe(upstream);
    upstream.pipe(client);
  });
  proxies.push(server);
  await new Promise<void>((resolve) => server.listen(Number(url.port), '127.0.0.1', resolve));
  return {
    url: url.toString(),
    failOver: (opts = {}) => {
      newSilentUntil = Date.now() + (opts.newSilentForMs ?? 0);
      for (const { client, upstream } of open) {
        client.unpipe(upstream);
        upstream.unpipe(client);
        client.pause();
        upstream.pause();
        client.removeAllListeners('end');
        upstream.removeAllListeners('end');
        // Kept open, never answered, never ended: the silent side of a failover.
        silencedSockets.push(client, upstream);
        silenced++;
      }
      open.clear();
    },
    silenced: () => silenced,
  };
}

