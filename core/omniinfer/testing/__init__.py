"""Test helpers any plugin's test-suite can use: tiny checkpoints and the conformance kit."""
