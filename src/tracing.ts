/**
 * One OpenTelemetry trace per event: the application's request (its active span around
 * recordUsage), the outbox row, the relay's start of the usage workflow, the workflow and its
 * delivery activity, and the Stripe call.
 *
 * Off unless OTEL_EXPORTER_OTLP_ENDPOINT is set, and off costs nothing: this module imports only
 * `@opentelemetry/api`, whose calls are no-ops until a process registers an SDK, and registers
 * nothing itself. The SDK and Temporal's OpenTelemetry interceptors are loaded by `startTracingSdk`
 * and `temporalTracing` only, which an entry point calls when tracing is on.
 *
 * Inside Temporal the context travels in Temporal's headers, by `@temporalio/interceptors-opentelemetry`.
 * Across the commit it travels in the outbox row (`trace_parent`, W3C traceparent text), since the
 * relay claims the row later, in another process.
 */
import { context, isSpanContextValid, propagation, ROOT_CONTEXT, SpanKind, SpanStatusCode, trace, TraceFlags, type Context, type Span, type Tracer } from '@opentelemetry/api';
import type { Resource } from '@opentelemetry/resources';
import type { SpanProcessor } from '@opentelemetry/sdk-trace-base';
import type { WorkflowClientInterceptor } from '@temporalio/client';
import type { WorkerOptions } from '@temporalio/worker';
import { createRequire } from 'node:module';
import type { Config } from './config.js';
import { loadPart } from './optional-peers.js';

/** The instrumentation scope of billing-outbox's own spans. */
export const TRACER_NAME = 'billing-outbox';

/** The span attribute that names the event on every billing-outbox span. */
export const IDEMPOTENCY_KEY_ATTRIBUTE = 'billing_outbox.idempotency_key';

/** The process's tracer as the application registered it (a no-op one when none is). */
export function tracer(): Tracer {
  return trace.getTracer(TRACER_NAME);
}

// W3C Trace Context, version 00: https://www.w3.org/TR/trace-context/#traceparent-header-field-values
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/**
 * The caller's active span as W3C traceparent text, for the outbox row; undefined outside a
 * (valid) span. Written by hand rather than through a propagator: a propagator is the SDK's, and
 * recordUsage runs in applications that have none.
 */
export function activeTraceParent(): string | undefined {
  const span = trace.getActiveSpan()?.spanContext();
  if (!span || !isSpanContextValid(span)) return undefined;
  const flags = (span.traceFlags & TraceFlags.SAMPLED) === TraceFlags.SAMPLED ? '01' : '00';
  return `00-${span.traceId}-${span.spanId}-${flags}`;
}

/** The context whose parent is the row's stored span; undefined for null or unreadable text. */
export function contextOfTraceParent(traceParent: string | null | undefined): Context | undefined {
  const m = traceParent ? TRACEPARENT.exec(traceParent) : null;
  if (!m) return undefined;
  const spanContext = { traceId: m[1]!, spanId: m[2]!, traceFlags: parseInt(m[3]!, 16) & TraceFlags.SAMPLED, isRemote: true };
  return isSpanContextValid(spanContext) ? trace.setSpanContext(ROOT_CONTEXT, spanContext) : undefined;
}

/**
 * Runs `fn` in a span of the event's own trace: the row's stored context as parent, or a new trace
 * when the row has none. Never the caller's active span (a relay's activity runs for minutes and
 * claims thousands of rows: under it, every event would share one trace).
 */
export function inEventTrace<T>(name: string, key: string, traceParent: string | null | undefined, fn: (span: Span) => Promise<T>): Promise<T> {
  const parent = contextOfTraceParent(traceParent);
  return tracer().startActiveSpan(name, { root: !parent, attributes: { [IDEMPOTENCY_KEY_ATTRIBUTE]: key } }, parent ?? ROOT_CONTEXT, (span) =>
    endSpan(span, fn(span)),
  );
}

/**
 * Runs `fn` (an HTTP request's work) in a server span: under the caller's active span when there
 * is one (an application whose SDK instruments its HTTP server), else under the trace the request's
 * `traceparent` header names (extracted by the registered propagator; none registered, none
 * extracted). recordUsage inside it stores this span's context with the row.
 */
export function inRequestSpan<T>(name: string, headers: Record<string, unknown>, key: string, fn: (span: Span) => Promise<T>): Promise<T> {
  const active = context.active();
  const parent = trace.getSpan(active) ? active : propagation.extract(active, headers);
  return tracer().startActiveSpan(name, { kind: SpanKind.SERVER, attributes: { [IDEMPOTENCY_KEY_ATTRIBUTE]: key } }, parent, (span) => endSpan(span, fn(span)));
}

/** Ends `span` when `work` settles: ERROR with the message when it rejects. */
export async function endSpan<T>(span: Span, work: Promise<T>): Promise<T> {
  try {
    return await work;
  } catch (err) {
    span.setStatus({ code: SpanStatusCode.ERROR, message: err instanceof Error ? err.message : String(err) });
    if (err instanceof Error) span.recordException(err);
    throw err;
  } finally {
    span.end();
  }
}

/** Where the workflows' spans go: the sandbox hands them to the worker through a sink. */
export interface Tracing {
  spanProcessor: SpanProcessor;
  resource: Resource;
}

/** A running SDK: the tracing a worker needs, and how to flush and unregister it. */
export interface TracingSdk {
  tracing: Tracing;
  shutdown(): Promise<void>;
}

/**
 * Registers the OpenTelemetry SDK for this process (tracer provider, async context, W3C
 * propagation) exporting over OTLP/HTTP to `otlpEndpoint`, or returns undefined when it is unset.
 * For billing-outbox's own entry points; an application that runs a worker inside its own process
 * and has an SDK already passes its own `Tracing` instead. Registration is process-wide by
 * OpenTelemetry's design (Temporal's interceptors read the global API); `shutdown` undoes it.
 */
export async function startTracingSdk(config: Config['tracing']): Promise<TracingSdk | undefined> {
  const endpoint = config.otlpEndpoint;
  if (!endpoint) return undefined;
  const [{ NodeTracerProvider, BatchSpanProcessor }, { OTLPTraceExporter }, { Resource }] = await loadPart('tracing', () =>
    Promise.all([import('@opentelemetry/sdk-trace-node'), import('@opentelemetry/exporter-trace-otlp-http'), import('@opentelemetry/resources')]),
  );
  const resource = new Resource({ 'service.name': config.serviceName });
  const spanProcessor = new BatchSpanProcessor(new OTLPTraceExporter({ url: `${endpoint}/v1/traces` }));
  const provider = new NodeTracerProvider({ resource, spanProcessors: [spanProcessor] });
  provider.register();
  return {
    tracing: { spanProcessor, resource },
    async shutdown() {
      await provider.shutdown();
      trace.disable();
      context.disable();
    },
  };
}

/** The module of Temporal's workflow interceptors, for the bundler (`workflowInterceptorModules`). */
export function workflowTracingModule(): string {
  return createRequire(import.meta.url).resolve('@temporalio/interceptors-opentelemetry/lib/workflow-interceptors');
}

const loadInterceptors = () => loadPart('tracing', () => import('@temporalio/interceptors-opentelemetry'));

/** The interceptor that carries the caller's trace into what a Temporal client starts or signals. */
export async function workflowClientTracing(): Promise<WorkflowClientInterceptor[]> {
  return [new (await loadInterceptors()).OpenTelemetryWorkflowClientInterceptor()];
}

/** Temporal's OpenTelemetry interceptors and sink, for a worker and its clients (loaded only when tracing is on). */
export async function temporalTracing(tracing: Tracing): Promise<{
  client: WorkflowClientInterceptor[];
  activity: NonNullable<NonNullable<WorkerOptions['interceptors']>['activity']>;
  sinks: NonNullable<WorkerOptions['sinks']>;
}> {
  const otel = await loadInterceptors();
  return {
    client: [new otel.OpenTelemetryWorkflowClientInterceptor()],
    activity: [(ctx) => ({ inbound: new otel.OpenTelemetryActivityInboundInterceptor(ctx), outbound: new otel.OpenTelemetryActivityOutboundInterceptor(ctx) })],
    sinks: { exporter: otel.makeWorkflowExporter(tracing.spanProcessor, tracing.resource) },
  };
}

/**
 * Runs `fn` (the bookkeeping that makes the row a dead letter) in a span whose status is ERROR,
 * with Stripe's (or Temporal's) code: a trace backend's error filter finds the event without
 * reading the row. Its own span because the activity's span ends OK, the activity having done its work.
 */
export function inDeadLetterSpan<T>(dead: { key: string; code: string; message: string }, fn: () => Promise<T>): Promise<T> {
  return tracer().startActiveSpan(
    'billing_outbox.dead_letter',
    { attributes: { [IDEMPOTENCY_KEY_ATTRIBUTE]: dead.key, 'billing_outbox.error_code': dead.code } },
    (span) => {
      span.setStatus({ code: SpanStatusCode.ERROR, message: `${dead.code}: ${dead.message}` });
      return endSpan(span, fn());
    },
  );
}
