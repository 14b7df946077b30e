/**
 * A Prisma client for the adapter tests, generated once per test file from
 * test/fixtures/prisma/schema.prisma, with @prisma/adapter-pg (Prisma 7's TypeScript query compiler:
 * no Rust query engine).
 *
 * `prisma generate` still fetches the schema engine from binaries.prisma.sh before it starts, although
 * generating does not run it; that host is out of reach here. PRISMA_SCHEMA_ENGINE_BINARY pointing at
 * a placeholder skips the fetch. Nothing else is downloaded, at install (npm does not run Prisma's
 * install scripts) or at run time.
 */
import { execFile } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { copyFile, mkdir, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { PrismaPg } from '@prisma/adapter-pg';
import { PROJECT_ROOT } from '../src/embedded/temporal.js';

/** What the tests use of a generated PrismaClient. */
export interface PrismaLike {
  $transaction<T>(fn: (tx: PrismaTx) => Promise<T>, options?: { timeout?: number }): Promise<T>;
  $disconnect(): Promise<void>;
}
export interface PrismaTx {
  $queryRawUnsafe(query: string, ...values: unknown[]): Promise<unknown>;
}

export interface GeneratedPrisma {
  /** A client on `url` through node-postgres with a pool of at most `max` connections. */
  connect(url: string, max: number): PrismaLike;
  remove(): Promise<void>;
}

export async function generatePrismaClient(): Promise<GeneratedPrisma> {
  // Its own folder: test files generate in parallel.
  const dir = path.join(PROJECT_ROOT, '.tools', `prisma-client-${randomUUID().slice(0, 8)}`);
  await mkdir(dir, { recursive: true });
  const schema = path.join(dir, 'schema.prisma');
  const placeholder = path.join(dir, 'no-schema-engine');
  await copyFile(path.join(PROJECT_ROOT, 'test/fixtures/prisma/schema.prisma'), schema);
  await writeFile(placeholder, '', { mode: 0o755 });
  await promisify(execFile)(path.join(PROJECT_ROOT, 'node_modules/.bin/prisma'), ['generate', '--schema', schema], {
    cwd: dir,
    // CHECKPOINT_DISABLE: no version check over the network either.
    env: { ...process.env, PRISMA_SCHEMA_ENGINE_BINARY: placeholder, PRISMA_HIDE_UPDATE_MESSAGE: '1', CHECKPOINT_DISABLE: '1' },
  });
  const { PrismaClient } = (await import(pathToFileURL(path.join(dir, 'client/client.ts')).href)) as {
    PrismaClient: new (options: { adapter: PrismaPg }) => PrismaLike;
  };
  return {
    connect: (url, max) => new PrismaClient({ adapter: new PrismaPg({ connectionString: url, max }) }),
    remove: () => rm(dir, { recursive: true, force: true }),
  };
}
