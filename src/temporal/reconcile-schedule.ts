/**
 * The reconcile schedule: a Temporal Schedule that starts reconcileWorkflow every
 * RECONCILE_INTERVAL_MS, one per task queue (deployments sharing a namespace keep theirs apart).
 * Every worker ensures it at start; operators pause, trigger or delete it on the Web UI's
 * Schedules page or with `temporal schedule`.
 */
import { ScheduleAlreadyRunning, ScheduleNotFoundError, ScheduleOverlapPolicy, type Client, type ScheduleOptions } from '@temporalio/client';
import type { Config } from '../config.js';
import type { Logger } from '../log.js';
import { reconcileWindowAt, type ReconcileRunInput } from '../ops/reconcile.js';

/** The schedule's id, and the prefix of its runs' workflow ids (Temporal appends the scheduled time). */
export function reconcileScheduleId(taskQueue: string): string {
  return `billing-outbox-reconcile:${taskQueue}`;
}

function scheduleOptions(config: Pick<Config, 'temporal' | 'reconcile'>): ScheduleOptions {
  const id = reconcileScheduleId(config.temporal.taskQueue);
  const input: ReconcileRunInput = { intervalMs: config.reconcile.intervalMs, lagMs: config.reconcile.lagMs };
  const hours = (ms: number) => `${+(ms / 3_600_000).toFixed(2)} h`;
  return {
    scheduleId: id,
    spec: { intervals: [{ every: config.reconcile.intervalMs }] },
    action: {
      type: 'startWorkflow',
      workflowType: 'reconcileWorkflow',
      workflowId: id,
      taskQueue: config.temporal.taskQueue,
      args: [input],
      staticSummary: 'Reconcile the outbox with Stripe’s meter summaries',
      staticDetails:
        `Every ${hours(input.intervalMs)}: compares the sent rows of every (customer, meter) with usage in the whole hours that ended at least ${hours(input.lagMs)} ` +
        `before the run with Stripe's hourly meter event summaries. The run's result and memo say what matched and what drifted.`,
    },
    policies: {
      // Runs due while one is still going wait for it, every one of them, instead of being
      // skipped: each run covers its own hours, so a skipped run would leave them uncompared (with
      // one buffered, a run slow for hours, retrying a slow Stripe, dropped all but the next). The
      // catch-up window lets a run missed while Temporal was away still start once it is back;
      // each run takes its window from its scheduled time, not from when it started.
      overlap: ScheduleOverlapPolicy.BUFFER_ALL,
      catchupWindow: Math.max(60_000, config.reconcile.intervalMs),
    },
    // What never changes for this schedule (a memo is set when it is made, never by an update): the
    // interval and lag are in the action's details, which an update keeps current.
    memo: {
      description: `billing-outbox reconciliation for task queue ${config.temporal.taskQueue}`,
    },
    state: { note: 'created by a billing-outbox worker (RECONCILE_SCHEDULE=on); pausing it here is kept across worker restarts' },
  };
}

/**
 * The hours no scheduled run will compare after the schedule's settings change: from where the
 * last run under `before` stopped to where the first run under `after` (at `nextAt`) starts. Each
 * run takes its window from its own time and settings, so a shorter interval or lag skips the
 * hours between; a longer one only overlaps. Undefined when nothing is skipped.
 */
export function hoursLeftUncompared(lastRunAt: number, before: ReconcileRunInput, nextAt: number, after: ReconcileRunInput): { from: Date; to: Date } | undefined {
  const from = reconcileWindowAt(lastRunAt, before).to;
  const to = reconcileWindowAt(nextAt, after).from;
  return to > from ? { from, to } : undefined;
}

/**
 * Creates the schedule unless it exists. An existing one is updated only when this worker's
 * interval or lag differ from it (a changed configuration rolling out), keeping its paused state
 * and note: an operator's pause survives every restart. Many workers starting at once: one
 * creates, the others find it. `onUncompared` is told the hours an update leaves to no run
 * (hoursLeftUncompared), which an operator compares with `billing-outbox reconcile`.
 */
export async function ensureReconcileSchedule(
  client: Client,
  config: Pick<Config, 'temporal' | 'reconcile'>,
  onUncompared?: (hours: { from: Date; to: Date }) => void,
): Promise<'created' | 'updated' | 'unchanged'> {
  const options = scheduleOptions(config);
  try {
    await client.schedule.create(options);
    return 'created';
  } catch (err) {
    if (!(err instanceof ScheduleAlreadyRunning)) throw err;
  }
  const handle = client.schedule.getHandle(options.scheduleId);
  const current = await handle.describe();
  const every = current.spec.intervals?.[0]?.every;
  const args = current.action.type === 'startWorkflow' ? (current.action.args as unknown[] | undefined)?.[0] : undefined;
  const wanted = options.action.args?.[0] as ReconcileRunInput;
  const same =
    current.spec.intervals?.length === 1 &&
    every === config.reconcile.intervalMs &&
    JSON.stringify(args) === JSON.stringify(wanted) &&
    current.action.type === 'startWorkflow' &&
    current.action.taskQueue === config.temporal.taskQueue &&
    current.policies.overlap === options.policies?.overlap;
  if (same) return 'unchanged';
  await handle.update((previous) => ({ ...previous, spec: options.spec, action: options.action, policies: { ...previous.policies, ...options.policies } }));
  const lastRun = current.info.recentActions.at(-1)?.scheduledAt;
  const before = args as Partial<ReconcileRunInput> | undefined;
  if (lastRun && typeof before?.intervalMs === 'number' && typeof before.lagMs === 'number') {
    // The interval's runs fall on its multiples since the epoch (no offset is set).
    const nextAt = Math.ceil(Date.now() / wanted.intervalMs) * wanted.intervalMs;
    const skipped = hoursLeftUncompared(lastRun.getTime(), { intervalMs: before.intervalMs, lagMs: before.lagMs }, nextAt, wanted);
    if (skipped) onUncompared?.(skipped);
  }
  return 'updated';
}

/**
 * Creates the schedule again if it is gone (deleted in the Web UI or with `temporal schedule
 * delete`); true if it did. One that exists is left as it is, paused or not: its settings are
 * ensureReconcileSchedule's, at a worker's start. (To stop reconciliation, RECONCILE_SCHEDULE=off;
 * to hold it, pause the schedule.)
 */
export async function restoreReconcileSchedule(client: Client, config: Pick<Config, 'temporal' | 'reconcile'>): Promise<boolean> {
  try {
    await client.schedule.getHandle(reconcileScheduleId(config.temporal.taskQueue)).describe();
    return false;
  } catch (err) {
    if (!(err instanceof ScheduleNotFoundError)) throw err;
  }
  try {
    await client.schedule.create(scheduleOptions(config));
    return true;
  } catch (err) {
    if (err instanceof ScheduleAlreadyRunning) return false;
    throw err;
  }
}

/**
 * The schedule ensured at a worker's start; a failure is logged, not fatal: billing goes on without
 * it, and the worker's check every 15 s creates it once it can.
 */
export async function ensureReconcileScheduleOrWarn(client: Client, config: Pick<Config, 'temporal' | 'reconcile'>, log: Logger | undefined): Promise<void> {
  try {
    const outcome = await ensureReconcileSchedule(client, config, ({ from, to }) =>
      log?.warn(
        { from: from.toISOString(), to: to.toISOString() },
        `the reconcile schedule's new interval or lag leaves hours no scheduled run compares: run billing-outbox reconcile --from ${from.toISOString()} --to ${to.toISOString()}`,
      ),
    );
    log?.info({ outcome, scheduleId: reconcileScheduleId(config.temporal.taskQueue), intervalMs: config.reconcile.intervalMs, lagMs: config.reconcile.lagMs }, 'reconcile schedule ensured');
  } catch (err) {
    log?.warn({ err: String(err) }, 'could not ensure the reconcile schedule; the worker tries to create it again within 15 s');
  }
}
