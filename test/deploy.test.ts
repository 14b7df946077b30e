/**
 * The compose file passes every setting the worker and the API read on to them: a variable missing
 * there is silently dropped (a deployment that picks STRIPE_METER_API=v2 stays on v1). And its
 * settings have a file of their own, not the `.env` that npm start and the CLI read.
 */
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { expect, it } from 'vitest';
import { CONFIG_VARIABLES } from '../src/config.js';

const compose = readFileSync(path.join(import.meta.dirname, '..', 'docker-compose.yml'), 'utf8');

/** The variables a service's environment names (its own lines and the shared block it merges). */
function variablesOf(block: string): Set<string> {
  return new Set([...block.matchAll(/^ {2,6}([A-Z][A-Z0-9_]*):/gm)].map((m) => m[1]!));
}

function section(start: RegExp, indent: string): string {
  const from = compose.search(start);
  expect(from, String(start)).toBeGreaterThanOrEqual(0);
  const rest = compose.slice(from);
  const firstLine = rest.indexOf('\n') + 1;
  const end = rest.slice(firstLine).search(new RegExp(`^${indent}\\S`, 'm'));
  return end < 0 ? rest : rest.slice(0, firstLine + end);
}

/** Only for `npm start`'s embedded stack on a developer's machine, never in a deployment. */
const LOCAL_ONLY = new Set(['DATA_DIR', 'TEMPORAL_CLI_PATH', 'LOCAL_STRIPE_URL']);

it('passes every variable src/config.ts reads to the worker and the API (secrets also as *_FILE)', () => {
  const database = variablesOf(section(/^x-database-environment:/m, ''));
  const shared = new Set([...database, ...variablesOf(section(/^x-billing-environment:/m, ''))]);
  const api = new Set([...shared, ...variablesOf(section(/^ {2}api:/m, '  '))]);
  const worker = new Set([...shared, ...variablesOf(section(/^ {2}worker:/m, '  '))]);
  const wanted = CONFIG_VARIABLES.filter((v) => !LOCAL_ONLY.has(v));
  // The API's own settings go to the API; the worker's metrics port to the worker.
  const apiOnly = ['API_TOKENS', 'API_BODY_LIMIT_BYTES', 'API_REQUEST_TIMEOUT_MS', 'API_KEEP_ALIVE_TIMEOUT_MS', 'API_PORT'];
  expect(wanted.filter((v) => !apiOnly.includes(v) && v !== 'WORKER_METRICS_PORT' && !worker.has(v)), 'missing for the worker').toEqual([]);
  expect(wanted.filter((v) => v !== 'WORKER_METRICS_PORT' && !api.has(v)), 'missing for the API').toEqual([]);
  expect(worker.has('WORKER_METRICS_PORT')).toBe(true);
  for (const secret of ['STRIPE_API_KEY', 'STRIPE_WEBHOOK_SECRET', 'TEMPORAL_API_KEY']) expect(shared.has(`${secret}_FILE`), secret).toBe(true);
  expect(api.has('API_TOKENS_FILE')).toBe(true);
  // And nothing it passes is unknown to the application (a typo would be dropped silently too).
  const known = new Set([...CONFIG_VARIABLES, ...CONFIG_VARIABLES.map((v) => `${v}_FILE`)]);
  expect([...api, ...worker].filter((v) => !known.has(v))).toEqual([]);
});

it('mounts deploy/secrets into the worker and the API, where the example names every file setting', () => {
  for (const service of ['api', 'worker']) expect(section(new RegExp(`^ {2}${service}:`, 'm'), '  '), service).toContain('- ./deploy/secrets:/run/secrets:ro');
  expect(section(/^ {2}migrate:/m, '  ')).not.toContain('/run/secrets');
  const example = readFileSync(path.join(import.meta.dirname, '..', 'deploy', 'compose.env.example'), 'utf8');
  const paths = [...example.matchAll(/^#?\s*[A-Z_]+_FILE=(\S+)/gm)].map((m) => m[1]!);
  expect(paths.length).toBeGreaterThan(0);
  for (const file of paths) expect(file).toMatch(/^\/run\/secrets\//);
  // The folder is there to mount, and what is put in it stays out of git.
  const root = path.join(import.meta.dirname, '..');
  expect(execFileSync('git', ['check-ignore', 'deploy/secrets/stripe-api-key'], { cwd: root, encoding: 'utf8' }).trim()).toBe('deploy/secrets/stripe-api-key');
});

it('gives migrate the database settings alone: a Temporal certificate or a Stripe key mounted only where the docs say cannot stop it', () => {
  expect([...variablesOf(section(/^x-database-environment:/m, ''))].sort()).toEqual(['DATABASE_SCHEMA', 'DATABASE_URL', 'LOG_LEVEL', 'NODE_ENV']);
  const migrate = section(/^ {2}migrate:/m, '  ');
  expect(migrate).toMatch(/<<: \*database-environment\n/);
  expect(migrate).not.toContain('*billing-environment');
});

it("keeps the deployment's settings out of `.env`, which npm start and the CLI read", () => {
  const root = path.join(import.meta.dirname, '..');
  // git-ignored, like .env.
  expect(execFileSync('git', ['check-ignore', 'deploy/compose.env'], { cwd: root, encoding: 'utf8' }).trim()).toBe('deploy/compose.env');
  // No instruction copies the deployment's example to `.env` any more, and each names its own file.
  const docs = ['docker-compose.yml', 'deploy/compose.env.example', 'README.md', 'docs/operations.md'].map((f) => [f, readFileSync(path.join(root, f), 'utf8')] as const);
  for (const [file, text] of docs) {
    expect(text, file).not.toMatch(/compose\.env\.example\s+\.env\b/);
    expect(text, file).toMatch(/deploy\/compose\.env\b/);
  }
  expect(compose).toMatch(/--env-file deploy\/compose\.env up/);
});
