// `npm run api`: the same as `billing-outbox api` (src/cli/commands/api.ts).
import { runApi } from '../cli/commands/api.js';
import { runMain } from './run-main.js';

await runMain(runApi);
