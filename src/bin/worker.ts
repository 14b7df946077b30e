// `npm run worker`: the same as `billing-outbox worker` (src/cli/commands/worker.ts).
import { runWorker } from '../cli/commands/worker.js';
import { runMain } from './run-main.js';

await runMain(runWorker);
