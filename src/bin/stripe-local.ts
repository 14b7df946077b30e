/**
 * Standalone local Stripe:
 *
 *   tsx src/bin/stripe-local.ts [--port N] [--host H] [--meter NAME]... [--customer ID]...
 *                                [--api-key KEY] [--rate-limit N]
 *                                [--webhook-url URL --webhook-secret SECRET]
 *
 * Port: `--port`, else env LOCAL_STRIPE_PORT, else 12111 (stripe-mock's port, so tools that default
 * to it work). Prints one JSON line `{"localStripe":"http://127.0.0.1:PORT"}` once it listens, and
 * closes on SIGTERM/SIGINT. Drive it through the control API (`/_local/*`, see control.ts).
 */
import { parseArgs } from 'node:util';
import { LocalStripe, type LocalStripeOptions } from '../embedded/stripe/server.js';

const DEFAULT_PORT = 12111;

function parseOptions(argv: string[], env: NodeJS.ProcessEnv): LocalStripeOptions {
  const { values } = parseArgs({
    args: argv,
    options: {
      port: { type: 'string' },
      host: { type: 'string' },
      meter: { type: 'string', multiple: true },
      customer: { type: 'string', multiple: true },
      'api-key': { type: 'string' },
      'rate-limit': { type: 'string' },
      'webhook-url': { type: 'string' },
      'webhook-secret': { type: 'string' },
    },
    strict: true,
  });
  const webhookUrl = values['webhook-url'];
  const webhookSecret = values['webhook-secret'];
  if ((webhookUrl === undefined) !== (webhookSecret === undefined)) {
    throw new Error('--webhook-url and --webhook-secret go together');
  }
  return {
    port: parseInteger('port', values.port ?? env.LOCAL_STRIPE_PORT ?? String(DEFAULT_PORT), 0, 65535),
    host: values.host,
    meters: values.meter,
    customers: values.customer,
    apiKey: values['api-key'],
    rateLimitPerSecond: values['rate-limit'] === undefined ? undefined : parseInteger('rate-limit', values['rate-limit'], 1, 1_000_000),
    webhook: webhookUrl !== undefined && webhookSecret !== undefined ? { url: webhookUrl, secret: webhookSecret } : undefined,
  };
}

function parseInteger(name: string, raw: string, min: number, max: number): number {
  const value = Number(raw);
  if (!/^\d+$/.test(raw) || value < min || value > max) {
    throw new Error(`${name} must be a whole number from ${min} to ${max}, got '${raw}'`);
  }
  return value;
}

async function main(): Promise<void> {
  let options: LocalStripeOptions;
  try {
    options = parseOptions(process.argv.slice(2), process.env);
  } catch (error) {
    process.stderr.write(`local-stripe: ${error instanceof Error ? error.message : String(error)}\n`);
    process.exit(2);
  }
  const server = await LocalStripe.start(options);
  process.stdout.write(`${JSON.stringify({ localStripe: server.url })}\n`);

  const shutdown = () => {
    server.close().then(
      () => process.exit(0),
      (error: unknown) => {
        process.stderr.write(`local-stripe: close failed: ${String(error)}\n`);
        process.exit(1);
      },
    );
  };
  process.once('SIGTERM', shutdown);
  process.once('SIGINT', shutdown);
}

await main();
