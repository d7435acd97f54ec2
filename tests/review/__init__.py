"""Regression tests written by review helpers: each failed before its fix."""
