/**
 * The operator CLI's command layer: `runCli(argv, ctx)` runs one command and returns its exit
 * code. It never exits the process and never reads the environment, so tests call it in-process
 * with their own database, Temporal client and output buffers; src/bin/cli.ts is the thin entry.
 */
import { ConfigError } from '../config.js';
import { scrub } from '../log.js';
import { CANCEL_HELP, cancelCommand } from './commands/cancel.js';
import { CUSTOMERS_HELP, customersCommand } from './commands/customers.js';
import { DEAD_HELP, deadCommand } from './commands/dead.js';
import { IMPORT_HELP, importCommand } from './commands/import.js';
import { INSPECT_HELP, inspectCommand } from './commands/inspect.js';
import { PRUNE_HELP, pruneCommand } from './commands/prune.js';
import { REBILL_HELP, rebillCommand } from './commands/rebill.js';
import { RECONCILE_HELP, reconcileCommand } from './commands/reconcile.js';
import { RELAYS_HELP, relaysCommand } from './commands/relays.js';
import { RESTORED_HELP, restoredCommand } from './commands/restored.js';
import { RETRY_HELP, retryCommand } from './commands/retry.js';
import { STATUS_HELP, statusCommand } from './commands/status.js';
import { MIGRATE_HELP, migrateCommand } from './commands/migrate.js';
import { API_HELP, serviceCommand, START_HELP, WORKER_HELP } from './commands/services.js';
import { EXIT_FAILED, EXIT_OK, EXIT_USAGE, CommandLineError, type CliContext } from './context.js';

export type { CliContext, Output } from './context.js';
export { EXIT_FAILED, EXIT_OK, EXIT_USAGE } from './context.js';

interface Command {
  summary: string;
  help: string;
  run(args: string[], ctx: CliContext): Promise<number>;
}

/** What a deployment runs, then what an operator runs: the two groups of the help. */
const SERVICES: Record<string, Command> = {
  migrate: { summary: 'apply pending database migrations (safe from many processes at once)', help: MIGRATE_HELP, run: migrateCommand },
  worker: { summary: 'run a worker: relays and usage workflows, until SIGTERM (then it drains)', help: WORKER_HELP, run: serviceCommand('worker', WORKER_HELP) },
  api: { summary: 'run the HTTP ingestion API (POST /v1/usage), until SIGTERM', help: API_HELP, run: serviceCommand('api', API_HELP) },
  start: { summary: 'run everything locally, embedded where unconfigured (development)', help: START_HELP, run: serviceCommand('start', START_HELP) },
};

const OPERATOR_COMMANDS: Record<string, Command> = {
  status: { summary: 'counts by status, backlog age, send rate, dead letters by error', help: STATUS_HELP, run: statusCommand },
  dead: { summary: 'list dead letters (--rejected: events Stripe rejected after accepting)', help: DEAD_HELP, run: deadCommand },
  inspect: { summary: "one event's row, workflow state and Web UI link", help: INSPECT_HELP, run: inspectCommand },
  retry: { summary: 'retry one dead letter, or all of them (--all-dead)', help: RETRY_HELP, run: retryCommand },
  rebill: { summary: 'bill again, under a new identifier, an event Stripe rejected (rejected_async)', help: REBILL_HELP, run: rebillCommand },
  reconcile: { summary: "compare sent usage with Stripe's meter event summaries, hour by hour", help: RECONCILE_HELP, run: reconcileCommand },
  cancel: { summary: 'cancel a sent event at Stripe (within 24 h of receipt)', help: CANCEL_HELP, run: cancelCommand },
  customers: { summary: 'map tenants to Stripe customers (set, list)', help: CUSTOMERS_HELP, run: customersCommand },
  import: { summary: 'record existing usage from a CSV or JSON-lines file, through the outbox', help: IMPORT_HELP, run: importCommand },
  prune: { summary: 'delete delivered rows past OUTBOX_RETENTION_DAYS (workers do it on a timer)', help: PRUNE_HELP, run: pruneCommand },
  relays: { summary: 'pause or resume handing new events to Temporal (those in flight go on)', help: RELAYS_HELP, run: relaysCommand },
  restored: { summary: 'after restoring from a backup, before workers start: guard its unsettled events against a second bill', help: RESTORED_HELP, run: restoredCommand },
};

const COMMANDS: Record<string, Command> = { ...SERVICES, ...OPERATOR_COMMANDS };

const list = (commands: Record<string, Command>) =>
  Object.entries(commands)
    .map(([name, c]) => `  ${name.padEnd(10)} ${c.summary}`)
    .join('\n');

export const MAIN_HELP = `Usage: billing-outbox <command> [options]

The billing outbox's processes and its operator commands. In a checkout or an application that
installed it: npx billing-outbox <command>.

Run:
${list(SERVICES)}

Operate:
${list(OPERATOR_COMMANDS)}

Run \`billing-outbox <command> --help\` for a command's options. Most take --json for scripts.

Environment: while \`npm start\` runs on this machine, DATABASE_URL and TEMPORAL_ADDRESS default
to its own (read from .data/endpoints.json, or DATA_DIR's) when both are unset, and so does its
local Stripe unless STRIPE_API_KEY or STRIPE_API_BASE is set (with one of the two alone, the other
is never guessed: a command needing it is refused); otherwise DATABASE_URL must be set and
TEMPORAL_ADDRESS defaults to localhost:7233. TEMPORAL_NAMESPACE (default "default"),
TEMPORAL_TASK_QUEUE (where reopened workflows run), STRIPE_API_KEY and STRIPE_API_BASE
(customers set, reconcile and cancel call Stripe).

Exit codes: 0 success, 1 an operation failed or was refused, 2 a usage or configuration error.
`;

export async function runCli(argv: string[], ctx: CliContext): Promise<number> {
  const [name, ...args] = argv;
  if (name === undefined || name === '--help' || name === '-h' || name === 'help') {
    const topic = name === 'help' ? args[0] : undefined;
    const command = topic === undefined ? undefined : COMMANDS[topic];
    if (topic !== undefined && !command) return usage(ctx, `unknown command: ${topic}`, MAIN_HELP);
    (name === undefined ? ctx.err : ctx.out).write(command?.help ?? MAIN_HELP);
    return name === undefined ? EXIT_USAGE : EXIT_OK;
  }
  const command = Object.hasOwn(COMMANDS, name) ? COMMANDS[name] : undefined;
  if (!command) return usage(ctx, `unknown command: ${name}`, MAIN_HELP);
  try {
    return await command.run(args, ctx);
  } catch (err) {
    if (err instanceof CommandLineError) return usage(ctx, err.message, err.help ?? command.help);
    if (err instanceof ConfigError) {
      ctx.err.write(`${err.message}\n`);
      return EXIT_USAGE;
    }
    // Errors from pg or gRPC can quote a connection string: scrub before printing.
    ctx.err.write(`billing-outbox ${name}: ${scrub(err instanceof Error ? err.message : String(err))}\n`);
    return EXIT_FAILED;
  }
}

function usage(ctx: CliContext, message: string, help: string): number {
  ctx.err.write(`billing-outbox: ${message}\n\n${help}`);
  return EXIT_USAGE;
}
