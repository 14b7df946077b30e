// Lint: the recommended JS and TypeScript rules, plus a guard that keeps workflow code deterministic.
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['node_modules/', '.tools/', '.data/', 'dist/', 'coverage/'] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  {
    languageOptions: { parserOptions: { projectService: { allowDefaultProject: ['*.js', '*.mjs', 'bin/*.mjs'] }, tsconfigRootDir: import.meta.dirname } },
    rules: {
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_' }],
      // A forgotten await on an activity or a query is a real bug here.
      '@typescript-eslint/no-floating-promises': 'error',
      '@typescript-eslint/no-misused-promises': ['error', { checksVoidReturn: { arguments: false } }],
    },
  },
  {
    // Workflow code is replayed: no Node APIs, no I/O, no clocks or randomness outside the SDK's.
    files: ['workflows/**/*.ts'],
    rules: {
      'no-restricted-imports': [
        'error',
        {
          patterns: [
            { regex: '^(node:|pg$|stripe($|/)|@temporalio/(client|worker|activity)($|/))', message: 'workflow code must stay deterministic' },
            // Stripe's rules and the outbox statuses are pure constants (each file says so): the
            // retry Update's validator refuses past the same safe resend window the CLI and the
            // activity use, and a dead letter's run ends on the same statuses the SQL calls at Stripe.
            {
              regex: '^\\.\\./(src|activities)/(?!(stripe/rules|outbox/statuses)\\.js$)',
              allowTypeImports: true,
              message: 'workflows may import only types from activities and src (values: src/stripe/rules.js and src/outbox/statuses.js only)',
            },
          ],
        },
      ],
    },
  },
);
