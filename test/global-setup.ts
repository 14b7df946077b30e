/**
 * Starts the real services once per test run and shares their addresses with every test file:
 * PostgreSQL (embedded unless DATABASE_URL is set), a Temporal dev server (unless TEMPORAL_ADDRESS
 * is set), and the workflow bundle (bundling takes seconds; do it once).
 */
import { bundleWorkflowCode } from '@temporalio/worker';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { TestProject } from 'vitest/node';
import './provided.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { startTemporalDevServer } from '../src/embedded/temporal.js';
import { WORKFLOWS_PATH } from '../src/temporal/worker.js';

interface Services {
  adminDatabaseUrl: string;
  temporalAddress: string;
  workflowBundlePath: string;
  stop: () => Promise<void>;
}

/**
 * Vitest calls this once per project (vitest.config.ts has two: the suite, then the files run
 * alone), in one process: the services are started by the first call and shared by the others
 * (kept on globalThis, as each project loads this module anew), and stopped after the last one.
 */
const shared = globalThis as { billingOutboxTestServices?: { services: Promise<Services>; users: number } };

export default async function setup(project: TestProject) {
  shared.billingOutboxTestServices ??= { services: startServices(), users: 0 };
  const entry = shared.billingOutboxTestServices;
  entry.users++;
  const services = await entry.services;
  project.provide('adminDatabaseUrl', services.adminDatabaseUrl);
  project.provide('temporalAddress', services.temporalAddress);
  project.provide('workflowBundlePath', services.workflowBundlePath);
  return async () => {
    if (--entry.users > 0) return;
    shared.billingOutboxTestServices = undefined;
    await services.stop();
  };
}

async function startServices(): Promise<Services> {
  const tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-test-'));
  // Run as root, PostgreSQL runs as a `postgres` system user that must be able to enter this folder.
  await chmod(tmp, 0o755);
  const stops: (() => Promise<void>)[] = [];

  let adminDatabaseUrl = process.env.DATABASE_URL;
  if (!adminDatabaseUrl) {
    const pg = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'postgres', persistent: false });
    stops.push(pg.stop);
    adminDatabaseUrl = pg.url;
  }

  let temporalAddress = process.env.TEMPORAL_ADDRESS;
  if (!temporalAddress) {
    // With task queue fairness, as deployments run it (test/fairness.test.ts reads the keys back),
    // and workflow pause, which an operator may use on the relays (test/relay-keeper.test.ts).
    const server = await startTemporalDevServer({ dbFile: path.join(tmp, 'temporal.db'), taskQueueFairness: true, dynamicConfig: ['frontend.WorkflowPauseEnabled=true'] });
    stops.push(server.stop);
    temporalAddress = server.address;
  }

  const bundle = await bundleWorkflowCode({ workflowsPath: WORKFLOWS_PATH, logger: quietLogger });
  const workflowBundlePath = path.join(tmp, 'workflow-bundle.js');
  await writeFile(workflowBundlePath, bundle.code);

  return {
    adminDatabaseUrl,
    temporalAddress,
    workflowBundlePath,
    stop: async () => {
      for (const stop of stops.reverse()) await stop().catch(() => undefined);
      await rm(tmp, { recursive: true, force: true });
    },
  };
}

const noop = () => undefined;
const quietLogger = { trace: noop, debug: noop, info: noop, warn: console.warn, error: console.error, log: noop };
