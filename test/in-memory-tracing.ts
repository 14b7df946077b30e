/**
 * An OpenTelemetry SDK registered for one test file, as an application registers its own,
 * exporting into memory: registered before the file's tests (and before fixtures declared after
 * this call, whose workers' interceptors read the registered SDK), unregistered after them.
 */
import { context, propagation, trace } from '@opentelemetry/api';
import { Resource } from '@opentelemetry/resources';
import { InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { NodeTracerProvider } from '@opentelemetry/sdk-trace-node';
import { afterAll, beforeAll } from 'vitest';

export function useInMemoryTracing(serviceName = 'billing-outbox-test'): { exporter: InMemorySpanExporter; spanProcessor: SimpleSpanProcessor; resource: Resource } {
  const exporter = new InMemorySpanExporter();
  const spanProcessor = new SimpleSpanProcessor(exporter);
  const resource = new Resource({ 'service.name': serviceName });
  const provider = new NodeTracerProvider({ resource, spanProcessors: [spanProcessor] });
  beforeAll(() => {
    provider.register();
  });
  afterAll(async () => {
    await provider.shutdown();
    trace.disable();
    context.disable();
    propagation.disable();
  });
  return { exporter, spanProcessor, resource };
}
