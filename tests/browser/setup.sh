#!/usr/bin/env bash
# Fetch the JavaScript that renders Jupyter widgets in a static HTML export, for
# tests/test_browser.py: the widgets HTML manager (matching ipywidgets 8.1) and RequireJS.
# The test browser has no internet, so these are served from 127.0.0.1.
# Only two tarballs from the npm registry (no dependency tree): embed-amd.js is a
# self-contained bundle of @jupyter-widgets/base and controls.
set -euo pipefail
cd "$(dirname "$0")"
HTML_MANAGER="@jupyter-widgets/html-manager@1.0.15"
REQUIREJS="requirejs@2.3.8"
rm -rf vendor.tmp && mkdir -p vendor.tmp
npm pack --silent --pack-destination vendor.tmp "$HTML_MANAGER" "$REQUIREJS" >/dev/null
mkdir -p vendor.tmp/html-manager vendor.tmp/requirejs
tar -xzf vendor.tmp/jupyter-widgets-html-manager-*.tgz -C vendor.tmp/html-manager --strip-components=1
tar -xzf vendor.tmp/requirejs-*.tgz -C vendor.tmp/requirejs --strip-components=1
test -s vendor.tmp/html-manager/dist/embed-amd.js
test -s vendor.tmp/requirejs/require.js
rm -rf vendor && mkdir vendor
mv vendor.tmp/html-manager/dist vendor/html-manager
cp vendor.tmp/requirejs/require.js vendor/require.js
rm -rf vendor.tmp
echo "tests/browser/vendor ready: $(ls vendor/html-manager/embed-amd.js vendor/require.js | tr '\n' ' ')"
