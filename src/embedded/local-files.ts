/**
 * The files that tie a developer's machine together, all under the data folder (`.data/` unless
 * DATA_DIR says otherwise), each readable by its owner only:
 *
 * - `endpoints.json`: where the running `npm start` stack is (its pid, the database URL with its
 *   password, Temporal's address, the Web UI, the local Stripe, the API), so the CLI and
 *   `npm run stripe` find it with nothing exported;
 * - `api-token`: the bearer token `npm start` generates for the API when API_TOKENS is not set.
 *
 * And `.env` in the working directory, read by every entry point (variables already set win).
 */
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { PROJECT_ROOT } from './temporal.js';
import { ConfigError } from '../config.js';

export interface Endpoints {
  pid: number;
  databaseUrl: string;
  temporalAddress: string;
  temporalUi: string | undefined;
  stripeApiBase: string;
  /** The local Stripe-compatible server's URL when it is the Stripe in use. */
  localStripe: string | undefined;
  api: string;
  /** The generated API token's file, when `npm start` made one. */
  apiTokenFile: string | undefined;
}

/** DATA_DIR, else `.data` in the project. */
export function defaultDataDir(configured?: string): string {
  return path.resolve(configured ?? path.join(PROJECT_ROOT, '.data'));
}

/** Loads `.env` from the working directory into process.env; variables already set are kept. */
export function loadDotEnv(file = path.resolve('.env')): boolean {
  if (!existsSync(file)) return false;
  process.loadEnvFile(file);
  return true;
}

export async function writeEndpoints(dataDir: string, endpoints: Endpoints): Promise<string> {
  const file = path.join(dataDir, 'endpoints.json');
  // Whole or not at all: a reader (the CLI, a test waiting for the file) never sees it half written.
  const tmp = `${file}.${process.pid}.tmp`;
  await writeFile(tmp, JSON.stringify(endpoints, null, 2), { mode: 0o600 });
  await rename(tmp, file);
  return file;
}

export async function removeEndpoints(dataDir: string, pid = process.pid): Promise<void> {
  const file = path.join(dataDir, 'endpoints.json');
  // Only our own: a second `npm start` next to this one has its own data folder or its own file.
  const current = readEndpointsFile(file);
  if (current?.pid === pid) await rm(file, { force: true });
}

/**
 * With `npm start` running on this machine and only one of DATABASE_URL and TEMPORAL_ADDRESS set,
 * the refusal naming the other: never guessed (a production DATABASE_URL beside the local Temporal,
 * the stack's or localhost:7233 where the stack listens, would hand production's rows to it).
 * Undefined when both are set, neither, or no stack runs.
 */
export function halfSetBesideStack(config: { databaseUrl?: string | undefined; temporal: { address?: string | undefined }; dataDir?: string | undefined }): ConfigError | undefined {
  if (Boolean(config.databaseUrl) === Boolean(config.temporal.address)) return undefined;
  if (!readRunningStack(defaultDataDir(config.dataDir))) return undefined;
  const [set, unset] = config.databaseUrl ? ['DATABASE_URL', 'TEMPORAL_ADDRESS'] : ['TEMPORAL_ADDRESS', 'DATABASE_URL'];
  return new ConfigError([
    `${unset}: is not set while ${set} is, and \`npm start\` runs on this machine: set both (the database and the Temporal of one deployment), or neither to use the local stack`,
  ]);
}

/** The running stack's endpoints, or undefined when none is written or its process is gone. */
export function readRunningStack(dataDir: string): Endpoints | undefined {
  const endpoints = readEndpointsFile(path.join(dataDir, 'endpoints.json'));
  return endpoints && isAlive(endpoints.pid) ? endpoints : undefined;
}

function readEndpointsFile(file: string): Endpoints | undefined {
  try {
    const parsed = JSON.parse(readFileSync(file, 'utf8')) as Partial<Endpoints>;
    if (typeof parsed.pid !== 'number' || typeof parsed.databaseUrl !== 'string' || typeof parsed.temporalAddress !== 'string') return undefined;
    return parsed as Endpoints;
  } catch {
    return undefined;
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** The local API token (generated once, kept in `<dataDir>/api-token`, mode 0600). */
export async function localApiToken(dataDir: string): Promise<{ token: string; file: string }> {
  const file = path.join(dataDir, 'api-token');
  if (existsSync(file)) {
    const token = (await readFile(file, 'utf8')).trim();
    if (token.length >= 24) return { token, file };
  }
  await mkdir(dataDir, { recursive: true });
  const token = `bo_local_${randomBytes(24).toString('hex')}`;
  await writeFile(file, `${token}\n`, { mode: 0o600 });
  return { token, file };
}
