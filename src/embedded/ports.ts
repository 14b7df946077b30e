/**
 * Local ports: where a client on this machine reaches a server (`localUrl`), and which process
 * listens on a port (Linux: /proc/net/tcp, then each process's open sockets), so that a taken port
 * can be said with what holds it. Undefined when it cannot be told (another OS, a process of
 * another user).
 */
import { readdir, readFile, readlink } from 'node:fs/promises';

/** Where clients on this machine reach a server bound to `host`:`port` (a wildcard bind, `0.0.0.0` or `::`, by loopback). */
export function localUrl(host: string, port: number): string {
  const bound = host === '0.0.0.0' ? '127.0.0.1' : host === '::' ? '::1' : host;
  return `http://${bound.includes(':') ? `[${bound}]` : bound}:${port}`;
}

export interface PortHolder {
  pid: number;
  command: string;
}

const LISTEN = '0A';

export async function portHolder(port: number): Promise<PortHolder | undefined> {
  const inodes = new Set<string>();
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    const text = await readFile(table, 'utf8').catch(() => '');
    for (const line of text.split('\n').slice(1)) {
      const cols = line.trim().split(/\s+/);
      const local = cols[1];
      if (!local || cols[3] !== LISTEN) continue;
      if (parseInt(local.split(':').at(-1)!, 16) === port) inodes.add(cols[9]!);
    }
  }
  if (inodes.size === 0) return undefined;
  for (const entry of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(entry)) continue;
    const fds = await readdir(`/proc/${entry}/fd`).catch(() => [] as string[]);
    for (const fd of fds) {
      const target = await readlink(`/proc/${entry}/fd/${fd}`).catch(() => '');
      const inode = /^socket:\[(\d+)\]$/.exec(target)?.[1];
      if (inode && inodes.has(inode)) {
        const cmdline = await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '');
        return { pid: Number(entry), command: cmdline.split('\0').filter(Boolean).join(' ') };
      }
    }
  }
  return undefined;
}

/** "pid 1234 (temporal server start-dev …)", or "another process" when it cannot be told. */
export async function describePortHolder(port: number): Promise<string> {
  const holder = await portHolder(port);
  if (!holder) return 'another process';
  const command = holder.command.length > 160 ? `${holder.command.slice(0, 157)}…` : holder.command;
  return `pid ${holder.pid} (${command})`;
}
