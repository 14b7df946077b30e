/**
 * The relay: moves committed outbox rows into Temporal, one usage workflow per event.
 *
 * Each call of `relayOutbox` runs for a bounded time (so the relay workflow's history stays small
 * and a redeploy picks up new code), claiming batches while there is work and sleeping on
 * LISTEN/NOTIFY (with a polling fallback) while there is none.
 */
import { randomUUID } from 'node:crypto';
import { hostname } from 'node:os';
import { Context } from '@temporalio/activity';
import type { Client } from '@temporalio/client';
import type pg from 'pg';
import type { Config } from '../src/config.js';
import { answeredWithin } from '../src/db.js';
import type { RelayMetrics } from '../src/metrics.js';
import type { OutboxNotifier } from '../src/outbox/notifier.js';
import { claimBatch, markClaimDead, markDispatched, recordStartFailure, type ClaimedRow } from '../src/outbox/sql/relay.js';
import { reserveSlots } from '../src/outbox/sql/pace.js';
import { LaneWindow, type Lane } from '../src/outbox/lane-window.js';
import { MAX_STREAM_BATCH } from '../src/stripe/rules.js';
import { closedRunMessage, startUsageWorkflow, StartRefusedError, type StartOutcome } from '../src/temporal/start-usage.js';
import { TemporalErrorCodes } from '../workflows/shared.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { waitUnlessAborted } from '../src/wait.js';

export interface RelayDeps {
  db: pg.Pool;
  client: Client;
  notifier: OutboxNotifier;
  config: Pick<Config, 'relay' | 'retry' | 'temporal' | 'stripe' | 'lanes' | 'databaseSchema' | 'timings'>;
  /** How long one relay activity runs before handing back to its workflow. */
  runForMs?: number;
  /** Aborted when this process is shutting down: relays stop claiming at once. */
  stopping?: AbortSignal;
  log?: (msg: string, fields: Record<string, unknown>) => void;
  /** This process's claim histograms; nothing is recorded without it. */
  metrics?: RelayMetrics;
  /** The lane window this process's relays share; by default one at LANE_MAX_IN_FLIGHT. */
  laneWindow?: LaneWindow;
  /** The most lanes one claim looks at; LANES_PER_CLAIM by default. */
  lanesPerClaim?: number;
}

/** An idle relay heartbeats at least this often, well inside its heartbeat timeout. */
const MAX_IDLE_WAIT_MS = 5_000;
/**
 * A start that failed for a reason that may pass (Temporal away, or busy) is tried again this long
 * after, not when its claim would lapse (RELAY_CLAIM_TIMEOUT_MS, a minute by default): events
 * committed during a Temporal outage go out seconds after it ends. Each try of a start already
 * waits out the client's own retries, so a long outage does not make the relays spin.
 */
export const START_RETRY_MS = 5_000;
/** Under load, how long a woken relay gathers freed lanes before claiming (lanes buffer more than this). */
const COALESCE_MS = 25;
/**
 * About how long one batch's workflow starts should take. A batch is started all at once and the
 * relay claims again when the last start has answered, so an event committed meanwhile waits for
 * the whole batch. Unloaded, Temporal answers a batch of 200 in milliseconds; saturated, it starts
 * a few dozen workflows a second, and a flooding tenant's batches of 25 took a second each here,
 * every other tenant's new events waiting behind them (bench fairness). So each claim is sized by
 * the rate the relay's last batch was started at (nextClaimLimit).
 */
export const BATCH_TARGET_MS = 200;

/**
 * The next claim's size: what the last batch's start rate (`started` rows answered in `startMs`)
 * starts in about BATCH_TARGET_MS, between 1 and `max` (the configured batch). The rows a claim
 * leaves are not lost: they wait, pending, for the next claim, which follows at once.
 *
 * A far Temporal (Temporal Cloud in another region) answers every start after its round trip,
 * however small the batch: a smaller claim would take as long and carry less, down to one row a
 * round trip. So the target is never below twice `fastestMs`, the quickest batch this relay has
 * seen started (its round trip when nothing queues).
 */
export function nextClaimLimit(started: number, startMs: number, max: number, fastestMs = 0): number {
  const targetMs = Math.max(BATCH_TARGET_MS, 2 * fastestMs);
  return Math.max(1, Math.min(max, Math.ceil((started * targetMs) / Math.max(startMs, 1))));
}

export interface RelayResult {
  claimed: number;
  started: number;
  alreadyStarted: number;
  /** Starts that failed for a reason that may pass: the rows stay claimed and are tried again. */
  failedToStart: number;
  /** Starts Temporal refused for good: the rows are dead (temporal_start_refused). */
  refused: number;
  /** Rows whose run had already closed: dead (workflow_closed). */
  closedRuns: number;
}

export function createRelayActivities(deps: RelayDeps) {
  const { client, notifier, config } = deps;
  const schema = schemaFor(config.databaseSchema);
  // The relay's statements each take milliseconds: one unanswered for longer is a connection gone
  // silent (a failover); it fails, and the relay is tried again on a new one.
  const answerMs = config.timings.statementAnswerMs;
  const db = answeredWithin(deps.db, answerMs);
  const runForMs = deps.runForMs ?? 60_000;
  const log = deps.log ?? (() => undefined);

  // Events per second Stripe takes from us: a call each with v1; a request of up to 100 with v2.
  const eventsPerSecond = config.stripe.rateLimitPerSecond * (config.stripe.meterApi === 'v2' ? MAX_STREAM_BATCH : 1);
  // At most one second's worth per batch: what is dispatched is what can be sent.
  const batchLimit = Math.min(config.relay.batchSize, Math.max(1, Math.ceil(eventsPerSecond)));
  // A lane's events in flight at once (LANE_MAX_IN_FLIGHT): the rest of a busy customer's backlog
  // waits in the outbox, where the claim serves tenants in turn, so a busy customer takes what the
  // others leave of each batch, never their place.
  const laneMax = config.lanes.maxInFlight;
  // What each lane may have in flight now, shared by this process's relays: all of laneMax unless
  // a busy lane's load is slowing quiet lanes (LaneWindow).
  const laneWindow = deps.laneWindow ?? new LaneWindow(laneMax);
  // Where this process's last claim stopped among the lanes waiting (a claim looks at up to
  // LANES_PER_CLAIM lanes after it: claimStatement), shared by its relays and kept across their
  // calls: their claims go round every lane waiting, however many.
  let stoppedAt: Lane | null = null;
  deps.metrics?.laneWindow.set(laneWindow.size);
  deps.metrics?.lanePause.set(0);

  /**
   * Claims one batch, starts its workflows, marks the started ones dispatched. Returns how many it
   * claimed and how long to wait before the next batch so that all relays together dispatch at the
   * Stripe rate limit (the backlog waits in the outbox, not as waiting workflows).
   */
  async function relayBatch(claimedBy: string, totals: RelayResult, limit: number): Promise<{ claimed: number; paceMs: number; startMs: number }> {
    const claimId = randomUUID();
    const endTimer = deps.metrics?.claimDuration.startTimer();
    const { rows, next } = await claimBatch(deps.db, schema, {
      limit,
      claimedBy,
      claimId,
      claimTimeoutMs: config.relay.claimTimeoutMs,
      laneMax: laneWindow.size,
      paused: laneWindow.paused(performance.now()),
      answerMs,
      after: stoppedAt,
      lanesPerClaim: deps.lanesPerClaim,
    });
    stoppedAt = next;
    endTimer?.();
    if (rows.length > 0) deps.metrics?.claimBatchSize.observe(rows.length);
    if (rows.length === 0) return { claimed: 0, paceMs: 0, startMs: 0 };
    const pace = await reserveSlots(db, schema, { bucket: 'dispatch', count: rows.length, perSecond: eventsPerSecond });
    const startedAt = performance.now();
    const outcomes = await Promise.allSettled(rows.map((row) => startUsageWorkflow(client, row, config, { eager: true })));
    const startMs = performance.now() - startedAt;
    const window = laneWindow.afterBatch(
      { quiet: rows.some((row) => row.lane_in_flight === 0 && !row.lane_held), held: rows.filter((row) => row.lane_held).map((row) => ({ tenantId: row.tenant_id, eventName: row.event_name })), startMs },
      performance.now(),
    );
    deps.metrics?.laneWindow.set(window);
    deps.metrics?.lanePause.set(laneWindow.pauseMs / 1000);
    const inTemporal: number[] = [];
    // A row is never left to loop silently: in Temporal's hands (dispatched), dead with the reason
    // (a refusal or a closed run: the lane goes on, an operator retries it), or claimed with the
    // failure on the row, counted and logged (a relay tries again START_RETRY_MS later).
    await Promise.all(
      outcomes.map(async (outcome, i) => {
        const row = rows[i]!;
        if (outcome.status === 'fulfilled') {
          if (outcome.value.kind === 'closed') return closedRun(row, claimId, outcome.value, totals);
          inTemporal.push(row.id);
          if (outcome.value.kind === 'started') totals.started++;
          else totals.alreadyStarted++;
        } else {
          await startFailed(row, claimId, outcome.reason, totals);
        }
      }),
    );
    await markDispatched(db, schema, inTemporal, claimId);
    totals.claimed += rows.length;
    return { claimed: rows.length, paceMs: pace.spanEndMs, startMs };
  }

  async function closedRun(row: ClaimedRow, claimId: string, run: Extract<StartOutcome, { kind: 'closed' }>, totals: RelayResult): Promise<void> {
    totals.closedRuns++;
    deps.metrics?.closedRuns.inc({ status: run.status.toLowerCase() });
    const message = closedRunMessage(row.idempotency_key, run, 'waiting for a relay');
    log('usage workflow already closed; the row is dead', { key: row.idempotency_key, runStatus: run.status, code: TemporalErrorCodes.workflowClosed });
    await markClaimDead(db, schema, row.id, claimId, TemporalErrorCodes.workflowClosed, message);
  }

  async function startFailed(row: ClaimedRow, claimId: string, err: unknown, totals: RelayResult): Promise<void> {
    if (err instanceof StartRefusedError) {
      totals.refused++;
      deps.metrics?.startFailures.inc({ reason: 'refused' });
      log('Temporal refused to start the usage workflow; the row is dead', { key: row.idempotency_key, grpcStatus: err.grpcStatus, error: err.answer });
      await markClaimDead(db, schema, row.id, claimId, TemporalErrorCodes.startRefused, `${err.grpcStatus}: ${err.answer}`);
      return;
    }
    // Left claimed until START_RETRY_MS from now, when a relay picks the row up again; the row, the
    // metric and the log say so meanwhile.
    totals.failedToStart++;
    deps.metrics?.startFailures.inc({ reason: 'transient' });
    log('failed to start usage workflow; trying again shortly', { key: row.idempotency_key, retryInMs: START_RETRY_MS, error: String(err) });
    await recordStartFailure(db, schema, row.id, claimId, TemporalErrorCodes.startFailing, String(err), START_RETRY_MS).catch(() => undefined);
  }

  return {
    async relayOutbox(relayId: string): Promise<RelayResult> {
      const ctx = Context.current();
      const claimedBy = `${hostname()}:${process.pid}:${relayId}`;
      const totals: RelayResult = { claimed: 0, started: 0, alreadyStarted: 0, failedToStart: 0, refused: 0, closedRuns: 0 };
      const signals = [ctx.cancellationSignal, ...(deps.stopping ? [deps.stopping] : [])];
      const stop = AbortSignal.any(signals);
      // On the monotonic clock: a wall clock stepped back would run the call past its activity timeout.
      const until = performance.now() + runForMs;
      // This call's claim size, adjusted after each batch it starts (nextClaimLimit); an empty claim
      // leaves it as it is.
      let limit = batchLimit;
      let fastestMs = Infinity;
      notifier.start();
      // Whether a claim since the relay last waited has looked from the first lane waiting.
      let fromFirstLane = false;
      // Taken when a round of claims begins (after each wait): a notification during the round,
      // for a lane it has already passed, wakes the wait that ends it.
      let mark = notifier.mark();
      while (!stop.aborted && performance.now() < until) {
        fromFirstLane ||= stoppedAt === null;
        const { claimed: n, paceMs, startMs } = await relayBatch(claimedBy, totals, limit);
        // Claims again at once while lanes it has not looked at since it last waited may have room:
        // a full batch, lanes after where it stopped, or lanes before where it started.
        const again = n === limit || stoppedAt !== null || !fromFirstLane;
        if (n > 0) {
          fastestMs = Math.min(fastestMs, startMs);
          limit = nextClaimLimit(n, startMs, batchLimit, fastestMs);
        }
        ctx.heartbeat(totals);
        for (let left = paceMs; left > 0 && !stop.aborted; left -= MAX_IDLE_WAIT_MS) {
          await waitUnlessAborted(Math.min(left, MAX_IDLE_WAIT_MS), stop);
          ctx.heartbeat(totals);
        }
        if (!again) {
          fromFirstLane = false;
          const idleMs = Math.min(config.relay.pollIntervalMs, MAX_IDLE_WAIT_MS, Math.max(0, until - performance.now()));
          await notifier.wait(idleMs, stop, mark);
          // Under load (work found, but lanes full), every finished delivery wakes the relay: a
          // moment's wait lets one claim take the several lanes that free up meanwhile instead of
          // one claim per row. Idle, it claims at once (a new event's latency).
          if (n > 0) await waitUnlessAborted(COALESCE_MS, stop);
          ctx.heartbeat(totals);
          mark = notifier.mark();
        }
      }
      return totals;
    },
  };
}

export type RelayActivities = ReturnType<typeof createRelayActivities>;

