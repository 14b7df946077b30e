/**
 * Workflow changes must not break runs that are already open: a dead letter started by an earlier
 * version waits, open, for its retry signal, and a worker running today's code replays its history.
 * Fixtures are recorded with `npx tsx scripts/record-history.ts <commit> <file>`.
 */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { temporal } from '@temporalio/proto';
import { Worker } from '@temporalio/worker';
import { expect, it } from 'vitest';
import { workflowBundle } from './helpers.js';

const fixture = (name: string) =>
  temporal.api.history.v1.History.decode(readFileSync(path.join(import.meta.dirname, 'fixtures', name)));

it('replays a dead letter recorded before lanes (it took its turn in a local activity)', async () => {
  const history = fixture('usage-dead-before-lanes.pb');
  // The old run's shape: it took its turn (a local activity marker) before its delivery attempt.
  const types = (history.events ?? []).map((e) => e.eventType);
  expect(types).toContain(temporal.api.enums.v1.EventType.EVENT_TYPE_MARKER_RECORDED);
  await expect(Worker.runReplayHistory({ workflowBundle: workflowBundle() }, history, 'u:fixture:dead-before-change')).resolves.toBeUndefined();
});
