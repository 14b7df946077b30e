/**
 * For the benchmarks that need PostgreSQL alone: an embedded server in a temporary folder, one
 * database migrated, a pool with the schema on its search path; all removed afterwards.
 */
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createPool, migrate } from '../src/db.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

export type BenchPool = ReturnType<typeof createPool>;

export async function withMigratedDatabase(name: string, run: (pool: BenchPool) => Promise<void>): Promise<void> {
  const tmp = await mkdtemp(path.join(os.tmpdir(), `billing-outbox-${name}-`));
  // PostgreSQL runs as its own user when started by root: it must be able to enter the folder.
  await chmod(tmp, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'postgres', persistent: false });
  try {
    const url = await server.createDatabase(name.replace(/\W/g, '_'));
    await migrate(url);
    const withPath = new URL(url);
    withPath.searchParams.set('options', `-c search_path=${schemaFor().name}`);
    const pool = createPool(withPath.toString(), 2);
    try {
      await run(pool);
    } finally {
      await pool.end();
    }
  } finally {
    await server.stop();
    await rm(tmp, { recursive: true, force: true });
  }
}
