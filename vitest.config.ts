import { defaultServerConditions } from 'vite';
import { defineConfig } from 'vitest/config';

/** Test files run after the rest of the suite, alone (see `projects` below). */
const ALONE = ['test/lane-window.test.ts'];

export default defineConfig({
  // A test that imports the package by its name ('billing-outbox') gets the sources, not a build.
  // Without vite's `module` condition, packages resolve as Node resolves them: @opentelemetry/api's
  // `module` build is for bundlers (imports without file extensions), which Node cannot load.
  ssr: { resolve: { conditions: ['billing-outbox-source', ...defaultServerConditions.filter((c) => c !== 'module')] } },
  test: {
    // The Temporal SDK's native module is unreliable in worker threads.
    pool: 'forks',
    // One PostgreSQL server and one Temporal dev server for the whole run (see test/global-setup.ts).
    globalSetup: ['test/global-setup.ts'],
    testTimeout: 60_000,
    hookTimeout: 120_000,
    projects: [
      {
        extends: true,
        test: {
          name: 'suite',
          include: ['test/**/*.test.ts'],
          exclude: ALONE,
          // Two files at once, on two cores. Three made the suite faster (503-579 s against 675 s on
          // a fresh clone) but, in three runs of three, a file that waits on time failed under the
          // load (a migration's lock wait, the README walkthrough's first event, the lane window).
          maxWorkers: 2,
        },
      },
      {
        extends: true,
        // Files that judge how long Temporal takes to answer: after the suite, one at a time, so
        // that other files' load is not read as Temporal's.
        test: { name: 'alone', include: ALONE, maxWorkers: 1, sequence: { groupOrder: 1 } },
      },
    ],
  },
});
