import { defineConfig } from 'vitest/config';

/** The pure-logic tests alone (no PostgreSQL, no Temporal): what StrykerJS runs per mutant. */
export default defineConfig({
  test: {
    include: ['test/unit/**/*.test.ts'],
  },
});
