// `npm run migrate`: applies pending migrations to DATABASE_URL. Safe to run from several processes.
import { loadConfig } from '../config.js';
import { loadDotEnv } from '../embedded/local-files.js';
import { migrate, redactUrl } from '../db.js';
import { runMain } from './run-main.js';

await runMain(async () => {
  loadDotEnv();
  const config = loadConfig();
  if (!config.databaseUrl) throw new Error('DATABASE_URL is not set: it names the PostgreSQL database to migrate');
  const applied = await migrate(config.databaseUrl, { schema: config.databaseSchema });
  console.log(
    applied.length
      ? `applied ${applied.join(', ')} to ${redactUrl(config.databaseUrl)}, schema ${config.databaseSchema}`
      : `${redactUrl(config.databaseUrl)}, schema ${config.databaseSchema}, is up to date`,
  );
});
