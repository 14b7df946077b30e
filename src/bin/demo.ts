/**
 * `npm run demo`: the main job on embedded defaults, with proof.
 *
 * Starts everything in a fresh temporary folder (PostgreSQL, a Temporal dev server with its Web UI,
 * the local Stripe-compatible server, a worker and the HTTP API), then behaves like a client:
 * a steady stream of usage over POST /v1/usage for several tenants and two meters, some of it sent
 * twice, with Stripe taken down part-way through. When the outbox has drained it checks what the
 * local Stripe recorded against what was committed, prints PASS or FAIL, and exits 0 or 1.
 *
 * The parts are the chaos runner's (chaos/): its seeded generator and load (over HTTP only here),
 * its drain, and its exactly-once verifier, the one check both end on. This file orchestrates and
 * prints.
 *
 * DATABASE_URL and TEMPORAL_ADDRESS are ignored: the demo writes synthetic usage, and its own
 * PostgreSQL and Temporal keep it out of yours. A test-mode STRIPE_API_KEY (or a STRIPE_API_BASE of
 * another Stripe-compatible server) is honoured: the same stream then goes there, without the
 * outage, and is checked through the outbox only. A live key is refused.
 */
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import type pg from 'pg';
import type Stripe from 'stripe';
import { outboxProgress, waitForDrain, type OutboxProgress } from '../../chaos/drain.js';
import { checkInvariant, type CheckResult, type PairTotals } from '../../chaos/invariant.js';
import { Load } from '../../chaos/load.js';
import { Rng } from '../../chaos/rng.js';
import { METERS } from '../../chaos/world.js';
import { ConfigError, loadConfig, type ApiToken, type Config } from '../config.js';
import { redactUrl } from '../db.js';
import { writeEndpoints } from '../embedded/local-files.js';
import { findTemporalCli } from '../embedded/temporal.js';
import { mapTenant } from '../ops/customers.js';
import { runMain } from './run-main.js';
import { startStack, type Stack } from '../embedded/stack.js';
import { schemaFor, type Schema } from '../outbox/sql/schema.js';

// ---- settings -------------------------------------------------------------------------------------

const USAGE = `Usage: npm run demo -- [options]

  --events N   usage events to send (default 600; 120 with --short)
  --rate R     events per second (default 25 locally, 10 against Stripe; 20 with --short)
  --short      CI mode: 120 events, a 4 s outage, done in well under a minute
  --keep       keep everything running after the check (browse the Web UI) until Ctrl-C;
               the data folder is kept too
  --seed S     replay the same stream of events (the seed is printed on every run)
  --help       this text

With STRIPE_API_KEY set to a test-mode key, the events go to that Stripe account (it needs active
meters for api_requests and tokens; three demo customers are created there once, by email).
A live key is refused.`;

/** The demo's tenants; the first is the hot one of the chaos load (40 % of the traffic, then its share of the rest). */
const TENANTS = ['acme', 'globex', 'initech'] as const;
const SENDERS = 8;
/** Of the submissions over HTTP, this share sends an earlier usage_id again: recorded once, answered 200. */
const RESEND_SHARE = 0.06;

/**
 * The demo's own settings, validated by the same loadConfig as any environment: retries on a
 * demo's time scale (250 ms doubling to 2 s, 60 attempts: an outage of seconds never exhausts
 * them), a fast relay poll, an API on any free port, errors-only logs. Against the local Stripe the
 * meter-event rate limit is raised: it has none, and the demo should show the pipeline's pace.
 */
const DEMO_ENV: Record<string, string> = {
  NODE_ENV: 'development',
  TEMPORAL_TASK_QUEUE: 'billing-outbox-demo',
  STRIPE_TIMEOUT_MS: '5000',
  STRIPE_RATE_LIMIT_PER_SECOND: '200',
  RETRY_INITIAL_INTERVAL_MS: '250',
  RETRY_BACKOFF_COEFFICIENT: '2',
  RETRY_MAXIMUM_INTERVAL_MS: '2000',
  RETRY_MAXIMUM_ATTEMPTS: '60',
  RELAY_COUNT: '2',
  RELAY_POLL_INTERVAL_MS: '200',
  API_PORT: '0',
  LOG_LEVEL: 'error',
};

interface Options {
  events: number;
  rate: number | undefined;
  short: boolean;
  keep: boolean;
  seed: number;
}

class UsageProblem extends Error {}

function parseOptions(argv: string[]): Options | 'help' {
  const { values } = parseArgs({
    args: argv,
    options: {
      events: { type: 'string' },
      rate: { type: 'string' },
      short: { type: 'boolean', default: false },
      keep: { type: 'boolean', default: false },
      seed: { type: 'string' },
      help: { type: 'boolean', default: false },
    },
    strict: true,
  });
  if (values.help) return 'help';
  const int = (name: string, raw: string | undefined, min: number, max: number): number | undefined => {
    if (raw === undefined) return undefined;
    if (!/^\d+$/.test(raw) || Number(raw) < min || Number(raw) > max) throw new UsageProblem(`--${name} must be a whole number from ${min} to ${max}`);
    return Number(raw);
  };
  return {
    events: int('events', values.events, 10, 100_000) ?? (values.short ? 120 : 600),
    rate: int('rate', values.rate, 1, 1_000),
    short: values.short,
    keep: values.keep,
    seed: int('seed', values.seed, 0, 2 ** 32 - 1) ?? randomBytes(4).readUInt32BE(0),
  };
}

// ---- output ---------------------------------------------------------------------------------------

/** Lines for the record, plus one live status line that a terminal redraws in place. */
class Output {
  private live = '';
  private readonly tty: boolean;
  constructor(tty: boolean) {
    this.tty = tty;
  }

  line(text = ''): void {
    if (this.tty && this.live) process.stdout.write(`\r\x1b[2K${text}\n${this.live}`);
    else process.stdout.write(`${text}\n`);
  }

  status(text: string): void {
    if (this.tty) {
      this.live = text;
      process.stdout.write(`\r\x1b[2K${text}`);
    } else {
      process.stdout.write(`${text}\n`);
    }
  }

  endStatus(): void {
    if (this.tty && this.live) process.stdout.write('\n');
    this.live = '';
  }
}

const fmt = (n: number) => n.toLocaleString('en-US');
const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const delivered = (p: OutboxProgress) => p.counts.sent + p.counts.accepted;

class Interrupted extends Error {}

/** Resolves after `ms`, or rejects with Interrupted when `signal` aborts first. */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new Interrupted());
    const onAbort = () => {
      clearTimeout(timer);
      reject(new Interrupted());
    };
    const timer = setTimeout(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal.addEventListener('abort', onAbort, { once: true });
  });
}

/** Prints the live line once a second until stopped. */
function startTicker(stack: Stack, out: Output, load: Load, total: number, outageState: () => string) {
  const stop = new AbortController();
  const t0 = Date.now();
  let last = { at: Date.now(), sent: 0 };
  const loop = (async () => {
    while (!stop.signal.aborted) {
      await sleep(1000, stop.signal).catch(() => undefined);
      if (stop.signal.aborted) break;
      const p = await outboxProgress(stack.pool).catch(() => undefined);
      if (!p) continue;
      const now = Date.now();
      const sent = delivered(p);
      const perSecond = ((sent - last.sent) * 1000) / Math.max(1, now - last.at);
      last = { at: now, sent };
      const submitted = load.counts.overHttp + load.counts.resent;
      out.status(
        `  ${seconds(now - t0).padStart(6)}  submitted ${fmt(submitted)}/~${fmt(total)}  enqueued ${fmt(p.total)}  ` +
          `in flight ${fmt(p.unfinished)}  sent ${fmt(sent)}  dead ${fmt(p.counts.dead)}  ${perSecond.toFixed(1)} sent/s${outageState()}`,
      );
    }
  })();
  return {
    async stop() {
      if (stop.signal.aborted) return;
      stop.abort();
      await loop;
      out.endStatus();
    },
  };
}

// ---- against a real Stripe account ----------------------------------------------------------------

/**
 * Makes the account ready for the stream: the two meters must exist (the demo does not create
 * meters in your account: they cannot be deleted), and one customer per demo tenant is found by
 * its email or created once, then mapped like an operator would (src/ops/customers.ts).
 */
async function prepareStripeAccount(stripe: Stripe, pool: pg.Pool, schema: Schema): Promise<Record<string, string>> {
  const meters = await stripe.billing.meters.list({ status: 'active', limit: 100 });
  const problems: string[] = [];
  for (const name of METERS) {
    const meter = meters.data.find((m) => m.event_name === name);
    if (!meter) problems.push(`no active meter with event name "${name}"`);
    else if (meter.customer_mapping.event_payload_key !== 'stripe_customer_id' || meter.value_settings.event_payload_key !== 'value') {
      problems.push(`meter "${name}" must map the customer from "stripe_customer_id" and the value from "value" (the defaults)`);
    }
  }
  if (problems.length > 0) {
    throw new Error(
      `this Stripe account is not ready for the demo: ${problems.join('; ')}. ` +
        'Create the meters (Dashboard → Billing → Meters, aggregation Sum), or run without STRIPE_API_KEY to use the local Stripe server.',
    );
  }
  const customers: Record<string, string> = {};
  for (const tenant of TENANTS) {
    const email = `billing-outbox-demo+${tenant}@example.com`;
    const found = await stripe.customers.list({ email, limit: 10 });
    const customer =
      found.data.find((c) => c.email === email) ??
      (await stripe.customers.create({ name: `billing-outbox demo: ${tenant}`, email, metadata: { billing_outbox_demo: tenant } }));
    await mapTenant(pool, schema, tenant, customer.id, 'demo');
    customers[tenant] = customer.id;
  }
  return customers;
}

// ---- the check ------------------------------------------------------------------------------------

type Verdict = 'PASS' | 'FAIL' | 'SKIP';
interface Check {
  verdict: Verdict;
  text: string;
}

const check = (ok: boolean, text: string): Check => ({ verdict: ok ? 'PASS' : 'FAIL', text });

interface Outage {
  atMs: number;
  seconds: number;
  startedAt?: number;
  endedAt?: number;
}

/**
 * The verdicts: what the API answered (the load's tally), the exactly-once verifier's table, the
 * outage's effect, and the Temporal queries the demo tells you to use.
 */
async function runChecks(args: {
  stack: Stack;
  load: Load;
  events: number;
  customers: Record<string, string>;
  verified: CheckResult;
  progress: OutboxProgress;
  outage: Outage | undefined;
  drained: boolean;
  out: Output;
}): Promise<Check[]> {
  const { stack, load, events, customers, verified, progress, outage, drained, out } = args;
  const { table, violations, pairs } = verified;
  const { counts } = load;
  const checks: Check[] = [];

  checks.push(check(counts.overHttp === events && counts.httpCreated === events, `API: ${fmt(counts.httpCreated)} of ${fmt(events)} new usage events answered 201 Created`));
  checks.push(
    check(
      counts.resent > 0 && counts.resentAnsweredRecorded === counts.resent,
      `API: ${fmt(counts.resentAnsweredRecorded)} of ${fmt(counts.resent)} re-sent usage_ids answered 200 (already recorded), not 201`,
    ),
  );
  for (const u of load.unexpected.slice(0, 5)) out.line(`        unexpected answer: ${u}`);

  const sent = delivered(progress);
  checks.push(
    check(
      drained && sent === progress.total && progress.counts.dead === 0,
      `Outbox: ${fmt(sent)} of ${fmt(progress.total)} rows sent, ${fmt(progress.counts.dead)} dead letters${drained ? '' : ' (did not drain in time)'}`,
    ),
  );

  // The client's own ledger of what it was told was recorded, per Stripe customer and meter.
  const clientTotals = new Map<string, number>();
  for (const u of load.acknowledged.values()) {
    const pair = `${customers[u.tenantId] ?? `(${u.tenantId})`} ${u.eventName}`;
    clientTotals.set(pair, (clientTotals.get(pair) ?? 0) + u.quantity);
  }
  const committedEqual = pairs.length === clientTotals.size && pairs.every((p) => clientTotals.get(`${p.customer} ${p.eventName}`) === p.committed);
  checks.push(check(committedEqual, `PostgreSQL: usage sums per (customer, meter) equal what the API acknowledged (${pairs.length} pairs)`));

  checks.push(
    check(
      violations.length === 0 && table.committed === load.acknowledged.size,
      table.stripeRead
        ? `Exactly once (the chaos runner's verifier): ${fmt(table.committed)} usages committed, ${fmt(table.recorded)} recorded by Stripe; ` +
            `${table.lost} lost, ${table.doubleBilled} twice, ${table.wrongFields} with a wrong value/customer/meter/time, ` +
            `${table.billedButUncommitted} never committed, ${table.dead} dead, ${table.unsettled} unsettled`
        : `Exactly once, the database's side (the chaos runner's verifier): ${fmt(table.committed)} usages committed, each with one outbox row; ` +
            `${table.dead} dead, ${table.unsettled} unsettled`,
    ),
  );
  for (const v of violations) out.line(`        ${v}`);
  if (table.stripeRead) {
    const equal = pairs.filter((p) => p.recorded === p.committed).length;
    checks.push(check(equal === pairs.length && pairs.length > 0, `Stripe: totals per (customer, meter) equal the usage sums (${equal} of ${pairs.length} pairs)`));
  } else {
    checks.push({
      verdict: 'SKIP',
      text: "Stripe: what Stripe recorded is not read back here; checking it is reconciliation against the meters' event summaries (not implemented in this demo)",
    });
  }

  if (outage && stack.localStripe) {
    // Every attempt is counted on its row before the call; the local Stripe logs every call that
    // reached it. The difference is the calls the outage cut off.
    const cutOff = table.attempts - stack.localStripe.requests().length;
    checks.push(
      check(
        cutOff > 0 && table.retried > 0,
        `Outage: ${fmt(cutOff)} attempts cut off while Stripe was down; ${fmt(table.retried)} events needed more than one attempt, each billed once`,
      ),
    );
  }

  // The queries the demo tells you to use find the same thing. Visibility trails the workflows by a moment.
  const count = async (query: string) => (await stack.client.workflow.count(query)).count;
  try {
    let completed = -1;
    let dead = -1;
    const until = Date.now() + 15_000;
    do {
      [completed, dead] = await Promise.all([count('WorkflowType="usageWorkflow" AND ExecutionStatus="Completed"'), count('OutboxStatus="dead"')]);
      if (completed === sent && dead === progress.counts.dead) break;
      await new Promise((r) => setTimeout(r, 250));
    } while (Date.now() < until);
    checks.push(
      check(completed === sent && dead === 0, `Temporal: completed usage workflows ${fmt(completed)} (each one a delivered event), OutboxStatus="dead" finds ${fmt(dead)}`),
    );
  } catch (err) {
    checks.push(check(false, `Temporal: visibility query failed: ${err instanceof Error ? err.message : String(err)}`));
  }

  if (stack.temporalUi) {
    const ok = await fetch(stack.temporalUi, { signal: AbortSignal.timeout(5_000) }).then(
      (r) => r.ok,
      () => false,
    );
    checks.push(check(ok, `Temporal Web UI answers at ${stack.temporalUi}`));
  }
  return checks;
}

function printTotals(out: Output, pairs: PairTotals[]): void {
  const read = pairs.some((p) => p.recorded !== undefined);
  out.line();
  out.line(`  ${'customer'.padEnd(22)}${'meter'.padEnd(14)}${'events'.padStart(8)}${'usage sum'.padStart(14)}${read ? 'Stripe sum'.padStart(14) : ''}`);
  for (const p of pairs) {
    const stripe = p.recorded === undefined ? '' : `${fmt(p.recorded).padStart(14)}${p.recorded === p.committed ? '  ✓' : '  ✗'}`;
    out.line(`  ${p.customer.padEnd(22)}${p.eventName.padEnd(14)}${fmt(p.events).padStart(8)}${fmt(p.committed).padStart(14)}${stripe}`);
  }
}

// ---- main -----------------------------------------------------------------------------------------

/** The user's Stripe settings; everything else is the demo's own. */
function demoConfig(user: Config): { config: Config; external: boolean } {
  const own = loadConfig(DEMO_ENV);
  const external = user.stripe.apiKey !== undefined || !user.stripe.isRealStripe;
  return { config: { ...own, temporalCliPath: user.temporalCliPath, stripe: external ? user.stripe : own.stripe }, external };
}

await runMain(async () => {
  let opts: Options | 'help';
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    console.error(`${err instanceof Error ? err.message : String(err)}\n\n${USAGE}`);
    process.exitCode = 2;
    return;
  }
  if (opts === 'help') {
    console.log(USAGE);
    return;
  }
  const user = loadConfig();
  if (user.stripe.apiKey && /^(sk|rk)_live_/.test(user.stripe.apiKey)) {
    throw new ConfigError(['STRIPE_API_KEY: is a live key; the demo sends synthetic usage and only runs with a test-mode key (sk_test_…) or none']);
  }
  const { config, external } = demoConfig(user);
  const out = new Output(Boolean(process.stdout.isTTY));
  const rate = opts.rate ?? (opts.short ? 20 : external ? 10 : 25);

  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-demo-'));
  // Run as root, PostgreSQL runs as a `postgres` system user that must be able to enter this folder.
  await chmod(dataDir, 0o755);
  // Ctrl-C (or SIGTERM) stops the run and cleans up; another one a moment later exits at once.
  const interrupt = new AbortController();
  let interruptedAt = 0;
  const onSignal = (signal: NodeJS.Signals) => {
    if (interrupt.signal.aborted) {
      // One Ctrl-C arrives several times (from the terminal, and passed on by npm and tsx): only a
      // later one means "now".
      if (Date.now() - interruptedAt < 1_000) return;
      out.line(`  ${signal} again: exiting without cleaning up (data left in ${dataDir})`);
      process.exit(130);
    }
    interruptedAt = Date.now();
    out.line(`\n  ${signal}: stopping everything…`);
    interrupt.abort();
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);

  // The demo authenticates to its API like any client, with a token that exists only in this process.
  const token: ApiToken = { name: 'demo', token: randomBytes(32).toString('base64url'), tenants: [...TENANTS], scopes: ['usage:write'] };

  out.line('billing-outbox demo: usage → PostgreSQL outbox → Temporal → Stripe meter events, exactly once in effect');
  out.line(`  Starting embedded PostgreSQL, a Temporal dev server with its Web UI, ${external ? '' : 'the local Stripe server, '}a worker and the HTTP API`);
  out.line(`  in ${dataDir} …`);
  const startedAt = Date.now();
  let stack: Stack | undefined;
  let passed = false;
  try {
    stack = await startStack(config, {
      dataDir,
      apiTokens: [token],
      quiet: true,
      // Any free port: the demo must not collide with `npm start`, the tests or itself. The Web UI
      // takes its usual port when that is free, for whoever opens it.
      ports: { postgres: 0, temporal: 0, temporalUi: 8233, localStripe: 0 },
    });
    if (interrupt.signal.aborted) throw new Interrupted();
    const customers = external ? await prepareStripeAccount(stack.stripe, stack.pool, schemaFor(config.databaseSchema)) : { ...stack.seededCustomers };
    // Where the CLI finds this run (DATA_DIR=<dataDir>), as it finds `npm start`'s.
    await writeEndpoints(dataDir, {
      pid: process.pid,
      databaseUrl: stack.databaseUrl,
      temporalAddress: stack.temporalAddress,
      temporalUi: stack.temporalUi,
      stripeApiBase: stack.config.stripe.apiBase,
      localStripe: stack.localStripe?.url,
      api: stack.apiUrl,
      apiTokenFile: undefined,
    });

    out.line(`  Ready in ${seconds(Date.now() - startedAt)}.`);
    out.line(`    PostgreSQL:       ${redactUrl(stack.databaseUrl)}`);
    out.line(`    Temporal:         ${stack.temporalAddress}`);
    out.line(`    Temporal Web UI:  ${stack.temporalUi ?? '(none)'}`);
    out.line(
      stack.localStripe
        ? `    Stripe:           ${stack.localStripe.url}  (the local Stripe-compatible server: NOTHING IS BILLED)`
        : stack.config.stripe.isRealStripe
          ? `    Stripe:           ${stack.config.stripe.apiBase}  (your account, test mode: the events are recorded there)`
          : `    Stripe:           ${stack.config.stripe.apiBase}  (the Stripe-compatible server of STRIPE_API_BASE)`,
    );
    out.line(`    API:              ${stack.apiUrl}  (POST /v1/usage; the demo's API token "${token.name}" is made for this run and never shown)`);
    out.line(`    Tenants:          ${Object.entries(customers).map(([t, c]) => `${t} → ${c}`).join(', ')}`);

    // The chaos runner's load, over HTTP only: the API is the demo's only way in.
    const windowMs = (opts.events / rate) * 1000;
    const load = new Load(
      { apiUrl: stack.apiUrl, apiToken: token.token, pool: stack.pool, tenants: TENANTS.map((tenantId) => ({ tenantId })) },
      new Rng(opts.seed),
      { events: opts.events, windowMs, burst: 0, clients: SENDERS, mix: { http: 1, transaction: 0, concurrentDuplicate: 0 }, resendShare: RESEND_SHARE, signal: interrupt.signal },
      (line) => out.line(`  ${line}`),
    );
    const outage: Outage | undefined = stack.localStripe ? { atMs: windowMs / 4, seconds: opts.short ? 4 : 8 } : undefined;
    out.line();
    out.line(
      `  Sending ${fmt(opts.events)} usage events (${METERS.join(' and ')}) and, among them, about ${Math.round(RESEND_SHARE * 100)} % re-sends of earlier usage_ids, ` +
        `${rate}/s from ${SENDERS} concurrent clients (seed ${opts.seed})`,
    );
    out.line(
      outage
        ? `  Stripe goes down for ${outage.seconds} s after ${seconds(outage.atMs)}. Retries: ` +
            `${config.retry.initialIntervalMs} ms doubling to ${config.retry.maximumIntervalMs / 1000} s, up to ${config.retry.maximumAttempts} attempts.`
        : '  No outage: a real Stripe cannot be taken down from here.',
    );
    out.line();

    const localStripe = stack.localStripe;
    let outageTimer: NodeJS.Timeout | undefined;
    const beginOutage = (stripe: NonNullable<typeof localStripe>, planned: Outage) => {
      if (interrupt.signal.aborted) return;
      // Not before deliveries reach Stripe: on a busy machine the first ones can come later than the
      // planned time, and an outage before them would cut nothing off.
      if (stripe.requests().length === 0) {
        outageTimer = setTimeout(() => beginOutage(stripe, planned), 250);
        return;
      }
      stripe.refuseFor(planned.seconds);
      planned.startedAt = Date.now();
      out.line(`  ▼ Stripe is DOWN: every connection refused for ${planned.seconds} s (after ${fmt(load.counts.overHttp + load.counts.resent)} submissions)`);
      setTimeout(() => {
        planned.endedAt = Date.now();
        if (!interrupt.signal.aborted) out.line(`  ▲ Stripe is back after ${planned.seconds} s; the retries go through`);
      }, planned.seconds * 1000).unref();
    };
    if (outage && localStripe) outageTimer = setTimeout(() => beginOutage(localStripe, outage), outage.atMs);
    const sendingFrom = Date.now();
    const sending = load.run();
    const ticker = startTicker(stack, out, load, Math.round(opts.events * (1 + RESEND_SHARE)), () => (outage?.startedAt && !outage.endedAt ? '  [Stripe DOWN]' : ''));
    try {
      await Promise.race([sending, stack.workerDone.then(() => Promise.reject(new Error('the worker stopped unexpectedly')))]);
      if (interrupt.signal.aborted) throw new Interrupted();
      const submitted = load.counts.overHttp + load.counts.resent;
      out.line(`  All ${fmt(submitted)} submissions answered in ${seconds(Date.now() - sendingFrom)}; waiting for the outbox to drain…`);
      const drained = await waitForDrain(stack.pool, {
        timeoutMs: opts.short ? 40_000 : 120_000,
        atLeast: load.acknowledged.size,
        pollMs: 250,
        signal: interrupt.signal,
      });
      if (interrupt.signal.aborted) throw new Interrupted();
      await ticker.stop();
      const progress = await outboxProgress(stack.pool);
      out.line(
        `  ${drained ? 'Drained' : 'NOT drained'} ${seconds(Date.now() - sendingFrom)} after the first submission: ` +
          `sent ${fmt(delivered(progress))}, dead ${fmt(progress.counts.dead)}, still in flight ${fmt(progress.unfinished)}.`,
      );

      out.line();
      out.line(stack.localStripe ? 'Self-check against what the local Stripe recorded' : 'Self-check (through the outbox)');
      const verified = await checkInvariant({ pool: stack.pool, stripe: stack.localStripe, secrets: () => [token.token] }, load);
      printTotals(out, verified.pairs);
      const checks = await runChecks({ stack, load, events: opts.events, customers, verified, progress, outage, drained, out });
      out.line();
      for (const c of checks) out.line(`  ${c.verdict}  ${c.text}`);
      const failed = checks.filter((c) => c.verdict === 'FAIL').length;
      const counted = checks.filter((c) => c.verdict !== 'SKIP').length;
      passed = failed === 0;
      out.line();
      out.line(
        passed
          ? `RESULT: PASS (${counted} of ${counted} checks): every committed usage event ${stack.localStripe ? 'billed exactly once' : 'acknowledged by Stripe'}`
          : `RESULT: FAIL (${failed} of ${counted} checks failed)`,
      );
    } finally {
      clearTimeout(outageTimer);
      await ticker.stop();
      await sending.catch(() => undefined);
    }

    printWhereToLook(out, stack, dataDir, config, opts.keep);
    if (opts.keep && !interrupt.signal.aborted) {
      out.line();
      out.line('Still running (--keep). Stop with Ctrl-C.');
      await new Promise<void>((resolve) => interrupt.signal.addEventListener('abort', () => resolve(), { once: true }));
    }
  } catch (err) {
    if (!(err instanceof Interrupted) && !interrupt.signal.aborted) throw err;
  } finally {
    out.line(interrupt.signal.aborted ? '  Stopping (a few seconds at most)…' : '\nStopping everything…');
    // Interrupted, nothing is worth a long drain (and a terminal's Ctrl-C has already stopped the
    // embedded PostgreSQL, so in-flight work could not finish anyway).
    await stack?.stop(interrupt.signal.aborted ? { stepTimeoutMs: 3_000 } : {});
    if (opts.keep) out.line(`  Data kept in ${dataDir} (delete it when you are done).`);
    else await rm(dataDir, { recursive: true, force: true });
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
  }
  out.line('Stopped.');
  // With --keep, Ctrl-C is the normal end and the result stands; otherwise it cut the run short.
  process.exitCode = interrupt.signal.aborted && !opts.keep ? 130 : passed ? 0 : 1;
  // Whatever a library leaves open (a worker that could not drain) must not keep a finished demo alive.
  setTimeout(() => process.exit(), interrupt.signal.aborted ? 0 : 5_000).unref();
});

function printWhereToLook(out: Output, stack: Stack, dataDir: string, config: Config, keep: boolean): void {
  const ns = config.temporal.namespace;
  const cli = findTemporalCli(config.temporalCliPath) ?? 'temporal';
  const endpoints = path.join(dataDir, 'endpoints.json');
  out.line();
  out.line(keep ? 'Where to look (everything keeps running):' : 'Where to look (run with --keep to keep everything up for this):');
  if (stack.temporalUi) {
    out.line(`  Temporal Web UI:  ${stack.temporalUi}/namespaces/${ns}/workflows`);
    out.line(`  Dead letters:     query OutboxStatus="dead" in the Web UI:`);
    out.line(`                    ${stack.temporalUi}/namespaces/${ns}/workflows?query=${encodeURIComponent('OutboxStatus="dead"')}`);
  }
  out.line(`                    or: ${cli} workflow list --address ${stack.temporalAddress} -q 'OutboxStatus="dead"'`);
  out.line(`  The outbox:       DATA_DIR=${dataDir} npm run cli -- status     (also: dead, inspect <key>)`);
  out.line(`                    or psql "$(node -p "require('${endpoints}').databaseUrl")"`);
  if (stack.localStripe) out.line(`  Local Stripe:     ${stack.localStripe.url}/_local/events  (every meter event it recorded)`);
}
