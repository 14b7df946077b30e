import { defaultServerConditions } from 'vite';
import { defineConfig } from 'vitest/config';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/**
 * The files that take a minute or more (their times in CI), in that order. A fresh clone has no
 * record of earlier runs, so vitest would start the largest files first: these short files full of
 * waiting (outages, failovers, kills) started last and left one worker running alone at the end.
 */
const SLOW_FILES = ['db-failover', 'hot-spots', 'restarts', 'services-away', 'pipeline', 'running-outages', 'key-roll', 'limits', 'package', 'demo'];

class SlowFilesFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const rank = (f: TestSpecification) => {
      const i = SLOW_FILES.findIndex((name) => f.moduleId.endsWith(`/test/${name}.test.ts`));
      return i === -1 ? SLOW_FILES.length : i;
    };
    const sorted = await super.sort(files);
    return sorted.map((f, i) => ({ f, i })).sort((a, b) => rank(a.f) - rank(b.f) || a.i - b.i).map(({ f }) => f);
  }
}

export default defineConfig({
  // A test that imports the package by its name ('billing-outbox') gets the sources, not a build.
  // Without vite's `module` condition, packages resolve as Node resolves them: @opentelemetry/api's
  // `module` build is for bundlers (imports without file extensions), which Node cannot load.
  ssr: { resolve: { conditions: ['billing-outbox-source', ...defaultServerConditions.filter((c) => c !== 'module')] } },
  test: {
    include: ['test/**/*.test.ts'],
    // The Temporal SDK's native module is unreliable in worker threads.
    pool: 'forks',
    // One PostgreSQL server and one Temporal dev server for the whole run (see test/global-setup.ts).
    globalSetup: ['test/global-setup.ts'],
    testTimeout: 60_000,
    hookTimeout: 120_000,
    maxWorkers: 2,
    sequence: { sequencer: SlowFilesFirst },
  },
});
