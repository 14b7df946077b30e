// `npm run migrate`: the same as `billing-outbox migrate` (src/cli/commands/migrate.ts).
import { runCli } from '../cli/run.js';
import { loadConfig } from '../config.js';
import { loadDotEnv } from '../embedded/local-files.js';
import { runMain } from './run-main.js';

await runMain(async () => {
  loadDotEnv();
  const config = loadConfig();
  const unused = () => Promise.reject(new Error('migrate uses no pool and no Temporal client'));
  process.exitCode = await runCli(['migrate', ...process.argv.slice(2)], { config, db: unused, temporal: unused, out: process.stdout, err: process.stderr });
});
