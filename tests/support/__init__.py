"""Test helpers shared by the integration and chaos suites (real processes on loopback)."""
