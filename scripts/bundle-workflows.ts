/**
 * Build step (scripts/build.sh): bundles the compiled workflows once, for the package to ship
 * (src/temporal/workflow-bundle.ts finds the result). The same bundler the worker would run at
 * start-up, so the sandbox sees the same code.
 *
 *   tsx scripts/bundle-workflows.ts <workflows entry .js> <output .js> [--tracing]
 *
 * `--tracing`: with Temporal's OpenTelemetry workflow interceptors (src/tracing.ts).
 */
import { bundleWorkflowCode } from '@temporalio/worker';
import { writeFile } from 'node:fs/promises';
import path from 'node:path';
import { workflowTracingModule } from '../src/tracing.js';

const [workflowsPath, out, flag] = process.argv.slice(2);
if (!workflowsPath || !out) throw new Error('usage: tsx scripts/bundle-workflows.ts <workflows entry> <output file>');
const noop = () => undefined;
// webpack's module list is noise in a build log; its warnings and errors are not.
const logger = { trace: noop, debug: noop, info: noop, log: noop, warn: console.warn, error: console.error };
const tracing = flag === '--tracing' ? { workflowInterceptorModules: [workflowTracingModule()] } : {};
const { code } = await bundleWorkflowCode({ workflowsPath: path.resolve(workflowsPath), logger, ...tracing });
await writeFile(out, code);
