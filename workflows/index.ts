// Every workflow the worker runs. Deterministic code only: no I/O, clocks or randomness here.
export { usageWorkflow } from './usage.js';
export { relayWorkflow } from './relay.js';
export { reconcileWorkflow } from './reconcile.js';
