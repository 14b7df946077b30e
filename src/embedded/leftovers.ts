/**
 * Servers an earlier `npm start` left running on this data folder (its process was SIGKILLed, or
 * the machine's process manager lost it): a PostgreSQL still holding `<dataDir>/pg`, a Temporal
 * dev server still writing `<dataDir>/temporal.db`. They are stopped, loudly, before new ones start
 * on the same files; anything else on the machine is left alone.
 */
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';

export async function stopLeftovers(dataDir: string, say: (line: string) => void): Promise<void> {
  const pgPid = await leftoverPostgres(path.join(dataDir, 'pg'));
  const temporalPids = await processesWith(['start-dev', path.join(dataDir, 'temporal.db')]);
  // A server whose Node.js parent is alive belongs to a running `npm start`: never touch it.
  for (const pid of [pgPid, ...temporalPids].filter((p): p is number => p !== undefined)) {
    const owner = await nodeOwner(pid);
    if (owner) throw new Error(`another billing-outbox (pid ${owner}) is running on ${dataDir}: stop it, or give this one its own DATA_DIR`);
  }
  if (pgPid) {
    say(`billing-outbox: stopping a PostgreSQL left running on ${path.join(dataDir, 'pg')} by an earlier run (pid ${pgPid})`);
    // SIGINT: PostgreSQL's fast shutdown (ends sessions, checkpoints, exits).
    await stopPid(pgPid, 'SIGINT');
  }
  for (const pid of temporalPids) {
    say(`billing-outbox: stopping a Temporal dev server left running on ${path.join(dataDir, 'temporal.db')} by an earlier run (pid ${pid})`);
    await stopPid(pid, 'SIGTERM');
  }
}

async function leftoverPostgres(pgDir: string): Promise<number | undefined> {
  const lock = await readFile(path.join(pgDir, 'postmaster.pid'), 'utf8').catch(() => '');
  const pid = Number(lock.split('\n')[0]);
  if (!Number.isInteger(pid) || pid <= 0 || !alive(pid)) return undefined;
  const cmdline = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
  return cmdline.includes('postgres') && cmdline.includes(path.resolve(pgDir)) ? pid : undefined;
}

async function processesWith(parts: string[]): Promise<number[]> {
  const found: number[] = [];
  for (const entry of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    const args = (await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '')).split('\0');
    // The server itself, not a shell or guard that mentions it.
    if (!args[0]?.endsWith('temporal')) continue;
    if (parts.every((p) => args.includes(p))) found.push(Number(entry));
  }
  return found;
}

/** The live Node.js process that started `pid` (through shells and guards), if any. */
async function nodeOwner(pid: number): Promise<number | undefined> {
  for (let current = pid, depth = 0; depth < 5; depth++) {
    const status = await readFile(`/proc/${current}/status`, 'utf8').catch(() => '');
    const parent = Number(/^PPid:\s+(\d+)/m.exec(status)?.[1]);
    if (!parent || parent === 1) return undefined;
    const args = (await readFile(`/proc/${parent}/cmdline`, 'utf8').catch(() => '')).split('\0');
    if (/(^|\/)node$/.test(args[0] ?? '')) return parent;
    if (!/(^|\/)(sh|bash|dash)$/.test(args[0] ?? '')) return undefined;
    current = parent;
  }
  return undefined;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function stopPid(pid: number, signal: NodeJS.Signals, graceMs = 15_000): Promise<void> {
  try {
    process.kill(pid, signal);
  } catch {
    return;
  }
  const until = Date.now() + graceMs;
  while (alive(pid) && Date.now() < until) await new Promise((r) => setTimeout(r, 100));
  if (alive(pid)) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // gone meanwhile
    }
  }
}
