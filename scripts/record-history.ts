/**
 * Records the event history of a usage workflow run by the workflow code of an earlier commit, as a
 * fixture for test/replay.test.ts: the current code must replay it without a non-determinism error
 * (a dead letter started before a change still waits, open, for its retry signal after a deploy).
 *
 *   npx tsx scripts/record-history.ts <commit> <out.pb>
 *
 * The run: the first delivery attempt is refused for good, the event is dead, and it waits.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { ApplicationFailure } from '@temporalio/common';
import proto from '@temporalio/proto';
import { TestWorkflowEnvironment } from '@temporalio/testing';
import { bundleWorkflowCode, Worker } from '@temporalio/worker';

const [commit, out] = process.argv.slice(2);
if (!commit || !out) throw new Error('usage: record-history.ts <commit> <out.pb>');
const root = path.resolve(import.meta.dirname, '..');
const tmp = path.join(root, '.tools', `history-${commit}`);
rmSync(tmp, { recursive: true, force: true });
// The workflow code of that commit, beside the modules it imports (types are erased by the bundler).
for (const dir of ['workflows', 'src/outbox', 'src/stripe']) {
  mkdirSync(path.join(tmp, dir), { recursive: true });
  const files = execFileSync('git', ['ls-tree', '--name-only', `${commit}:${dir}`], { cwd: root, encoding: 'utf8' }).split('\n').filter((f) => f.endsWith('.ts'));
  for (const f of files) writeFileSync(path.join(tmp, dir, f), execFileSync('git', ['show', `${commit}:${dir}/${f}`], { cwd: root }));
}
const bundle = await bundleWorkflowCode({ workflowsPath: path.join(tmp, 'workflows', 'index.ts') });
const serverPath = path.join(root, '.tools', 'temporal-test-server-path');
const local = existsSync(serverPath) ? readFileSync(serverPath, 'utf8').trim() : '';
const env = await TestWorkflowEnvironment.createTimeSkipping(local ? { server: { executable: { type: 'existing-path', path: local } } } : {});
try {
  await env.connection.operatorService.addSearchAttributes({
    namespace: 'default',
    searchAttributes: {
      OutboxStatus: proto.temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
      TenantId: proto.temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
      OutboxError: proto.temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    },
  });
  const taskQueue = 'record-history';
  const worker = await Worker.create({
    connection: env.nativeConnection,
    taskQueue,
    workflowBundle: bundle,
    activities: {
      deliverUsage: async () => {
        throw ApplicationFailure.create({ type: 'StripeRejected', message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
      },
      markDead: async () => ({ attempts: 1, firstAttemptedAt: null }),
      markReopened: async () => undefined,
    },
  });
  const key = 'u:fixture:dead-letter';
  const retry = { initialIntervalMs: 1000, backoffCoefficient: 2, maximumIntervalMs: 60_000, maximumAttempts: 4, attemptTimeoutMs: 30_000, heartbeatTimeoutMs: 10_000, maxRateLimitedMs: 3_600_000, deadLetterOpenMs: 7 * 86_400_000 };
  await worker.runUntil(async () => {
    const handle = await env.client.workflow.start('usageWorkflow', { taskQueue, workflowId: key, args: [{ key, tenantId: 'fixture', retry }] });
    await env.sleep('1 minute');
    const history = await handle.fetchHistory();
    // Binary protobuf: exactly what the server sent, read back with History.decode.
    writeFileSync(out, proto.temporal.api.history.v1.History.encode(history).finish());
    await handle.terminate('recorded');
  });
  console.log(`recorded ${out}`);
} finally {
  await env.teardown();
  rmSync(tmp, { recursive: true, force: true });
}
