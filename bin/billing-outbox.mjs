#!/usr/bin/env node
// The `billing-outbox` command (migrate, worker, api, the operator commands: src/bin/cli.ts).
//
// Installed from npm, the package has no src/: the build (dist/src/bin/cli.js) runs in this very
// process on plain Node, so a SIGTERM reaches the process that drains the worker. In a checkout,
// src/bin/cli.ts runs under tsx (a development dependency) in a child Node process, with tsx
// resolved from this package rather than from the caller's working directory; argv, stdio, signals
// and the exit status pass through. The sources win over a dist/ left by an earlier build, which
// may be stale.
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import path from 'node:path';
import process from 'node:process';
import { fileURLToPath, pathToFileURL } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const source = path.join(root, 'src', 'bin', 'cli.ts');

if (existsSync(source)) {
  runSource(source);
} else {
  const dist = path.join(root, 'dist', 'src');
  const { loadPart, MissingPeerError } = await import(pathToFileURL(path.join(dist, 'optional-peers.js')).href);
  try {
    await loadPart('this command', () => import(pathToFileURL(path.join(dist, 'bin', 'cli.js')).href));
  } catch (err) {
    if (!(err instanceof MissingPeerError)) throw err;
    process.stderr.write(`billing-outbox: ${err.message}\n`);
    process.exit(1);
  }
}

function runSource(entry) {
  const tsx = import.meta.resolve('tsx');
  const child = spawn(process.execPath, ['--import', tsx, entry, ...process.argv.slice(2)], { stdio: 'inherit' });

  // A terminal's Ctrl-C reaches the whole process group already; `kill <pid>` reaches only us.
  for (const signal of /** @type {const} */ (['SIGTERM', 'SIGHUP'])) {
    process.on(signal, () => child.kill(signal));
  }
  process.on('SIGINT', () => undefined);

  child.on('error', (err) => {
    process.stderr.write(`billing-outbox: could not start ${entry}: ${err.message}\n`);
    process.exit(1);
  });
  child.on('exit', (code, signal) => {
    if (signal) {
      // Die of the same signal, so the caller sees what happened to the command.
      process.removeAllListeners(signal);
      process.kill(process.pid, signal);
    } else {
      process.exit(code ?? 1);
    }
  });
}
