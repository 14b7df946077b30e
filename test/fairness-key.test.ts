/**
 * Temporal's task queue fairness: each usage run carries its tenant as fairness key, so the dev
 * server (started with `matching.enableFairness`) dispatches one tenant's backlog in turn with the
 * others'. Read back from Temporal itself (`describe`), on the real dev server.
 */
import { describe, expect, it } from 'vitest';
import { fairnessKeyFor, MAX_FAIRNESS_KEY_BYTES } from '../src/temporal/start-usage.js';
import { usePipeline, waitFor } from './hooks.js';

// A tenant id may be 200 characters; Temporal refuses a fairness key over 64 bytes.
const longTenant = `tenant-${'é'.repeat(100)}`;
const t = usePipeline({
  customers: { acme: 'cus_acme', [longTenant]: 'cus_long' },
  stripe: { customers: ['cus_acme', 'cus_long'] },
  // A failing delivery waits a second between attempts, long enough to find its activity pending.
  env: { RETRY_INITIAL_INTERVAL_MS: '1000', RETRY_MAXIMUM_INTERVAL_MS: '1000', RETRY_MAXIMUM_ATTEMPTS: '50' },
});

describe('fairness across tenants on the Temporal task queue', () => {
  it('starts each usage workflow with its tenant as fairness key', async () => {
    const key = await t.enqueue('acme', 2);
    await t.waitStatus(key, 'sent');
    const d = await t.client.workflow.getHandle(key).describe();
    expect(d.raw.workflowExecutionInfo?.priority?.fairnessKey).toBe('acme');
  });

  it('gives a tenant too long for a fairness key a hash of it, and the event is delivered', async () => {
    expect(Buffer.byteLength(longTenant, 'utf8')).toBeGreaterThan(MAX_FAIRNESS_KEY_BYTES);
    const key = await t.enqueue(longTenant, 1);
    await t.waitStatus(key, 'sent');
    expect(t.eventsFor(key)).toHaveLength(1);
    const d = await t.client.workflow.getHandle(key).describe();
    const fairnessKey = d.raw.workflowExecutionInfo?.priority?.fairnessKey ?? '';
    expect(fairnessKey).toBe(fairnessKeyFor(longTenant));
    expect(Buffer.byteLength(fairnessKey, 'utf8')).toBeLessThanOrEqual(MAX_FAIRNESS_KEY_BYTES);
  });

  it('passes the key on to the run’s activities: the retried delivery carries it', async () => {
    // The next attempts fail (5xx, which may pass): after the first, in the workflow task, the
    // delivery goes on as a regular activity on the task queue, where fairness applies.
    t.stripe.failNext(5, 500);
    const key = await t.enqueue('acme', 1);
    const handle = t.client.workflow.getHandle(key);
    const pending = await waitFor('the delivery activity pending', async () => {
      const d = await handle.describe().catch(() => undefined);
      return d?.raw.pendingActivities?.find((a) => a.activityType?.name === 'deliverUsage');
    });
    expect(pending.priority?.fairnessKey).toBe('acme');
    await t.waitStatus(key, 'sent');
  });
});
