/**
 * Every activity the worker registers, built from its dependencies (real clients are made in one
 * place: src/temporal/worker.ts; the parts each activity composes are assembled here). Workflows
 * import only the types.
 */
import { Context } from '@temporalio/activity';
import type { Client } from '@temporalio/client';
import type pg from 'pg';
import type Stripe from 'stripe';
import type { Config } from '../src/config.js';
import { answeredWithin } from '../src/db.js';
import type { Metrics } from '../src/metrics.js';
import { deliveryStore } from '../src/outbox/sql/delivery.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { MeterLease } from '../src/stripe/meter-lease.js';
import type { MeterCatalog } from '../src/stripe/meters.js';
import { SlotPacer } from '../src/stripe/rate-limit.js';
import { inDeadLetterSpan } from '../src/tracing.js';
import { meterEventsV1, tracedSender, type MeterEventSender } from '../src/stripe/sender.js';
import { createDeliveryActivities } from './delivery.js';
import { createReconcileActivities } from './reconcile.js';
import { createRelayActivities, type RelayDeps } from './relay.js';
import { rowChangedSignal } from '../workflows/shared.js';

/**
 * How a delivery answered after its attempt timed out tells the event's run: its row changed
 * (`rowChanged`). A run that is a dead letter reads its row, finds it at Stripe and ends delivered,
 * listed as the row is; a run still delivering ignores it (its next attempt finds the row at Stripe).
 */
export function deliveredLateNotice(client: Pick<Client, 'workflow'>): (key: string) => Promise<void> {
  return (key) => client.workflow.getHandle(key).signal(rowChangedSignal);
}

export interface ActivityDeps extends Omit<RelayDeps, 'config' | 'metrics'> {
  db: pg.Pool;
  config: Pick<Config, 'relay' | 'retry' | 'temporal' | 'stripe' | 'lanes' | 'timings' | 'databaseSchema'>;
  stripe: Pick<Stripe, 'billing'>;
  /** With STRIPE_METER_API=v2: the worker's batcher on Stripe's meter event stream (else v1 calls). */
  stream?: MeterEventSender;
  meters: Pick<MeterCatalog, 'keysFor'>;
  metrics?: Metrics;
  /** Tracing on: each Stripe call is a span of the event's trace. */
  traced?: boolean;
}

export function createActivities(deps: ActivityDeps) {
  const { db, config } = deps;
  const schema = schemaFor(config.databaseSchema);
  const sender = deps.stream ?? meterEventsV1(deps.stripe);
  // The delivery's statements (and any pace's) each take milliseconds: one unanswered for longer is
  // a connection gone silent (a failover), taken for PostgreSQL away (the delivery waits, spending
  // no attempt).
  const deliveryDb = answeredWithin(db, config.timings.statementAnswerMs);
  const delivery = createDeliveryActivities({
    store: deliveryStore(deliveryDb, schema, { identifierNamespace: config.stripe.identifierNamespace }),
    // The usage workflow's id is the event's idempotency key.
    sender: deps.traced ? tracedSender(sender, () => Context.current().info.workflowExecution?.workflowId) : sender,
    lease: new MeterLease(deliveryDb, schema, config.timings, deps.notifier, deps.stopping),
    pacer: new SlotPacer(deliveryDb, schema, { bucket: 'stripe_calls', perSecond: config.stripe.rateLimitPerSecond, maxWaitMs: config.timings.maxPacingWaitMs }),
    meters: deps.meters,
    config,
    metrics: deps.metrics,
    tellRunDeliveredLate: deliveredLateNotice(deps.client),
  });
  if (deps.traced) {
    const { markDead } = delivery;
    delivery.markDead = (input) => inDeadLetterSpan(input, () => markDead(input));
  }
  // The reconciliation's calls share the deliveries' bucket: together they stay under the account's limit.
  const reconcilePacer = new SlotPacer(deliveryDb, schema, { bucket: 'stripe_calls', perSecond: config.stripe.rateLimitPerSecond, maxWaitMs: config.timings.maxPacingWaitMs });
  const reconcile = createReconcileActivities({
    db: answeredWithin(db, config.timings.maintenanceAnswerMs),
    schema,
    stripe: deps.stripe,
    pace: () => reconcilePacer.waitForSlot(),
    metrics: deps.metrics,
  });
  return { ...delivery, ...createRelayActivities(deps), ...reconcile };
}

export type Activities = ReturnType<typeof createActivities>;
