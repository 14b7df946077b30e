/**
 * The workflow bundle that `npm run build` makes once and ships (dist/workflow-bundle.js), so that a
 * worker installed from npm starts without running webpack over node_modules (where Temporal's
 * bundler would not compile TypeScript anyway). In a checkout (src/temporal/ → ../../workflow-bundle.js
 * is not there) it is absent and the worker bundles workflows/index.ts at start-up instead.
 */
import { existsSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

/** dist/src/temporal/../../workflow-bundle.js: dist/workflow-bundle.js in the package. */
export const SHIPPED_WORKFLOW_BUNDLE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'workflow-bundle.js');

/**
 * The same workflows with Temporal's OpenTelemetry workflow interceptors bundled in, for workers
 * with tracing on. A second bundle rather than interceptors in every one: with tracing off the
 * sandbox runs none of their code and calls no sink.
 */
export const SHIPPED_TRACING_WORKFLOW_BUNDLE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'workflow-bundle-tracing.js');

/** The shipped bundle as Worker.create's `workflowBundle`, or undefined when running from source. */
export function shippedWorkflowBundle(opts: { tracing?: boolean } = {}): { codePath: string } | undefined {
  const codePath = opts.tracing ? SHIPPED_TRACING_WORKFLOW_BUNDLE : SHIPPED_WORKFLOW_BUNDLE;
  return existsSync(codePath) ? { codePath } : undefined;
}
