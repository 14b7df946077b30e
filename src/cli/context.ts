/**
 * What a CLI command gets to work with. The entry point (main.ts) builds it from the environment;
 * tests build it from their own database pool, Temporal client and string buffers, and call
 * `runCli` in-process.
 */
import { webUiLinks } from '../temporal/web-ui.js';
import type { Client } from '@temporalio/client';
import type { Config } from '../config.js';
import { createPool } from '../db.js';
import type pg from 'pg';

/**
 * The operator commands' database pool. Each statement is answered within `maintenanceAnswerMs`
 * (2 minutes; the worker's maintenance has the same) or fails as PostgreSQL away: on a connection a
 * failover left silent, a command (a script's `status --json`, a `retry --all-dead --yes`) would
 * otherwise wait for TCP to give up, two hours by default. Opening a connection takes at most
 * CONNECT_WAIT_MS (10 s), as on every pool createPool makes.
 */
export function operatorPool(databaseUrl: string, config: Pick<Config, 'timings'>): pg.Pool {
  return createPool(databaseUrl, 4, { answerMs: config.timings.maintenanceAnswerMs });
}

export interface Output {
  write(chunk: string): unknown;
  isTTY?: boolean;
}

export interface CliContext {
  config: Config;
  /** The database; only called by commands that need it (so `--help` works without one). */
  db(): Promise<pg.Pool>;
  /** A Temporal client on the configured namespace; only called by commands that need it. */
  temporal(): Promise<Client>;
  out: Output;
  err: Output;
  /** Milliseconds since the epoch; ages and the resend-window check are measured from it. */
  now?: () => number;
  /** Who is acting, for the audit log, unless `--by` says otherwise (default: the OS user). */
  user?: string;
  /** Asks a yes/no question on a terminal; absent when there is no one to ask (stdin not a TTY). */
  confirm?: (question: string) => Promise<boolean>;
  /**
   * Runs `worker`, `api` or `start` as this process until it is stopped, and returns its exit code
   * (the entry point provides it; in-process callers, tests, have none).
   */
  serve?: (name: 'worker' | 'api' | 'start') => Promise<number>;
  /** Rows per page in bulk operations (tests make it small to cover paging). */
  pageSize?: number;
}

/** Exit codes: 0 success, 1 an operation failed or was refused, 2 the command line was wrong. */
export const EXIT_OK = 0;
export const EXIT_FAILED = 1;
export const EXIT_USAGE = 2;

/** A mistake on the command line: printed with the command's usage, exit code 2. */
export class CommandLineError extends Error {
  readonly help?: string;
  constructor(
    message: string,
    help?: string,
  ) {
    super(message);
    this.help = help;
    this.name = 'CommandLineError';
  }
}

/** Who is acting, for operator_actions: --by NAME, else the OS user (1 to 200 characters). */
export function actorOf(by: string | undefined, ctx: Pick<CliContext, 'user'>, help: string): string {
  const actor = by ?? ctx.user ?? 'unknown';
  if (actor.trim() === '' || actor.length > 200) throw new CommandLineError('--by must be 1 to 200 characters', help);
  return actor;
}

/** The event's page in the Temporal Web UI (TEMPORAL_UI_URL, default http://localhost:8233). */
export function workflowUiUrl(uiBase: string, namespace: string, workflowId: string): string {
  return webUiLinks(uiBase, namespace).workflow(workflowId);
}

export function writeJson(out: Output, value: unknown): void {
  out.write(`${JSON.stringify(value, null, 2)}\n`);
}
