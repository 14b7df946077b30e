// `npm start`: the same as `billing-outbox start` (src/cli/commands/start.ts).
import { runStart } from '../cli/commands/start.js';
import { runMain } from './run-main.js';

await runMain(runStart);
