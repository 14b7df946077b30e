/**
 * `npm run demo`: the main job on embedded defaults, with proof.
 *
 * Starts everything in a fresh temporary folder (PostgreSQL, a Temporal dev server with its Web UI,
 * the local Stripe-compatible server, a worker and the HTTP API), then behaves like a client:
 * a steady stream of usage over POST /v1/usage for several tenants and two meters, some of it sent
 * twice, with Stripe taken down part-way through. When the outbox has drained it checks what the
 * local Stripe recorded against what was committed, prints PASS or FAIL, and exits 0 or 1.
 *
 * DATABASE_URL and TEMPORAL_ADDRESS are ignored: the demo writes synthetic usage, and its own
 * PostgreSQL and Temporal keep it out of yours. A test-mode STRIPE_API_KEY (or a STRIPE_API_BASE of
 * another Stripe-compatible server) is honoured: the same stream then goes there, without the
 * outage, and is checked through the outbox only. A live key is refused.
 */
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import type Stripe from 'stripe';
import { ConfigError, loadConfig, type ApiToken, type Config } from '../config.js';
import { redactUrl, type Queryable } from '../db.js';
import { findTemporalCli } from '../embedded/temporal.js';
import { runMain } from './run-main.js';
import { upsertBillingCustomer } from '../outbox/sql/customers.js';
import { DEMO_CUSTOMERS, LOCAL_METERS, startStack, type Stack } from '../embedded/stack.js';

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

/** Tenants and how much of the traffic each one makes. */
const TENANT_WEIGHTS: readonly (readonly [string, number])[] = [
  ['acme', 5],
  ['globex', 3],
  ['initech', 2],
];
const METERS = LOCAL_METERS;
const SENDERS = 8;
const RESEND_SHARE = 0.05;

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
  constructor(private readonly tty: boolean) {}

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

// ---- the demo's queries ---------------------------------------------------------------------------
// Whole-table counts and sums: right for a demo's few hundred rows, not for a production outbox
// (statusSummary in src/outbox/sql/status.ts is the one that scales).

interface Progress {
  enqueued: number;
  waiting: number;
  inFlight: number;
  retrying: number;
  sent: number;
  dead: number;
}

/** Outbox rows by state; `retrying` = dispatched rows whose last attempt recorded an error. */
async function countProgress(db: Queryable): Promise<Progress> {
  const { rows } = await db.query<Progress>(
    `SELECT count(*)::int                                                                   AS enqueued,
            count(*) FILTER (WHERE status IN ('pending', 'claimed'))::int                   AS waiting,
            count(*) FILTER (WHERE status = 'dispatched' AND last_error_code IS NULL)::int     AS "inFlight",
            count(*) FILTER (WHERE status = 'dispatched' AND last_error_code IS NOT NULL)::int AS retrying,
            count(*) FILTER (WHERE status = 'sent')::int                                      AS sent,
            count(*) FILTER (WHERE status = 'dead')::int                                      AS dead
       FROM outbox`,
  );
  return rows[0]!;
}

interface OutboxCheckRow {
  idempotency_key: string;
  status: string;
  attempt_count: number;
}

async function listOutboxRows(db: Queryable): Promise<OutboxCheckRow[]> {
  const { rows } = await db.query<OutboxCheckRow>('SELECT idempotency_key, status, attempt_count FROM outbox ORDER BY id');
  return rows;
}

async function countUsageRows(db: Queryable): Promise<number> {
  const { rows } = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM usage_logs');
  return rows[0]!.n;
}

interface UsageTotal {
  customer: string;
  event_name: string;
  events: number;
  quantity: number;
}

/** What was committed, per Stripe customer and meter: what Stripe's totals must equal. */
async function usageTotals(db: Queryable): Promise<UsageTotal[]> {
  const { rows } = await db.query<UsageTotal>(
    `SELECT c.stripe_customer_id AS customer, u.event_name, count(*)::int AS events, sum(u.quantity)::bigint AS quantity
       FROM usage_logs u JOIN billing_customers c ON c.tenant_id = u.tenant_id
      GROUP BY 1, 2 ORDER BY 1, 2`,
  );
  return rows;
}

// ---- helpers --------------------------------------------------------------------------------------

class Interrupted extends Error {}

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

/** A small seeded generator (mulberry32): the same --seed gives the same stream of events. */
function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4_294_967_296;
  };
}

const pairKey = (customer: string, meter: string) => `${customer}\u0000${meter}`;
const fmt = (n: number) => n.toLocaleString('en-US');
const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

// ---- the traffic ----------------------------------------------------------------------------------

interface UsageBody {
  tenant_id: string;
  usage_id: string;
  quantity: number;
  event_name: string;
  occurred_at: string;
}

interface Traffic {
  /** New usage answered 201, by usage_id. */
  accepted: Map<string, UsageBody>;
  resent: number;
  /** Re-sends answered 200 with created: false. */
  resentOk: number;
  unexpected: string[];
  submitted: number;
  total: number;
}

interface Outage {
  atSubmission: number;
  seconds: number;
  startedAt?: number;
  endedAt?: number;
}

/** What one stream looks like: which submissions are new usage and which re-send an earlier one. */
function plan(events: number): ('new' | 'resend')[] {
  const resends = Math.max(1, Math.round(events * RESEND_SHARE));
  const every = Math.max(2, Math.floor(events / resends));
  const kinds: ('new' | 'resend')[] = [];
  let added = 0;
  for (let i = 1; i <= events; i++) {
    kinds.push('new');
    // Not in the first few: a re-send repeats usage that has already been answered.
    if (i >= 10 && i % every === 0 && added < resends) {
      kinds.push('resend');
      added++;
    }
  }
  return kinds;
}

function newUsage(rand: () => number, runId: string, n: number): UsageBody {
  const weights = TENANT_WEIGHTS.reduce((s, [, w]) => s + w, 0);
  let pick = rand() * weights;
  let tenant = TENANT_WEIGHTS[0]![0];
  for (const [t, w] of TENANT_WEIGHTS) {
    if ((pick -= w) < 0) {
      tenant = t;
      break;
    }
  }
  const tokens = rand() < 0.35;
  // API calls are mostly one at a time, sometimes a batch; token counts are long-tailed.
  const quantity = tokens ? 50 + Math.floor(rand() ** 2 * 8_000) : rand() < 0.7 ? 1 : 2 + Math.floor(rand() * 49);
  return {
    tenant_id: tenant,
    usage_id: `${tokens ? 'job' : 'req'}_${runId}_${String(n).padStart(6, '0')}`,
    quantity,
    event_name: tokens ? 'tokens' : 'api_requests',
    // Usage happened a moment before it is reported, as in an application that records it at the end of the work.
    occurred_at: new Date(Date.now() - Math.floor(rand() * 20_000)).toISOString(),
  };
}

/** Sends the planned stream at `rate` per second from SENDERS clients, tallying answers in `traffic` as they come. */
async function sendTraffic(args: {
  stack: Stack;
  token: string;
  kinds: readonly ('new' | 'resend')[];
  traffic: Traffic;
  seed: number;
  rate: number;
  outage: Outage | undefined;
  out: Output;
  signal: AbortSignal;
}): Promise<void> {
  const { stack, token, kinds, traffic, rate, outage, out, signal } = args;
  const rand = seededRandom(args.seed);
  const runId = randomBytes(4).toString('hex');
  const answered: UsageBody[] = [];
  let created = 0;
  let next = 0;
  const startedAt = Date.now();
  const interval = 1000 / rate;

  const post = async (body: UsageBody): Promise<{ status: number; created: boolean | undefined; error: string | undefined }> => {
    const res = await fetch(`${stack.apiUrl}/v1/usage`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify(body),
      signal,
    });
    const json = (await res.json().catch(() => ({}))) as { created?: boolean; error?: { code?: string; message?: string } };
    return { status: res.status, created: json.created, error: json.error ? `${json.error.code}: ${json.error.message}` : undefined };
  };

  const sender = async () => {
    for (;;) {
      const k = next++;
      if (k >= kinds.length) return;
      const due = startedAt + k * interval;
      if (due > Date.now()) await sleep(due - Date.now(), signal);
      if (outage && k === outage.atSubmission && stack.localStripe) {
        stack.localStripe.refuseFor(outage.seconds);
        outage.startedAt = Date.now();
        out.line(`  ▼ Stripe is DOWN: every connection refused for ${outage.seconds} s (after ${fmt(k)} submissions)`);
        setTimeout(() => {
          outage.endedAt = Date.now();
          if (!signal.aborted) out.line(`  ▲ Stripe is back after ${outage.seconds} s; the retries go through`);
        }, outage.seconds * 1000).unref();
      }
      if (kinds[k] === 'new') {
        const body = newUsage(rand, runId, ++created);
        const r = await post(body);
        if (r.status === 201 && r.created === true) {
          traffic.accepted.set(body.usage_id, body);
          answered.push(body);
        } else {
          traffic.unexpected.push(`new ${body.usage_id}: HTTP ${r.status}${r.error ? ` ${r.error}` : ''}`);
        }
      } else {
        while (answered.length === 0) await sleep(20, signal);
        const body = answered[Math.floor(rand() * answered.length)]!;
        traffic.resent++;
        const r = await post(body);
        if (r.status === 200 && r.created === false) traffic.resentOk++;
        else traffic.unexpected.push(`re-sent ${body.usage_id}: HTTP ${r.status}${r.error ? ` ${r.error}` : ''} (expected 200)`);
      }
      traffic.submitted++;
    }
  };
  await Promise.all(Array.from({ length: SENDERS }, sender));
}

/** Prints the live line once a second until stopped. */
function startTicker(stack: Stack, out: Output, traffic: Traffic, outageState: () => string) {
  const stop = new AbortController();
  const t0 = Date.now();
  let last = { at: Date.now(), sent: 0 };
  let latest: Progress | undefined;
  const loop = (async () => {
    while (!stop.signal.aborted) {
      await sleep(1000, stop.signal).catch(() => undefined);
      if (stop.signal.aborted) break;
      const p = await countProgress(stack.pool).catch(() => undefined);
      if (!p) continue;
      latest = p;
      const now = Date.now();
      const perSecond = ((p.sent - last.sent) * 1000) / Math.max(1, now - last.at);
      last = { at: now, sent: p.sent };
      const { submitted, total } = traffic;
      out.status(
        `  ${seconds(now - t0).padStart(6)}  submitted ${fmt(submitted)}/${fmt(total)}  enqueued ${fmt(p.enqueued)}  ` +
          `sent ${fmt(p.sent)}  retrying ${fmt(p.retrying)}  dead ${fmt(p.dead)}  ${perSecond.toFixed(1)} sent/s${outageState()}`,
      );
    }
  })();
  return {
    latest: () => latest,
    async stop() {
      if (stop.signal.aborted) return;
      stop.abort();
      await loop;
      out.endStatus();
    },
  };
}

async function waitForDrain(stack: Stack, expected: number, timeoutMs: number, signal: AbortSignal): Promise<boolean> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    const p = await countProgress(stack.pool);
    if (p.enqueued >= expected && p.waiting + p.inFlight + p.retrying === 0) return true;
    await sleep(250, signal);
  }
  return false;
}

// ---- against a real Stripe account ----------------------------------------------------------------

/**
 * Makes the account ready for the stream: the two meters must exist (the demo does not create
 * meters in your account: they cannot be deleted), and one customer per demo tenant is found by
 * its email or created once, then mapped in billing_customers.
 */
async function prepareStripeAccount(stripe: Stripe, db: Queryable): Promise<Record<string, string>> {
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
  for (const [tenant] of TENANT_WEIGHTS) {
    const email = `billing-outbox-demo+${tenant}@example.com`;
    const found = await stripe.customers.list({ email, limit: 10 });
    const customer =
      found.data.find((c) => c.email === email) ??
      (await stripe.customers.create({ name: `billing-outbox demo: ${tenant}`, email, metadata: { billing_outbox_demo: tenant } }));
    await upsertBillingCustomer(db, tenant, customer.id);
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

async function temporalCount(stack: Stack, query: string): Promise<number> {
  return (await stack.client.workflow.count(query)).count;
}

async function runChecks(args: {
  stack: Stack;
  traffic: Traffic;
  customers: Record<string, string>;
  outage: Outage | undefined;
  drained: boolean;
  out: Output;
}): Promise<Check[]> {
  const { stack, traffic, customers, outage, drained, out } = args;
  const checks: Check[] = [];
  const accepted = traffic.accepted.size;
  const newSubmissions = traffic.total - traffic.resent;
  const newProblems = traffic.unexpected.filter((u) => u.startsWith('new ')).length;

  checks.push(check(accepted === newSubmissions && newProblems === 0, `API: ${fmt(accepted)} of ${fmt(newSubmissions)} new usage events answered 201 Created`));
  checks.push(
    check(
      traffic.resent > 0 && traffic.resentOk === traffic.resent,
      `API: ${fmt(traffic.resentOk)} of ${fmt(traffic.resent)} re-sent usage_ids answered 200 (already recorded), not 201`,
    ),
  );
  for (const u of traffic.unexpected.slice(0, 5)) out.line(`        unexpected answer: ${u}`);

  const [usageRows, outbox, totals] = await Promise.all([countUsageRows(stack.pool), listOutboxRows(stack.pool), usageTotals(stack.pool)]);
  checks.push(
    check(
      usageRows === accepted && outbox.length === accepted,
      `PostgreSQL: ${fmt(usageRows)} usage rows and ${fmt(outbox.length)} outbox rows for ${fmt(accepted)} new usage events (none for the re-sends)`,
    ),
  );
  const byStatus = (s: string) => outbox.filter((r) => r.status === s).length;
  const sent = byStatus('sent');
  const dead = byStatus('dead');
  checks.push(
    check(
      drained && sent === outbox.length && dead === 0,
      `Outbox: ${fmt(sent)} of ${fmt(outbox.length)} rows sent, ${fmt(dead)} dead letters${drained ? '' : ' (did not drain in time)'}`,
    ),
  );

  // The client's own ledger of what it was told was recorded, per Stripe customer and meter.
  const clientTotals = new Map<string, number>();
  for (const u of traffic.accepted.values()) {
    const key = pairKey(customers[u.tenant_id] ?? `(${u.tenant_id})`, u.event_name);
    clientTotals.set(key, (clientTotals.get(key) ?? 0) + u.quantity);
  }
  const dbTotals = new Map(totals.map((t) => [pairKey(t.customer, t.event_name), t.quantity]));
  const sameTotals = (a: Map<string, number>, b: Map<string, number>) => a.size === b.size && [...a].every(([k, v]) => b.get(k) === v);
  checks.push(
    check(
      sameTotals(clientTotals, dbTotals),
      `PostgreSQL: usage sums per (customer, meter) equal what the API acknowledged (${dbTotals.size} pairs)`,
    ),
  );

  const stripeTotals = new Map<string, number>();
  if (stack.localStripe) {
    const events = stack.localStripe.events().filter((e) => !e.cancelled);
    const seen = new Map<string, number>();
    for (const e of events) seen.set(e.identifier, (seen.get(e.identifier) ?? 0) + 1);
    const keys = new Set(outbox.map((r) => r.idempotency_key));
    const missing = [...keys].filter((k) => !seen.has(k)).length;
    const twice = [...seen.values()].filter((n) => n > 1).length;
    const unknown = [...seen.keys()].filter((k) => !keys.has(k)).length;
    checks.push(
      check(
        missing === 0 && twice === 0 && unknown === 0 && keys.size > 0,
        `Stripe: each of ${fmt(keys.size)} idempotency keys recorded exactly once as identifier ` +
          `(${missing} missing, ${twice} twice, ${unknown} not in the outbox)`,
      ),
    );
    for (const e of events) stripeTotals.set(pairKey(e.customer, e.eventName), (stripeTotals.get(pairKey(e.customer, e.eventName)) ?? 0) + e.value);
    const pairsEqual = [...dbTotals].filter(([k, v]) => stripeTotals.get(k) === v).length;
    checks.push(
      check(
        sameTotals(dbTotals, stripeTotals),
        `Stripe: totals per (customer, meter) equal the usage sums (${pairsEqual} of ${dbTotals.size} pairs)`,
      ),
    );
    if (outage) {
      // Every attempt is counted on its row before the call; the local Stripe logs every call that
      // reached it. The difference is the calls the outage cut off.
      const attempts = outbox.reduce((s, r) => s + r.attempt_count, 0);
      const cutOff = attempts - stack.localStripe.requests().length;
      const retried = outbox.filter((r) => r.attempt_count > 1);
      const most = retried.reduce((m, r) => Math.max(m, r.attempt_count), 0);
      checks.push(
        check(
          cutOff > 0 && retried.length > 0,
          `Outage: ${fmt(cutOff)} attempts cut off while Stripe was down; ${fmt(retried.length)} events needed more than one attempt ` +
            `(up to ${most}), each billed once`,
        ),
      );
    }
  } else {
    checks.push({
      verdict: 'SKIP',
      text: "Stripe: what Stripe recorded is not read back here; checking it is reconciliation against the meters' event summaries (not implemented in this demo)",
    });
  }

  // The queries the demo tells you to use find the same thing.
  let sentInTemporal = -1;
  let deadInTemporal = -1;
  const until = Date.now() + 15_000;
  try {
    // Visibility trails the workflows by a moment.
    do {
      [sentInTemporal, deadInTemporal] = await Promise.all([temporalCount(stack, 'WorkflowType="usageWorkflow" AND ExecutionStatus="Completed"'), temporalCount(stack, 'OutboxStatus="dead"')]);
      if (sentInTemporal === sent && deadInTemporal === dead) break;
      await new Promise((r) => setTimeout(r, 250));
    } while (Date.now() < until);
    checks.push(
      check(
        sentInTemporal === sent && deadInTemporal === 0,
        `Temporal: completed usage workflows ${fmt(sentInTemporal)} (each one a delivered event), OutboxStatus="dead" finds ${fmt(deadInTemporal)}`,
      ),
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

  printTotals(out, dbTotals, stack.localStripe ? stripeTotals : undefined, totals);
  return checks;
}

function printTotals(out: Output, dbTotals: Map<string, number>, stripeTotals: Map<string, number> | undefined, rows: UsageTotal[]): void {
  out.line();
  out.line(`  ${'customer'.padEnd(22)}${'meter'.padEnd(14)}${'events'.padStart(8)}${'usage sum'.padStart(14)}${stripeTotals ? 'Stripe sum'.padStart(14) : ''}`);
  for (const r of rows) {
    const key = pairKey(r.customer, r.event_name);
    const stripe = stripeTotals ? stripeTotals.get(key) ?? 0 : undefined;
    const mark = stripe === undefined ? '' : stripe === dbTotals.get(key) ? '  ✓' : '  ✗';
    out.line(
      `  ${r.customer.padEnd(22)}${r.event_name.padEnd(14)}${fmt(r.events).padStart(8)}${fmt(r.quantity).padStart(14)}` +
        `${stripe === undefined ? '' : fmt(stripe).padStart(14)}${mark}`,
    );
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
  const token: ApiToken = { name: 'demo', token: randomBytes(32).toString('base64url'), tenants: TENANT_WEIGHTS.map(([t]) => t), scopes: ['usage:write'] };

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
    const customers = external ? await prepareStripeAccount(stack.stripe, stack.pool) : { ...DEMO_CUSTOMERS };
    await writeFile(path.join(dataDir, 'endpoints.json'), JSON.stringify({ databaseUrl: stack.databaseUrl, temporalAddress: stack.temporalAddress }, null, 2), {
      mode: 0o600,
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

    const kinds = plan(opts.events);
    const traffic: Traffic = { accepted: new Map(), resent: 0, resentOk: 0, unexpected: [], submitted: 0, total: kinds.length };
    const outage: Outage | undefined = stack.localStripe ? { atSubmission: Math.floor(kinds.length / 4), seconds: opts.short ? 4 : 8 } : undefined;
    out.line();
    out.line(
      `  Sending ${fmt(opts.events)} usage events (${METERS.join(' and ')}) plus ${kinds.length - opts.events} re-sends of earlier usage_ids, ` +
        `${rate}/s from ${SENDERS} concurrent clients (seed ${opts.seed})`,
    );
    out.line(
      outage
        ? `  Stripe goes down for ${outage.seconds} s after ${fmt(outage.atSubmission)} submissions. Retries: ` +
            `${config.retry.initialIntervalMs} ms doubling to ${config.retry.maximumIntervalMs / 1000} s, up to ${config.retry.maximumAttempts} attempts.`
        : '  No outage: a real Stripe cannot be taken down from here.',
    );
    out.line();

    const sendingFrom = Date.now();
    const sending = sendTraffic({ stack, token: token.token, kinds, traffic, seed: opts.seed, rate, outage, out, signal: interrupt.signal });
    const ticker = startTicker(stack, out, traffic, () => (outage?.startedAt && !outage.endedAt ? '  [Stripe DOWN]' : ''));
    try {
      await Promise.race([sending, stack.workerDone.then(() => Promise.reject(new Error('the worker stopped unexpectedly')))]);
      out.line(`  All ${fmt(traffic.submitted)} submissions answered in ${seconds(Date.now() - sendingFrom)}; waiting for the outbox to drain…`);
      const drained = await waitForDrain(stack, traffic.accepted.size, opts.short ? 40_000 : 120_000, interrupt.signal);
      await ticker.stop();
      const p = await countProgress(stack.pool);
      out.line(`  ${drained ? 'Drained' : 'NOT drained'} ${seconds(Date.now() - sendingFrom)} after the first submission: sent ${fmt(p.sent)}, dead ${fmt(p.dead)}, still in flight ${fmt(p.waiting + p.inFlight + p.retrying)}.`);

      out.line();
      out.line(stack.localStripe ? 'Self-check against what the local Stripe recorded' : 'Self-check (through the outbox)');
      const checks = await runChecks({ stack, traffic, customers, outage, drained, out });
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
  out.line(`  The outbox (SQL): psql "$(node -p "require('${endpoints}').databaseUrl")"`);
  out.line(`                    SELECT status, count(*), max(attempt_count) FROM outbox GROUP BY status;`);
  out.line(`                    SELECT idempotency_key, tenant_id, attempt_count, last_error_code, last_error_message FROM outbox WHERE status = 'dead';`);
  if (stack.localStripe) out.line(`  Local Stripe:     ${stack.localStripe.url}/_local/events  (every meter event it recorded)`);
}
