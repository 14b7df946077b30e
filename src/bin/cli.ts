/**
 * `billing-outbox <command>` (bin/billing-outbox.mjs, or `npm run cli -- <command>`): builds the
 * real database pool and Temporal client from the environment, lazily (so `--help` and usage
 * errors need neither), runs the command, closes them, and sets the exit code. `worker`, `api`
 * and `start` run as this process (see `serve`).
 */
import { Client, type Connection } from '@temporalio/client';
import { connectClient } from '../temporal/connection.js';
import { userInfo } from 'node:os';
import { createInterface } from 'node:readline/promises';
import type pg from 'pg';
import { ConfigError, loadConfig, type Config } from '../config.js';
import { operatorPool } from '../cli/context.js';
import { runCli } from '../cli/run.js';
import { defaultDataDir, halfSetBesideStack, loadDotEnv, readRunningStack } from '../embedded/local-files.js';
import { exitCodeOf } from './run-main.js';


function osUser(): string {
  try {
    return userInfo().username;
  } catch {
    // No passwd entry for this uid (common in containers).
    return `uid:${process.getuid?.() ?? 'unknown'}`;
  }
}

/**
 * Asks on the terminal; Ctrl-C or Ctrl-D is a no. (readline's question is never answered once
 * its interface closes: without the abort, the command would hang until the pool let go.)
 */
async function confirm(question: string): Promise<boolean> {
  const rl = createInterface({ input: process.stdin, output: process.stderr });
  const unanswered = new AbortController();
  rl.once('SIGINT', () => unanswered.abort());
  rl.once('close', () => unanswered.abort());
  try {
    return /^y(es)?$/i.test((await rl.question(question, { signal: unanswered.signal })).trim());
  } catch (err) {
    if (unanswered.signal.aborted) {
      process.stderr.write('\n');
      return false;
    }
    throw err;
  } finally {
    rl.close();
  }
}

/**
 * With DATABASE_URL and TEMPORAL_ADDRESS both unset, the stack `npm start` is running on this
 * machine (its .data/endpoints.json, while its process lives) fills them in, its Web UI's address,
 * and its local Stripe when it runs one and no Stripe is set here (neither STRIPE_API_KEY nor
 * STRIPE_API_BASE): `customers set` and `reconcile` then ask the Stripe the stack bills.
 *
 * Never one of them: with only one set while that stack runs, nothing is guessed (a production
 * DATABASE_URL beside the local Temporal, the stack's or localhost:7233 where the stack listens,
 * made `retry` start production's dead letters as runs no worker of theirs sees). The other is then
 * `unset`: refused when a command asks for it, so that a command needing only the one set
 * (`migrate`, `dead`, `import`) runs.
 */
function withRunningStack(config: Config): { config: Config; unset?: ConfigError } {
  const unset = halfSetBesideStack(config);
  if (unset) return { config, unset };
  if (config.databaseUrl || config.temporal.address) return { config };
  const running = readRunningStack(defaultDataDir(config.dataDir));
  if (!running) return { config };
  const stripe = running.localStripe && config.stripe.apiKey === undefined && config.stripe.isRealStripe ? { ...config.stripe, apiBase: running.localStripe, isRealStripe: false } : config.stripe;
  return {
    config: {
      ...config,
      databaseUrl: running.databaseUrl,
      temporal: { ...config.temporal, address: running.temporalAddress },
      temporalUiUrl: process.env.TEMPORAL_UI_URL || !running.temporalUi ? config.temporalUiUrl : running.temporalUi,
      stripe,
    },
  };
}

/**
 * `worker`, `api`, `start`: imported only now, so that neither `--help` nor the operator commands
 * need the Temporal SDK's worker or the embedded stack installed; a missing one is named.
 */
async function serve(name: 'worker' | 'api' | 'start'): Promise<number> {
  let run: () => Promise<void>;
  try {
    if (name === 'worker') run = (await import('../cli/commands/worker.js')).runWorker;
    else if (name === 'api') run = (await import('../cli/commands/api.js')).runApi;
    else run = (await import('../cli/commands/start.js')).runStart;
  } catch (err) {
    const missing = /Cannot find (?:package|module) '([^']+)'/.exec(String(err))?.[1];
    if (!missing) throw err;
    process.stderr.write(`billing-outbox ${name}: needs the package ${missing}, which is not installed here: npm install ${missing}\n`);
    return 1;
  }
  served = true;
  return exitCodeOf(run);
}

/**
 * Set once a process command has run: it ends with process.exit, as `npm run worker` always did,
 * since what it leaves behind (the Temporal SDK's runtime) would keep the process alive.
 */
let served = false;

async function main(): Promise<number> {
  let config: Config;
  let unset: ConfigError | undefined;
  try {
    loadDotEnv();
    ({ config, unset } = withRunningStack(loadConfig()));
  } catch (err) {
    if (!(err instanceof ConfigError)) throw err;
    process.stderr.write(`${err.message}\n`);
    return 2;
  }
  let pool: pg.Pool | undefined;
  let connecting: Promise<Connection> | undefined;
  try {
    return await runCli(process.argv.slice(2), {
      config,
      async db() {
        if (unset && !config.databaseUrl) throw unset;
        if (!config.databaseUrl) {
          throw new ConfigError([
            'DATABASE_URL: is not set, and no `npm start` is running here to take it from (.data/endpoints.json); it names the billing-outbox PostgreSQL database (postgres://user:password@host:5432/db)',
          ]);
        }
        pool ??= operatorPool(config.databaseUrl, config);
        return pool;
      },
      async temporal() {
        if (unset && !config.temporal.address) throw unset;
        connecting ??= connectClient(config.temporal);
        return new Client({ connection: await connecting, namespace: config.temporal.namespace });
      },
      serve,
      out: process.stdout,
      err: process.stderr,
      user: osUser(),
      ...(process.stdin.isTTY ? { confirm } : {}),
    });
  } finally {
    await pool?.end();
    await connecting?.then((c) => c.close()).catch(() => undefined);
  }
}

// process.exitCode rather than exit(): stdout is flushed before the process ends. A process
// command logs synchronously, so nothing is lost to its exit.
const code = await main();
if (served) process.exit(code);
process.exitCode = code;
