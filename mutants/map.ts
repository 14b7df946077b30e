/**
 * The guarantee map: for each promise of the README's "What is guaranteed" table, the smallest
 * change to the product code that breaks it, and the test that must then fail. `npm run mutants`
 * (mutants/run.ts) applies each one in a scratch copy and runs only that test.
 *
 * Tried and left out, as equivalent: dropping the claim's advisory lock (relay.ts CLAIM_LOCK). With
 * candidates always the oldest claimable rows of a lane, SKIP LOCKED and the guarded update, two
 * unserialized claims were never seen to overfill a lane (8 racing claimers, and the reasoning in
 * docs/testing.md); the lock stays as a second line, and no test pretends to prove it.
 *
 * A mutant is anchored by its text, not by a file: `find` must occur exactly once in the whole
 * product tree (src/, activities/, workflows/, migrations/), so moving code between modules keeps
 * the mutant. If the code is changed so that the text occurs zero times or twice, or the named test
 * is gone, the runner stops (exit 2) instead of reporting a mutant that changed nothing.
 */
export interface Mutant {
  id: string;
  /** The README row (and the words in it) that the change breaks. */
  guarantee: string;
  /** Exact text of product code, found once in the whole product tree; `replace` takes its place. */
  find: string;
  replace: string;
  /** The test file that must fail, and the test name pattern (vitest -t) within it. */
  test: string;
  name?: string;
  /** In the quick subset run by CI (each is a short test). */
  quick?: boolean;
}

export const MUTANTS: Mutant[] = [
  {
    id: 'enqueue-drops-outbox-row',
    guarantee: 'Atomic enqueue: a committed transaction always leaves an event',
    find: 'SELECT tenant_id, id, event_name, quantity, occurred_at, $6::text FROM usage\n',
    replace: 'SELECT tenant_id, id, event_name, quantity, occurred_at, $6::text FROM usage WHERE false\n',
    test: 'test/enqueue.test.ts',
    name: 'writes the usage row and the outbox row',
    quick: true,
  },
  {
    id: 'enqueue-future-check-after-write',
    guarantee: 'Not guaranteed / refusals: usage stamped more than 5 minutes ahead is refused at enqueue, before anything is written',
    find: 'export const MAX_EVENT_FUTURE_MS = 5 * 60_000;',
    replace: 'export const MAX_EVENT_FUTURE_MS = 5 * 60_000 * 1_000;',
    test: 'test/enqueue.test.ts',
    quick: true,
  },
  {
    id: 'enqueue-accepts-conflicting-duplicate',
    guarantee: 'No duplicate enqueue: the same id with different values is refused',
    find: 'if (!same) throw new UsageConflictError(usage.usageId, entry);',
    replace: 'if (same === undefined) throw new UsageConflictError(usage.usageId, entry);',
    test: 'test/enqueue.test.ts',
    name: 'refuses a usage id reused with different values',
    quick: true,
  },
  {
    id: 'claim-waits-on-locks',
    guarantee: 'Claim: FOR UPDATE SKIP LOCKED, a claimer never waits on rows another holds',
    find: 'ORDER BY o.id FOR UPDATE SKIP LOCKED',
    replace: 'ORDER BY o.id FOR UPDATE',
    test: 'test/claim.test.ts',
    name: 'never waits on rows another claimer holds',
    quick: true,
  },
  {
    id: 'claim-without-guard',
    guarantee: 'At-least-once / one claim: a row is only taken while pending or after its lease lapsed (the guarded update)',
    find: "AND (o.status = 'pending' OR (o.status = 'claimed' AND o.processing_deadline < now()))",
    replace: "AND (o.status = 'pending' OR o.status = 'claimed')",
    test: 'test/claim.test.ts',
    name: 'the guarded update',
    quick: true,
  },
  {
    id: 'stale-claim-marks',
    guarantee: "At-least-once: a crashed relay's claimed rows come back when their lease lapses, and its old claim can no longer mark them",
    find: "AND status = 'claimed' AND claim_id = $2::uuid",
    replace: "AND status = 'claimed' AND ($2::uuid IS NOT NULL OR claim_id = $2::uuid)",
    test: 'test/claim.test.ts',
    name: 'gives a row back once its lease lapses',
    quick: true,
  },
  {
    id: 'dispatch-unpaced',
    guarantee: "Stripe's limits: relays dispatch at the account pace, so a backlog waits in the outbox, not as workflows",
    find: "const pace = await reserveSlots(db, { bucket: 'dispatch', count: rows.length, perSecond: eventsPerSecond });",
    replace: "const pace = await reserveSlots(db, { bucket: 'dispatch', count: rows.length, perSecond: eventsPerSecond * 100 });",
    test: 'test/limits.test.ts',
    name: 'account rate limit',
  },
  {
    id: 'pace-slot-read-unlocked',
    guarantee: "Stripe's limits: each call reserves a slot of its own in the shared account limiter, however many workers reserve at once",
    find: 'FROM rate_limits WHERE bucket = $1::text FOR UPDATE',
    replace: 'FROM rate_limits WHERE bucket = $1::text',
    test: 'test/pace.test.ts',
    name: 'distinct slots',
    quick: true,
  },
  {
    id: 'lane-limit-ignored',
    guarantee: 'Lanes: at most LANE_MAX_IN_FLIGHT events of one (tenant, meter) claimed or in flight',
    find: 'opts.leaseMs, [...AWAITING_RELAY], opts.laneMax,',
    replace: 'opts.leaseMs, [...AWAITING_RELAY], opts.laneMax * 1_000,',
    test: 'test/claim.test.ts',
    name: 'keeps at most laneMax',
    quick: true,
  },
  {
    id: 'second-run-per-event',
    guarantee: 'One workflow per event: workflow id = idempotency key, REJECT_DUPLICATE',
    find: 'workflowId: row.idempotency_key,',
    replace: 'workflowId: `${row.idempotency_key}/${Date.now()}`,',
    test: 'test/pipeline.test.ts',
    name: 'never starts a second run',
  },
  {
    id: 'identifier-not-the-key',
    guarantee: 'Effectively once at Stripe: every attempt sends the same identifier',
    find: 'stripeCustomerId: customer, quantity: row.quantity, identifier: key, occurredAt: row.occurred_at };',
    replace: 'stripeCustomerId: customer, quantity: row.quantity, identifier: `${key}/${Date.now()}`, occurredAt: row.occurred_at };',
    test: 'test/pipeline.test.ts',
    name: 'treats a lost response after Stripe recorded the event as delivered',
  },
  {
    id: 'duplicate-identifier-not-delivered',
    guarantee: "Effectively once at Stripe: Stripe's duplicate-identifier 400 is treated as delivered",
    find: "(err.code === DUPLICATE_CODE || DUPLICATE_IDENTIFIER.test(message))) {",
    replace: "(err.code === DUPLICATE_CODE || DUPLICATE_IDENTIFIER.test(message)) && Math.random() > 2) {",
    test: 'test/pipeline.test.ts',
    name: 'treats a lost response after Stripe recorded the event as delivered',
  },
  {
    id: 'resend-past-24h',
    guarantee: 'The 24-hour bound: no resend once the first attempt is more than 23 h old, unless forced',
    find: 'export const SAFE_RESEND_WINDOW_MS = IDENTIFIER_WINDOW_MS - HOUR_MS;',
    replace: 'export const SAFE_RESEND_WINDOW_MS = 100 * IDENTIFIER_WINDOW_MS;',
    test: 'test/pipeline.test.ts',
    name: 'refuses a retry past the 24 h identifier window',
  },
  {
    id: 'two-calls-per-pair',
    guarantee: "Stripe's limits: never two meter-event calls in flight for one (customer, meter), across every worker",
    find: 'WHERE meter_leases.expires_at < clock_timestamp() OR meter_leases.holder = EXCLUDED.holder',
    replace: 'WHERE true',
    test: 'test/lanes.test.ts',
    name: 'keeps a hot lane',
  },
  {
    id: 'no-hold-after-unanswered-call',
    guarantee: "Stripe's limits: after a call that got no answer, the pair stays closed (Stripe may still be on it)",
    find: '      if (after.unanswered) {',
    replace: '      if (after.unanswered === undefined) {',
    test: 'test/lanes.test.ts',
    name: 'no answer',
  },
  {
    id: 'lease-holder-reused',
    guarantee: "Stripe's limits: an event's next try does not inherit the lease its unanswered first try holds",
    find: '/${run.attempt}/${randomUUID()}`;',
    replace: '/${run.attempt}/${String(randomUUID).slice(0, 0)}`;',
    test: 'test/lanes.test.ts',
    name: 'next try after an unanswered',
  },
  {
    id: 'no-429-jitter',
    guarantee: "Stripe's limits: a 429 is waited out (Retry-After plus jitter), so refused calls do not return as one burst",
    find: "return deferred('rate_limited', (failure.retryAfterMs ?? t.rateLimitedWaitMs) + Math.floor(Math.random() * t.rateLimitJitterMs), row.attempt_count);",
    replace: "return deferred('rate_limited', (failure.retryAfterMs ?? t.rateLimitedWaitMs) + 0 * t.rateLimitJitterMs, row.attempt_count);",
    test: 'test/pipeline.test.ts',
    name: 'spreads the retries after a 429',
  },
  {
    id: 'too-old-sent',
    guarantee: "Not guaranteed: usage older than Stripe's 35-day window is dead-lettered before any call",
    find: 'if (age > MAX_EVENT_AGE_MS) {',
    replace: 'if (age > 10 * MAX_EVENT_AGE_MS) {',
    test: 'test/pipeline.test.ts',
    name: 'aged past Stripe',
  },
  {
    id: 'retry-outside-window',
    guarantee: "Not guaranteed: a retry cannot help usage outside Stripe's 35-day window, and is refused, even forced",
    find: 'return occurredAt.getTime() < now - (MAX_EVENT_AGE_MS - WINDOW_MARGIN_MS);',
    replace: 'return occurredAt.getTime() < now - 10 * MAX_EVENT_AGE_MS;',
    test: 'test/cli.test.ts',
    name: 'outside Stripe',
  },
  {
    id: 'dead-letters-pruned',
    guarantee: 'At-least-once: nothing undelivered is deleted; dead letters wait for a human',
    find: "export const PRUNABLE = [...DELIVERED, 'cancelled'] as const;",
    replace: "export const PRUNABLE = [...DELIVERED, 'cancelled', 'dead', 'rejected_async'] as const;",
    test: 'test/retention.test.ts',
    name: 'prunes only delivered and cancelled rows',
    quick: true,
  },
  {
    id: 'dead-letter-never-waits',
    guarantee: 'At-least-once: after the final failure the row is dead and its workflow waits for a retry signal',
    find: 'if (!(await condition(() => requested !== undefined, input.retry.deadLetterOpenMs))) return undefined;',
    replace: 'return undefined;',
    test: 'test/workflows.test.ts',
    name: 'runs the retry policy out',
  },
  {
    id: 'start-refusal-retried-forever',
    guarantee: 'Nothing stuck silently: a start Temporal refuses for good is dead at once (temporal_start_refused), its lane goes on',
    find: '  return name ? new StartRefusedError(name, temporalAnswer(err)) : (err as Error);',
    replace: '  return err as Error;',
    test: 'test/start-refused.test.ts',
    name: 'leaves the row dead',
  },
  {
    id: 'summary-unbounded',
    guarantee: "Nothing stuck silently: the static summary stays within Temporal's limit.userMetadataSummarySize, whatever the tenant",
    find: '  return boundedSummary(`${row.tenant_id}: ${what}${when}`);',
    replace: '  return `${row.tenant_id}: ${what}${when}`;',
    test: 'test/unit/summary.test.ts',
    name: '120-CJK-character tenant',
    quick: true,
  },
  {
    id: 'start-failure-silent',
    guarantee: 'Nothing stuck silently: a start that keeps failing is counted (status, temporal_start_failed on the row)',
    find: '    await recordStartFailure(db, row.id, claimId, TemporalErrorCodes.startFailing, String(err)).catch(() => undefined);',
    replace: '',
    test: 'test/start-refused.test.ts',
    name: 'is tried again',
  },
  {
    id: 'closed-run-taken-as-dispatched',
    guarantee: "Nothing stuck silently: a start that meets the key's closed run makes the row dead (workflow_closed), not dispatched",
    find: "if (outcome.value.kind === 'closed') return closedRun(row, claimId, outcome.value, totals);",
    replace: "if (outcome.value.kind === 'closed' && row.id < 0) return closedRun(row, claimId, outcome.value, totals);",
    test: 'test/closed-runs.test.ts',
    name: 'put back to pending',
  },
  {
    id: 'sweep-misses-terminated-runs',
    guarantee: 'Nothing stuck silently: the closed-run sweep makes a dispatched row whose run was terminated dead (workflow_closed)',
    find: "    if (run?.kind !== 'closed') continue;",
    replace: "    if (run?.kind !== 'closed' || run.status === 'TERMINATED') continue;",
    test: 'test/closed-runs.test.ts',
    name: 'terminated during a Stripe outage',
  },
  {
    id: 'cancelled-run-leaves-row',
    guarantee: 'Nothing stuck silently: a cancelled usage workflow marks its row dead (workflow_cancelled) before it ends',
    find: '    if (isCancellation(err)) {\n      const { markDead } = proxyActivities',
    replace: '    if (isCancellation(err) && err === undefined) {\n      const { markDead } = proxyActivities',
    test: 'test/workflows.test.ts',
    name: 'a cancelled run marks its row dead',
  },
  {
    id: 'worker-never-sweeps',
    guarantee: 'Nothing stuck silently: every worker runs the closed-run sweep, so a terminated run is found without anyone asking',
    find: '  const sweeper = startClosedRunSweep(deps, stopping.signal);',
    replace: '  const sweeper = Promise.resolve();',
    test: 'test/closed-runs.test.ts',
    name: 'the worker runs the sweep by itself',
  },
];
