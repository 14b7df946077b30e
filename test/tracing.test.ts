/**
 * One OpenTelemetry trace per event (src/tracing.ts), on the real pipeline: PostgreSQL, the
 * shared Temporal dev server, the local Stripe. The file registers an SDK of its own (as an
 * application does) exporting into memory; the worker runs Temporal's OpenTelemetry interceptors.
 */
import { context, propagation, SpanKind, SpanStatusCode, trace } from '@opentelemetry/api';
import type { ReadableSpan } from '@opentelemetry/sdk-trace-base';
import { temporal } from '@temporalio/proto';
import { Worker } from '@temporalio/worker';
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { buildApi } from '../src/api/index.js';
import type { ApiToken } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { createLogger } from '../src/log.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { IDEMPOTENCY_KEY_ATTRIBUTE, temporalTracing } from '../src/tracing.js';
import { refusedForGood, tracingWorkflowBundle, usePipeline, waitFor } from './hooks.js';
import { useInMemoryTracing } from './in-memory-tracing.js';

// Before the fixture: the worker's interceptors read the registered SDK.
const { exporter, spanProcessor, resource } = useInMemoryTracing();

const t = usePipeline({
  // Every call for 'ghost' is refused (a 400): its events die at once.
  customers: { acme: 'cus_acme', ghost: 'cus_ghost' },
  stripe: { meters: ['api_requests'], refuseCustomers: { cus_ghost: refusedForGood('cus_ghost') } },
  tracing: { spanProcessor, resource },
});

/** Records one usage inside an application span (as an HTTP server's would be); returns its trace id and the key. */
async function recordInAppSpan(tenantId: string, usageId: string): Promise<{ traceId: string; spanId: string; key: string }> {
  return trace.getTracer('the-application').startActiveSpan('POST /orders', { kind: SpanKind.SERVER }, async (span) => {
    try {
      const { entry } = await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId, quantity: 3 }));
      return { traceId: span.spanContext().traceId, spanId: span.spanContext().spanId, key: entry.idempotencyKey };
    } finally {
      span.end();
    }
  });
}

const spansOf = (traceId: string) => exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === traceId);
const named = (spans: ReadableSpan[], name: string) => spans.filter((s) => s.name === name);
const parentOf = (span: ReadableSpan, spans: ReadableSpan[]) => spans.find((s) => s.spanContext().spanId === span.parentSpanId);

describe('one trace per event', () => {
  it('follows a delivered event from the application span to the Stripe call, under one trace id', async () => {
    const app = await recordInAppSpan('acme', 'traced-sent');
    expect((await t.row(app.key))!.trace_parent).toBe(`00-${app.traceId}-${app.spanId}-01`);
    await t.waitStatus(app.key, 'sent');

    // The workflow's spans leave the sandbox when its run completes.
    const spans = await waitFor('the workflow span', async () => {
      const s = spansOf(app.traceId);
      return named(s, 'RunWorkflow:usageWorkflow').length > 0 && s;
    });
    const stripe = named(spans, 'stripe POST /v1/billing/meter_events');
    expect(stripe).toHaveLength(1);
    expect(stripe[0]!.attributes).toMatchObject({ [IDEMPOTENCY_KEY_ATTRIBUTE]: app.key, 'http.response.status_code': 200 });
    expect(stripe[0]!.status.code).not.toBe(SpanStatusCode.ERROR);

    // The chain: app span → relay's start → Temporal's start → the run → its activity → Stripe.
    const start = named(spans, 'billing_outbox.start');
    expect(start).toHaveLength(1);
    expect(start[0]!.parentSpanId).toBe(app.spanId);
    expect(start[0]!.attributes[IDEMPOTENCY_KEY_ATTRIBUTE]).toBe(app.key);
    const chain: string[] = [];
    for (let s: ReadableSpan | undefined = stripe[0]; s; s = parentOf(s, spans)) chain.unshift(s.name);
    expect(chain).toEqual([
      'POST /orders',
      'billing_outbox.start',
      'StartWorkflow:usageWorkflow',
      'RunWorkflow:usageWorkflow',
      'StartActivity:deliverUsage',
      'RunActivity:deliverUsage',
      'stripe POST /v1/billing/meter_events',
    ]);
  });

  it('marks the dead-letter path as an error, in the event’s trace', async () => {
    const app = await recordInAppSpan('ghost', 'traced-dead');
    await t.waitStatus(app.key, 'dead');
    const spans = await waitFor('the dead letter span', async () => {
      const s = spansOf(app.traceId);
      return named(s, 'billing_outbox.dead_letter').length > 0 && s;
    });
    const stripe = named(spans, 'stripe POST /v1/billing/meter_events');
    expect(stripe).toHaveLength(1);
    expect(stripe[0]!.status.code).toBe(SpanStatusCode.ERROR);
    expect(stripe[0]!.attributes).toMatchObject({ [IDEMPOTENCY_KEY_ATTRIBUTE]: app.key, 'http.response.status_code': 400, 'billing_outbox.stripe_error_code': 'resource_missing' });
    const dead = named(spans, 'billing_outbox.dead_letter')[0]!;
    expect(dead.status).toMatchObject({ code: SpanStatusCode.ERROR, message: expect.stringContaining('resource_missing') });
    expect(dead.attributes[IDEMPOTENCY_KEY_ATTRIBUTE]).toBe(app.key);
  });

  it('begins the trace at POST /v1/usage, under the caller’s traceparent header', async () => {
    const writer: ApiToken = { name: 'writer', token: 'tok_'.padEnd(40, 'w'), tenants: ['*'], scopes: ['usage:write'] };
    const api = buildApi({ config: t.configWith({ API_TOKENS: JSON.stringify([writer]) }), db: t.pool, log: createLogger('silent') });
    try {
      // The calling service's span, sent as W3C headers as its HTTP client would send them.
      const caller = trace.getTracer('the-caller').startSpan('checkout', { kind: SpanKind.CLIENT });
      const headers: Record<string, string> = {};
      propagation.inject(trace.setSpan(context.active(), caller), headers);
      const res = await api.inject({
        method: 'POST',
        url: '/v1/usage',
        headers: { ...headers, authorization: `Bearer ${writer.token}`, 'content-type': 'application/json' },
        payload: { tenant_id: 'acme', usage_id: 'traced-http', quantity: 2 },
      });
      caller.end();
      expect(res.statusCode).toBe(201);
      const key = (res.json() as { idempotency_key: string }).idempotency_key;
      const traceId = caller.spanContext().traceId;
      expect((await t.row(key))!.trace_parent).toMatch(new RegExp(`^00-${traceId}-`));
      await t.waitStatus(key, 'sent');
      const spans = await waitFor('the Stripe span', async () => {
        const s = spansOf(traceId);
        return named(s, 'RunWorkflow:usageWorkflow').length > 0 && s;
      });
      const request = named(spans, 'POST /v1/usage');
      expect(request).toHaveLength(1);
      expect(request[0]!.parentSpanId).toBe(caller.spanContext().spanId);
      expect(request[0]!.attributes).toMatchObject({ [IDEMPOTENCY_KEY_ATTRIBUTE]: key, 'http.response.status_code': 201 });
      const stripe = named(spans, 'stripe POST /v1/billing/meter_events');
      expect(stripe[0]!.attributes[IDEMPOTENCY_KEY_ATTRIBUTE]).toBe(key);
      expect(named(spans, 'billing_outbox.start')[0]!.parentSpanId).toBe(request[0]!.spanContext().spanId);
    } finally {
      await api.close();
    }
  });

  it('starts a trace of its own for an event recorded outside any span, and stores no context with it', async () => {
    const { entry } = await withTransaction(t.pool, (c) => recordUsage(c, { usageId: 'untraced', tenantId: 'acme', quantity: 1 }));
    expect((await t.row(entry.idempotencyKey))!.trace_parent).toBeNull();
    await t.waitStatus(entry.idempotencyKey, 'sent');
    const stripe = await waitFor('the Stripe span', async () =>
      exporter.getFinishedSpans().find((s) => s.name === 'stripe POST /v1/billing/meter_events' && s.attributes[IDEMPOTENCY_KEY_ATTRIBUTE] === entry.idempotencyKey),
    );
    const start = spansOf(stripe.spanContext().traceId).find((s) => s.name === 'billing_outbox.start');
    // Its own root: not a child of the relay's long-running activity, whose trace would hold every event.
    expect(start?.parentSpanId).toBeUndefined();
  });
});

/**
 * In a process of its own (this file's has an SDK registered): importing the library and the
 * worker, and `startTracingSdk` with no endpoint, load no SDK and register nothing; with one, the
 * spans reach the collector over OTLP/HTTP.
 */
const CHILD = `
import { createRequire } from 'node:module';
import { trace } from '@opentelemetry/api';
const cache = createRequire(import.meta.url).cache;
const sdk = () => Object.keys(cache).filter((p) => /@opentelemetry[\\\\/](sdk-trace|exporter|resources)|interceptors-opentelemetry/.test(p)).length;
const registered = () => globalThis[Symbol.for('opentelemetry.js.api.1')] !== undefined;
await import('./src/index.ts');
await import('./src/worker.ts');
const { startTracingSdk } = await import('./src/tracing.ts');
const off = await startTracingSdk({ otlpEndpoint: undefined, serviceName: 'billing-outbox' });
const before = { started: off !== undefined, sdk: sdk(), registered: registered() };
const on = await startTracingSdk({ otlpEndpoint: process.env.COLLECTOR, serviceName: 'billing-east' });
trace.getTracer('child').startSpan('exported').end();
await on.shutdown();
console.log(JSON.stringify({ before, after: { sdk: sdk() > 0 } }));
`;

describe('tracing off and on (src/tracing.ts startTracingSdk)', () => {
  it('off: no SDK loaded, nothing registered; on: spans reach the OTLP endpoint, under OTEL_SERVICE_NAME', async () => {
    const received: { url: string | undefined; body: Buffer }[] = [];
    const collector = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => chunks.push(c));
      req.on('end', () => {
        received.push({ url: req.url, body: Buffer.concat(chunks) });
        res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
      });
    });
    await new Promise<void>((resolve) => collector.listen(0, '127.0.0.1', resolve));
    try {
      const { port } = collector.address() as AddressInfo;
      const { stdout } = await promisify(execFile)(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', CHILD], {
        cwd: path.join(import.meta.dirname, '..'),
        env: { ...process.env, COLLECTOR: `http://127.0.0.1:${port}` },
      });
      expect(JSON.parse(stdout.trim().split('\n').at(-1)!)).toEqual({ before: { started: false, sdk: 0, registered: false }, after: { sdk: true } });
      expect(received.map((r) => r.url)).toContain('/v1/traces');
      const body = Buffer.concat(received.map((r) => r.body)).toString('latin1');
      expect(body).toContain('exported');
      expect(body).toContain('billing-east');
    } finally {
      collector.close();
    }
  });
});

it('a worker with tracing on replays a dead letter whose run began without it (turning tracing on breaks no open run)', async () => {
  const history = temporal.api.history.v1.History.decode(readFileSync(path.join(import.meta.dirname, 'fixtures', 'usage-dead-letter.pb')));
  const { sinks } = await temporalTracing({ spanProcessor, resource });
  await expect(Worker.runReplayHistory({ workflowBundle: await tracingWorkflowBundle(), sinks }, history, 'u:fixture:dead-letter')).resolves.toBeUndefined();
});
