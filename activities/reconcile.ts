/**
 * The scheduled reconciliation's one activity: compares a settled window (src/ops/reconcile.ts),
 * its Stripe calls in the account-wide pace, and records what it found in this process's metrics.
 * The full report stays here; the workflow gets the bounded result.
 */
import { Context } from '@temporalio/activity';
import type Stripe from 'stripe';
import type { Queryable } from '../src/db.js';
import type { ReconcileMetrics } from '../src/metrics.js';
import { reconcile, reconcileWindowAt, runResult, type ReconcileRunInput, type ReconcileRunResult } from '../src/ops/reconcile.js';
import type { Schema } from '../src/outbox/sql/schema.js';

export interface ReconcileActivityDeps {
  db: Queryable;
  schema: Schema;
  stripe: Pick<Stripe, 'billing'>;
  /** A slot in the account-wide pace of Stripe calls (SlotPacer.waitForSlot on `stripe_calls`). */
  pace: () => Promise<void>;
  metrics?: ReconcileMetrics;
}

export function createReconcileActivities(deps: ReconcileActivityDeps) {
  return {
    /**
     * Reconciles the window the run's start time `at` falls after (reconcileWindowAt). `at` comes
     * from the workflow, so a retried attempt compares the same hours.
     */
    async reconcileWindow(input: ReconcileRunInput & { at: number }): Promise<ReconcileRunResult> {
      const window = reconcileWindowAt(input.at, input);
      const report = await reconcile(
        {
          db: deps.db,
          schema: deps.schema,
          stripe: deps.stripe,
          // No cap on the windows: the run has only its own interval to compare (nothing narrower to
          // suggest), and what it keeps is the bounded result, not a report to print.
          maxWindows: Number.POSITIVE_INFINITY,
          // Counts only: the bounded result lists no rows, and an outage's windows hold millions.
          listEvents: false,
          // Each paced call is also a sign of life: a run over many customers outlasts any fixed
          // timeout. And the place to stop: an attempt cancelled (timed out, the worker shutting
          // down) went on through every pair, beside the attempt Temporal had started instead.
          pace: async () => {
            const ctx = Context.current();
            ctx.heartbeat();
            if (ctx.cancellationSignal.aborted) throw ctx.cancellationSignal.reason ?? new Error('reconcile attempt cancelled');
            await deps.pace();
          },
        },
        window,
      );
      const result = runResult(report);
      deps.metrics?.reconcileDrift.set({ direction: 'stripe_more' }, result.drift.stripeMore);
      deps.metrics?.reconcileDrift.set({ direction: 'stripe_less' }, result.drift.stripeLess);
      deps.metrics?.reconcileDriftingCustomers.set(result.driftingCustomers);
      deps.metrics?.reconcileLastSuccess.set(Date.now() / 1000);
      const log = Context.current().log;
      if (result.match) log.info('reconciled: Stripe counted what our sent rows say', { from: result.from, to: result.to, pairs: result.pairs });
      else log.warn('reconciled: drift', { from: result.from, to: result.to, drift: result.drift, customers: result.driftingCustomers });
      return result;
    },
  };
}

export type ReconcileActivities = ReturnType<typeof createReconcileActivities>;
