/**
 * Workflow changes must not break runs that are already open: a dead letter started by an earlier
 * version waits, open, for its retry signal, and a worker running today's code replays its history.
 * Fixtures are recorded with `npx tsx scripts/record-history.ts <commit> <file>`; a change that
 * breaks one goes through patched() → deprecatePatch() → removal (docs/operations.md, "Upgrading
 * workers"), and the old fixture stays until the patch is removed.
 */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { temporal } from '@temporalio/proto';
import { Worker } from '@temporalio/worker';
import { expect, it } from 'vitest';
import { workflowBundle } from './helpers.js';

const fixture = (name: string) =>
  temporal.api.history.v1.History.decode(readFileSync(path.join(import.meta.dirname, 'fixtures', name)));

it('replays a dead letter of today\'s shape: first attempt in the workflow task, refused, marked dead, waiting', async () => {
  const history = fixture('usage-dead-letter.pb');
  // The shape it pins: the first attempt ran as a local activity (a marker), markDead as an activity.
  const { EVENT_TYPE_MARKER_RECORDED, EVENT_TYPE_ACTIVITY_TASK_SCHEDULED } = temporal.api.enums.v1.EventType;
  const types = (history.events ?? []).map((e) => e.eventType);
  expect(types).toContain(EVENT_TYPE_MARKER_RECORDED);
  expect(types).toContain(EVENT_TYPE_ACTIVITY_TASK_SCHEDULED);
  // markDead's answer as today's activity gives it: the attempts and the row's resend window.
  const completed = (history.events ?? []).find((e) => e.activityTaskCompletedEventAttributes)?.activityTaskCompletedEventAttributes;
  expect(JSON.parse(Buffer.from(completed!.result!.payloads![0]!.data!).toString())).toEqual({ attempts: 1, firstAttemptedAt: null });
  await expect(Worker.runReplayHistory({ workflowBundle: workflowBundle() }, history, 'u:fixture:dead-letter')).resolves.toBeUndefined();
});
