#!/usr/bin/env node
// The `billing-outbox` operator CLI. Runs src/bin/cli.ts under tsx in a child Node process, with
// tsx resolved from this package (not from the caller's working directory), and passes argv, stdio,
// signals and the exit status through.
import { spawn } from 'node:child_process';
import path from 'node:path';
import process from 'node:process';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const entry = path.join(root, 'src', 'bin', 'cli.ts');
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
