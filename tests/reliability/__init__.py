"""Reliability tests (a package, so their module names cannot clash with tests elsewhere)."""
