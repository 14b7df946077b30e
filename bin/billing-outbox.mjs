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
  const built = path.join(root, 'dist', 'src', 'bin', 'cli.js');
  try {
    await import(pathToFileURL(built).href);
  } catch (err) {
    const missing = missingPackage(err, built);
    if (!missing) throw err;
    process.stderr.write(
      `billing-outbox: this command needs the package ${missing}, which is not installed.\n` +
        '  The worker, the API and the operator commands come with billing-outbox-worker: npm install billing-outbox-worker\n',
    );
    process.exit(1);
  }
}

/**
 * The optional peer dependency whose absence made loading fail (Node's ERR_MODULE_NOT_FOUND for a
 * bare package name), or undefined for any other failure, a missing file of this package included.
 */
function missingPackage(err, built) {
  if (err?.code !== 'ERR_MODULE_NOT_FOUND') return undefined;
  const name = /Cannot find package '([^']+)'/.exec(String(err.message))?.[1];
  return name && !name.startsWith('/') && name !== built ? name : undefined;
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
